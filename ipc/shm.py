"""POSIX shared-memory segments carrying image pixels between glimpse processes.

Implemented directly on /dev/shm files + mmap rather than multiprocessing.shared_memory: its
resource_tracker unlinks segments when the *creating* process exits (or warns about "leaks"),
while our design hands ownership to another process (tokenizer creates, scheduler unlinks).

Lifecycle: the tokenizer `create`s a segment (space reserved up front), writes pixels, sends the
tiny `ShmRef`; workers `attach` + `tensor()` (zero-copy), then `close()`; the scheduler `unlink`s
when no step can need the pixels; the launcher `sweep`s everything of its launch id.
"""

from __future__ import annotations

import errno
import mmap
import os
from types import TracebackType
from typing import TYPE_CHECKING, Self

import msgspec

from ipc.launch import cleanup_launch_dir, dead_launch_dirs, launch_owner_gone, shm_prefix

if TYPE_CHECKING:
    import torch

# torch is imported lazily inside the functions that need it: ShmRef is embedded in the message
# structs, and processes that only route messages (frontend) should not pay torch's import.

SHM_DIR = "/dev/shm"

# Errors from posix_fallocate on tmpfs that mean "no room", as opposed to a bug: ENOSPC when the
# mount's size limit is hit, ENOMEM when a memory cgroup refuses the pages, EFBIG for absurd sizes.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.ENOMEM, errno.EFBIG})


class ShmError(Exception):
    """A shared-memory segment could not be created, attached or read as described."""


class ShmFullError(ShmError):
    """/dev/shm (or the memory cgroup) has no room for the requested segment."""


