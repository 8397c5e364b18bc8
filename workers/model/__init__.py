"""The model-worker process role, one per GPU (TP rank): ``process.run_model_worker`` runs each step plan on the
engine's ``ModelRunner`` and reports the sampled tokens. Imports ``ipc``, ``workers.common``, ``workers.config``
and the engine; never another role."""
