"""Model-side execution of a step plan: ``ModelRunner`` (pixels, batched ViT, embedding store, LM forward, sampling),
step inputs and batching, the sampler and logits processors, prompt log probabilities, structured-output masks,
decode and piecewise CUDA graphs, and start-up warm-up."""