class ShmRef(msgspec.Struct, frozen=True):
    """Pointer to a tensor in a shm segment; this, not the pixels, travels in messages."""

    name: str
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> "float32" (the form stored in ShmRef.dtype)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """Inverse of dtype_name; rejects names that are not torch dtypes."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ShmError(f"unknown dtype {name!r}")
    return dtype


def _path(name: str) -> str:
    # Names become file names directly under /dev/shm: no separators, no "." / "..".
    if not name or "/" in name or "\0" in name or name in (".", "..") or len(name) > 255:
        raise ValueError(f"invalid shm segment name {name!r}")
    return os.path.join(SHM_DIR, name)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class ShmSegment:
    """One mapped /dev/shm segment holding a single tensor at offset 0.

    Views from `tensor()` keep the mapping alive on their own (torch holds a reference to the
    mmap object in the tensor's storage), so `close()` never leaves a dangling view: it drops the
    segment's reference and the memory is unmapped when the last view is garbage-collected.
    """

    def __init__(self, name: str, mm: mmap.mmap, nbytes: int, writable: bool, ref: ShmRef | None) -> None:
        self.name = name
        self.nbytes = nbytes
        self.writable = writable
        self.ref = ref
        self._mmap: mmap.mmap | None = mm

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, nbytes: int) -> ShmSegment:
        """Create a new segment of `nbytes`, reserving the memory now.

        Raises ShmFullError when /dev/shm cannot hold it (no partial file is left behind) and
        FileExistsError when the name is taken (O_EXCL: never silently share someone's segment).
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        path = _path(name)
        # mmap cannot map zero bytes; an empty tensor still gets a 1-byte segment so that every
        # ref names a real file and the unlink/sweep bookkeeping stays uniform.
        size = max(nbytes, 1)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # posix_fallocate, not ftruncate: a sparse file would "succeed" now and SIGBUS the
            # process that first touches a page /dev/shm cannot back.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            _unlink_path(path)
            if exc.errno in _FULL_ERRNOS:
                raise ShmFullError(f"no room in {SHM_DIR} for {nbytes} bytes ({name}): {exc.strerror}") from exc
            raise
        except BaseException:
            os.close(fd)
            _unlink_path(path)
            raise
        # The mapping stays valid without the descriptor; closing it now avoids fd exhaustion
        # when many images are in flight.
        os.close(fd)
        return cls(name, mm, nbytes, writable=True, ref=None)

    @classmethod
    def create_from_tensor(cls, name: str, tensor: torch.Tensor) -> tuple[ShmSegment, ShmRef]:
        """Create a segment sized for `tensor` and copy it in; unlinks again if the copy fails."""
        seg = cls.create(name, tensor.nbytes)
        try:
            ref = seg.write_tensor(tensor)
        except BaseException:
            seg.close()
            cls.unlink(name)
            raise
        return seg, ref

    @classmethod
    def attach(cls, ref: ShmRef) -> ShmSegment:
        """Map an existing segment for reading.

        The file is opened O_RDONLY so this process can never modify the producer's pixels. The
        mapping is MAP_PRIVATE (copy-on-write) rather than PROT_READ: torch has no read-only
        tensors and warns on non-writable buffers, and a stray in-place op on a PROT_READ view
        would SIGSEGV. Reads still hit the shared pages directly (zero-copy); a write would only
        copy the touched page into this process.
        Raises FileNotFoundError if the segment is gone, ShmError if it is smaller than `ref`.
        """
        path = _path(ref.name)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < ref.nbytes:
                raise ShmError(f"segment {ref.name} holds {size} bytes, ref says {ref.nbytes}")
            if size == 0:
                raise ShmError(f"segment {ref.name} is empty")
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        return cls(ref.name, mm, ref.nbytes, writable=False, ref=ref)

    # ---- data ----------------------------------------------------------------------------------

    def _mapping(self) -> mmap.mmap:
        if self._mmap is None:
            raise ShmError(f"segment {self.name} is closed")
        return self._mmap

    def write_tensor(self, tensor: torch.Tensor) -> ShmRef:
        """Copy a CPU tensor into the segment at offset 0 and return its ref.

        A contiguous tensor is one memcpy; a strided one is gathered in the same single pass.
        """
        import torch

        if not self.writable:
            raise ShmError(f"segment {self.name} is attached read-only")
        if tensor.device.type != "cpu":
            raise ShmError(f"tensor must be on the CPU, got {tensor.device}")
        if tensor.nbytes > self.nbytes:
            raise ShmError(f"tensor needs {tensor.nbytes} bytes, segment {self.name} has {self.nbytes}")
        shape = tuple(int(d) for d in tensor.shape)
        ref = ShmRef(name=self.name, nbytes=tensor.nbytes, dtype=dtype_name(tensor.dtype), shape=shape)
        if tensor.numel() > 0:
            dst = torch.frombuffer(self._mapping(), dtype=tensor.dtype, count=tensor.numel()).view(shape)
            dst.copy_(tensor)
            # Drop the temporary view now so the mapping's lifetime is not tied to this frame.
            del dst
        self.ref = ref
        return ref

    def tensor(self, ref: ShmRef | None = None) -> torch.Tensor:
        """Zero-copy view of the tensor described by `ref` (default: the ref attached/written).

        Lifetime: the view (and anything derived from it that shares storage) keeps the mapping
        alive, even past `close()`. The data stays readable after the scheduler unlinks the name,
        since unlink only removes the name; the pages are freed when the last mapping goes away.
        So drop views promptly (e.g. once copied to the GPU) to return memory.
        """
        import torch

        ref = ref if ref is not None else self.ref
        if ref is None:
            raise ShmError(f"segment {self.name} has no ref: pass one")
        if ref.name != self.name:
            raise ShmError(f"ref names {ref.name}, segment is {self.name}")
        dtype = parse_dtype(ref.dtype)
        numel = _numel(ref.shape)
        if numel * dtype.itemsize != ref.nbytes:
            raise ShmError(f"ref {ref} is inconsistent: shape x itemsize != nbytes")
        if ref.nbytes > len(self._mapping()):
            raise ShmError(f"ref {ref} exceeds the {len(self._mapping())}-byte mapping")
        if numel == 0:
            # torch.frombuffer rejects count=0; an empty tensor shares nothing anyway.
            return torch.empty(ref.shape, dtype=dtype)
        return torch.frombuffer(self._mapping(), dtype=dtype, count=numel).view(ref.shape)

    # ---- teardown ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Release this segment's mapping; idempotent. Does not unlink (the scheduler owns that).

        Dropping the reference instead of calling mmap.close() is deliberate: torch views do
        not pin the buffer export, so an explicit munmap would turn live views into segfaults.
        With no live views CPython unmaps right here (refcount reaches zero).
        """
        self._mmap = None

    @staticmethod
    def unlink(name: str) -> bool:
        """Remove the segment's name from /dev/shm; True if it existed. Idempotent."""
        return _unlink_path(_path(name))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "rw" if self.writable else "ro"
        state = "closed" if self.closed else "open"
        return f"ShmSegment({self.name!r}, nbytes={self.nbytes}, {mode}, {state})"


def _unlink_path(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def list_segments(launch_id: str) -> list[str]:
    """Names of every /dev/shm segment belonging to `launch_id`, sorted."""
    prefix = shm_prefix(launch_id)
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if e.startswith(prefix))


def sweep(launch_id: str) -> int:
    """Unlink every segment of `launch_id`; returns how many this call removed.

    Safe to race with other sweepers or with the scheduler's own unlinks (missing files are
    skipped), so the launcher can call it at start, on clean stop and after a crash.
    """
    return sum(_unlink_path(os.path.join(SHM_DIR, name)) for name in list_segments(launch_id))


def sweep_dead_launches() -> dict[str, int]:
    """Remove the segments and socket directories of every launch whose owner is gone (see
    ipc.launch.launch_owner_gone); returns segments removed per launch id. Launches of other
    users, other pid namespaces or hand-made ids are left alone."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        entries = []
    ids = {e.removeprefix("glimpse-").split("-", 1)[0] for e in entries if e.startswith("glimpse-")}
    removed: dict[str, int] = {}
    for launch_id in sorted(ids):
        if launch_owner_gone(launch_id):  # False for anything that is not an id made by new_launch_id
            prefix = shm_prefix(launch_id)
            # Another user's segment in the sticky /dev/shm cannot be unlinked: skip, not fail.
            removed[launch_id] = sum(_try_unlink(os.path.join(SHM_DIR, e)) for e in entries if e.startswith(prefix))
    for launch_id in dead_launch_dirs():
        cleanup_launch_dir(launch_id)
        removed.setdefault(launch_id, 0)
    return removed


def _try_unlink(path: str) -> bool:
    try:
        return _unlink_path(path)
    except PermissionError:
        return False


def segment_name(launch_id: str, key: str) -> str:
    """Conventional segment name: launch prefix + a caller key (e.g. image hash + counter)."""
    name = shm_prefix(launch_id) + key
    _path(name)
    return name


def link_segment(existing_name: str, new_name: str) -> bool:
    """Give an existing segment a second name (a hard link: same pages, no copy).

    Each request holds its own name for every image, so the scheduler can unlink a finished
    request's names without knowing who else uses the pixels; the pages live until the last name
    and mapping are gone. Returns False when `existing_name` is gone (unlinked meanwhile), so the
    caller falls back to writing the pixels; FileExistsError if `new_name` is taken.
    """
    try:
        os.link(_path(existing_name), _path(new_name))
    except FileNotFoundError:
        return False
    return True


def find_segments(launch_id: str, key_prefix: str) -> list[str]:
    """Names of `launch_id`'s segments whose key (the part after the launch prefix) starts with `key_prefix`."""
    prefix = shm_prefix(launch_id) + key_prefix
    return [n for n in list_segments(launch_id) if n.startswith(prefix)]
