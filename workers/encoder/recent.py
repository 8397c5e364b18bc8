"""A shared encoder's recent entries (``--shared-encoders``, ``--encoder-cache-mb``): what it computed lately, by
entry key, in host memory, so that a replica asking for an image another replica had encoded gets it without a ViT
run.

Each replica's scheduler owns its own embedding-cache index, so with shared encoders one image sent to two replicas
was encoded twice. The encoder keeps its last entries (least recently used out first, up to a byte budget) and lands
a copy for every asker: each scheduler still owns, imports and releases its own landing, so nothing about the
landing's life changes. Host memory, not the GPU's: the encoder's GPU is the language model's when colocated, and a
hit costs a host-to-device copy of the entry (a 64 MiB Qwen3-VL-8B 1080p entry: a few ms), far less than its ViT.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor


class RecentEntries:
    """Entries by key, least recently used evicted first, at most ``budget_bytes`` of them in host memory."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.entries: OrderedDict[bytes, Tensor] = OrderedDict()
        self.bytes = 0

    def get(self, key: bytes) -> Tensor | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: bytes, entry: Tensor) -> None:
        """Keep a host copy of ``entry`` (any device); one larger than the whole budget is not kept."""
        size = entry.numel() * entry.element_size()
        if size > self.budget or key in self.entries:
            return
        while self.bytes + size > self.budget:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self.entries[key] = entry.to("cpu", copy=True) if entry.device.type != "cpu" else entry.clone()
        self.bytes += size

    def __len__(self) -> int:
        return len(self.entries)

