"""The tokenizer process role: HTTP body in, ready prompt with pixels in shared memory out.

``process.run_tokenizer`` is the entry point; ``worker`` handles one request's steps (admit, download,
prepare), ``service`` runs them on an asyncio loop with its sockets. ``requests/`` parses and checks the
OpenAI request bodies, ``media/`` fetches, decodes, hashes and writes images and videos. Imports ``ipc``,
``workers.common``, ``workers.config`` and the engine; never another role."""
