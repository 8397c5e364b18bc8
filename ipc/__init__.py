"""glimpse IPC substrate: per-launch naming, shared-memory segments, typed ZMQ channels.

The only package allowed to touch zmq or /dev/shm directly. Submodules are imported explicitly
(`from ipc.shm import ShmRef`) so a process pays only for what it uses (ipc.shm defers torch).
"""
