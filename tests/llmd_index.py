"""An indexer of KV-cache events written from the outside, to check glimpse's events the way llm-d uses them:
a strict decoder of vLLM 0.24's layout (arrays outside, events as maps tagged under "type"; unknown or missing
fields fail) and llm-d's block keys (docs/kv-events.md, "What an indexer computes"): FNV-64a over the canonical
CBOR of ``[parent, tokens, extra]``, chained from ``hash([fnv64a(seed), null, model])``, extra being null or
``[{"Hash": identifier}, ...]`` for the media a block overlaps. It shares no code with glimpse's publisher."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgspec

_STORED_REQUIRED = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}
_STORED_OPTIONAL = {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
_REMOVED_REQUIRED = {"type", "block_hashes", "medium"}
_U64 = 1 << 64


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(n)


def cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 7049 section 3.9) of the few shapes the keys hash: unsigned ints, text, null,
    arrays, maps (keys sorted by encoded length, then bytes)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise TypeError("no booleans in block keys")
    if isinstance(value, int):
        assert 0 <= value < _U64
        return _cbor_head(0, value)
    if isinstance(value, str):
        raw = value.encode()
        return _cbor_head(3, len(raw)) + raw
    if isinstance(value, list):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    if isinstance(value, dict):
        items = sorted((cbor(k), cbor(v)) for k, v in value.items())
        items.sort(key=lambda kv: (len(kv[0]), kv[0]))
        return _cbor_head(5, len(items)) + b"".join(k + v for k, v in items)
    raise TypeError(type(value))


def fnv64a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for byte in data:
        h = ((h ^ byte) * 0x100000001B3) % _U64
    return h


def block_key(parent: int, tokens: list[int] | None, ids: list[str] | None) -> int:
    extra = None if ids is None else [{"Hash": i} for i in ids]
    return fnv64a(cbor([parent, tokens, extra]))


def _check_int_list(value: Any, what: str, bound: int = _U64) -> list[int]:
    assert isinstance(value, list) and all(isinstance(v, int) and 0 <= v < bound for v in value), what
    return value


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """A batch as vLLM 0.24 writes it, checked field by field."""
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) in (2, 3), raw
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    assert isinstance(ts, float) and isinstance(events, list) and (rank is None or isinstance(rank, int))
    for ev in events:
        assert isinstance(ev, dict), f"not a map-encoded event: {ev!r}"
        kind = ev.get("type")
        if kind == "BlockStored":
            assert _STORED_REQUIRED <= ev.keys() <= _STORED_REQUIRED | _STORED_OPTIONAL, sorted(ev)
            hashes = _check_int_list(ev["block_hashes"], "block_hashes")
            _check_int_list(ev["token_ids"], "token_ids", 1 << 32)
            assert ev["parent_block_hash"] is None or 0 <= ev["parent_block_hash"] < _U64
            assert isinstance(ev["block_size"], int) and len(ev["token_ids"]) == ev["block_size"] * len(hashes)
            assert ev["medium"] in ("GPU", "CPU") and ev["lora_id"] is None and ev["lora_name"] is None
            extra = ev.get("extra_keys")
            if extra is not None:
                assert isinstance(extra, list) and len(extra) == len(hashes)
                for e in extra:  # vLLM's (identifier, item offset - block start) per media item
                    assert e is None or (isinstance(e, list) and e and all(
                        isinstance(k, list) and len(k) == 2 and isinstance(k[0], str) and isinstance(k[1], int) for k in e))
        elif kind == "BlockRemoved":
            assert _REMOVED_REQUIRED <= ev.keys() <= _REMOVED_REQUIRED | {"group_idx"}, sorted(ev)
            _check_int_list(ev["block_hashes"], "block_hashes")
        else:
            assert ev == {"type": "AllBlocksCleared"}, ev
    return ts, events, rank


@dataclass
class Index:
    """One pod's blocks as llm-d's indexer keeps them: request keys computed from each event's tokens and media
    identifiers, chained through the engine-key -> request-key map of earlier events."""

    block_size: int
    model: str
    seed: str = ""
    by_engine: dict[int, int] = field(default_factory=dict)
    keys: set[int] = field(default_factory=set)
    # The device tiers ("GPU", "CPU") holding each engine key, as llm-d keeps one entry per (pod, tier): a key
    # leaves the index with its last tier.
    tiers: dict[int, set[str]] = field(default_factory=dict)

    def root(self) -> int:
        """The chain's start: the seed's FNV-64a hashed with no tokens and the model name as extra."""
        return fnv64a(cbor([fnv64a(self.seed.encode()), None, self.model]))

    def chain(self, parent: int, tokens: list[int], extra: list[list[str] | None]) -> list[int]:
        bs, out = self.block_size, []
        for i in range(len(tokens) // bs):
            parent = block_key(parent, tokens[i * bs : (i + 1) * bs], extra[i])
            out.append(parent)
        return out

    def apply(self, ev: dict[str, Any]) -> None:
        if ev["type"] == "AllBlocksCleared":
            self.by_engine.clear()
            self.keys.clear()
            self.tiers.clear()
        elif ev["type"] == "BlockRemoved":
            for h in ev["block_hashes"]:
                held = self.tiers.get(h, set())
                held.discard(ev["medium"])
                if not held:
                    self.tiers.pop(h, None)
                    self.keys.discard(self.by_engine.pop(h, -1))
        elif ev.get("kv_cache_spec_kind") in (None, "full_attention"):
            assert ev["block_size"] == self.block_size, "llm-d's blockSizeTokens must equal the engine's block size"
            parent = ev["parent_block_hash"]
            start = self.root() if parent is None else self.by_engine[parent]
            # llm-d keeps each entry's identifier and drops the offset (kvblock.ParseRawExtraKeys).
            extra = [None if e is None else [k[0] for k in e] for e in ev.get("extra_keys") or [None] * len(ev["block_hashes"])]
            keys = self.chain(start, ev["token_ids"], extra)
            self.by_engine.update(zip(ev["block_hashes"], keys, strict=True))
            self.keys.update(keys)
            for h in ev["block_hashes"]:
                self.tiers.setdefault(h, set()).add(ev["medium"])

    def request_keys(self, tokens: list[int], media: list[tuple[str, int, int]]) -> list[int]:
        """A request's keys: its rendered tokens (real media token ids) and, per media item, (identifier, offset,
        length) of its placeholder range; each block carries the items it overlaps, in offset order."""
        bs = self.block_size
        ordered = sorted(media, key=lambda m: m[1])
        extra: list[list[str] | None] = []
        for i in range(len(tokens) // bs):
            ids = [ident for ident, off, n in ordered if off < (i + 1) * bs and off + n > i * bs]
            extra.append(ids or None)
        return self.chain(self.root(), tokens, extra)
