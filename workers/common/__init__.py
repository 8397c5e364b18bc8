"""What several process roles share: the OpenAI-shaped request error, tool-call grammar and parsing, the
incremental detokenizer, child-process set-up and GC watch, and step traces. Imports ``ipc`` only."""
