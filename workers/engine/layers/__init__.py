"""Building blocks of models: tensor-parallel linears, vocab embedding and RMSNorm, multimodal rotary (M-RoPE), vision
attention (full and windowed) and the vision MLP, and the ViT call plans that batch images. Imports only ``kernels``."""
