"""The scheduler process role, one per replica: ``process.run_scheduler`` drives the engine's scheduling core
between tokenizers, model workers and the frontend; ``stats`` builds its periodic report, ``kv_events`` publishes
prefix-cache block events, ``shm_ledger`` owns shared-memory segments' lifetimes, ``logprobs`` renders log
probabilities. Imports ``ipc``, ``workers.common``, ``workers.config`` and the engine; never another role."""
