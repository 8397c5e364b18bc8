"""Structured outputs with llguidance: a request's ``StructuredSpec`` (JSON schema, any JSON object, regex,
choice, or a Lark grammar for tool calls) becomes a grammar, and a matcher per sequence turns the grammar
into a token mask every step.

Where the work happens:
- a tokenizer validates the spec (``validate``, cached by spec) so a schema the engine cannot compile is
  a 400 naming the reason, before anything is scheduled;
- the scheduler→worker broadcast carries only the spec, once, inside ``NewSeq``'s sampling params;
- model worker rank 0 compiles it on a background thread (``GrammarBook``, cached by spec: a new
  sequence deep-copies a compiled matcher), so neither the scheduler loop nor a step waits for a
  compile unless the step samples that very sequence;
- masks are filled on the CPU after the step's forward is queued, while the GPU runs it, and applied
  on the device as one masked fill (``apply_bitmask``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ipc.prompts import StructuredSpec
from workers.common.errors import BadRequest
from workers.engine.runner.batching import to_device

log = logging.getLogger("glimpse.grammar")

CACHE_SIZE = 256  # compiled grammars kept per process, least recently used out first
# Compact JSON: a flexible-whitespace grammar lets a model pad its answer with blanks for ever.
JSON_OPTIONS: Any = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The spec cannot be compiled (the message says why)."""


def to_grammar(spec: StructuredSpec) -> str:
    """The llguidance grammar of a spec (a JSON document or Lark text; not validated here), without forced tokens
    (``unforced``)."""
    return unforced(_grammar(spec))


def unforced(grammar: str) -> str:
    """``grammar`` (llguidance's JSON) under a top-level Lark rule that turns token forcing off. Forcing lets the
    mask offer only the tokenizer's own spelling of bytes the grammar forces, and llguidance 1.9.1 can spell them
    with an added token its matcher then refuses (text "<tool_call>" in a regex on a Qwen vocabulary: the mask
    offered only the added token, consuming it broke the grammar, and the answer ended short of it). Unforced,
    every spelling of the bytes is allowed and each one consumes."""
    # llguidance's constructors give its JSON, except grammar_from_lark, which gives the Lark text as it is.
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    inner = top["grammars"]
    if not inner or not isinstance(inner[0], dict):
        return grammar
    first = inner[0].get("name") or "g0"
    inner[0]["name"] = first
    head = {"name": "unforced", "lark_grammar": f'%llguidance {{"no_forcing": true}}\nstart: @{first}'}
    top["grammars"] = [head, *inner]
    return json.dumps(top)


def _grammar(spec: StructuredSpec) -> str:
    import llguidance

    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON schema must be an object")
        return str(llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS))
    if spec.kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS))
    if spec.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec.value))
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        return str(llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices)))
    if spec.kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(spec.value))
    raise GrammarError(f"unknown structured output kind {spec.kind!r}")


class _Tokenizers:
    """One llguidance tokenizer per (HF tokenizer, vocabulary size) in this process: building it walks
    the whole vocabulary once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: dict[tuple[int, int], Any] = {}

    def get(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int] = ()) -> Any:
        import llguidance.hf

        key = (id(hf_tokenizer), vocab_size)
        with self._lock:
            tok = self._made.get(key)
            if tok is None:
                eos = list(eos_ids) or None
                tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
                self._made[key] = tok
            return tok


TOKENIZERS = _Tokenizers()


class Validator:
    """Tokenizer side: refuses specs the engine cannot compile, remembering recent verdicts."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
        self.hf_tokenizer, self.vocab_size, self.eos_ids = hf_tokenizer, vocab_size, tuple(eos_ids)
        self._seen: OrderedDict[StructuredSpec, str] = OrderedDict()

    def __call__(self, spec: StructuredSpec) -> None:
        """Raise GrammarError naming the reason when ``spec`` cannot be compiled."""
        error = self._seen.get(spec)
        if error is None:
            error = self._check(spec)
            self._seen[spec] = error
            if len(self._seen) > CACHE_SIZE:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(spec)
        if error:
            raise GrammarError(error)

    @property
    def tool_tags(self) -> tuple[int | None, int | None]:
        """Token ids of <tool_call> and </tool_call> where each is one token of the vocabulary."""
        from workers.common.tools import CLOSE, OPEN

        out: list[int | None] = []
        for tag in (OPEN, CLOSE):
            ids = self.hf_tokenizer(tag, add_special_tokens=False)["input_ids"]
            out.append(int(ids[0]) if len(ids) == 1 else None)
        return out[0], out[1]

    def check(self, spec: StructuredSpec, param: str) -> None:
        """As a request check: BadRequest (400) naming ``param`` and the engine's reason."""
        try:
            self(spec)
        except GrammarError as exc:
            message = f"'{param}' cannot be enforced: {exc}"
            raise BadRequest(message, param=param, code="invalid_structured_output") from None

    def _check(self, spec: StructuredSpec) -> str:
        import llguidance

        try:
            grammar = to_grammar(spec)
        except (GrammarError, ValueError) as exc:
            return str(exc)
        tok = TOKENIZERS.get(self.hf_tokenizer, self.vocab_size, self.eos_ids)
        error = str(llguidance.LLMatcher.validate_grammar(grammar, tok))
        if not error:
            # validate_grammar passes grammars whose build still fails (a choice of 100,000 strings overflows
            # llguidance's symbol table), and the worker would then fail the request with a 500: build it here.
            matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
            error = matcher.get_error() if matcher.is_error() else ""
        return error.split("\n<backtrace>", 1)[0]  # a Rust panic's backtrace is no reason a client can act on


class GrammarBook:
    """Worker side (rank 0): the matcher of every constrained sequence, and the compiled grammars."""

    parallel_from = 2  # masks of this many sequences or more are filled on llguidance's thread pool

    def __init__(self, model_dir: str, vocab_size: int, eos_ids: Sequence[int] = (), threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        # The tokenizers load on the pool too (a real vocabulary takes a second or so): the first
        # constrained request waits for them only if it comes that early.
        self._tokenizer = self._pool.submit(self._load_tokenizer, model_dir, vocab_size, tuple(eos_ids))
        self._compiled: OrderedDict[StructuredSpec, Future[Any]] = OrderedDict()
        # rid -> a future matcher (compiling) or the sequence's own matcher, plus tokens to replay into it.
        self._matchers: dict[str, Any] = {}
        self._pending: dict[str, tuple[Future[Any], list[int]]] = {}
        # Sampled tokens not fed to their matcher yet: that happens at the sequence's next mask, after the
        # next forward is queued, so it overlaps the GPU instead of delaying the next step.
        self._unconsumed: dict[str, list[int]] = {}
        self._executor: Any = None

    @staticmethod
    def _load_tokenizer(model_dir: str, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:
        from transformers import AutoTokenizer

        return TOKENIZERS.get(AutoTokenizer.from_pretrained(model_dir), vocab_size, eos_ids)

    def _compile(self, spec: StructuredSpec) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer.result(), to_grammar(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def _template(self, spec: StructuredSpec) -> Future[Any]:
        future = self._compiled.get(spec)
        if future is None:
            future = self._pool.submit(self._compile, spec)
            self._compiled[spec] = future
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(spec)
        return future

    def add(self, rid: str, spec: StructuredSpec, output_ids: Sequence[int] = ()) -> None:
        """A constrained sequence (again, after a preemption: its output so far is replayed)."""
        self._pending[rid] = (self._template(spec), list(output_ids))

    def fork(self, parent: str, child: str) -> None:
        if parent in self._matchers:
            self._catch_up(parent)
        if parent in self._pending:
            future, replay = self._pending[parent]
            self._pending[child] = (future, list(replay))
        elif parent in self._matchers:
            self._matchers[child] = self._matchers[parent].deep_copy()

    def remove(self, rid: str) -> None:
        self._matchers.pop(rid, None)
        self._pending.pop(rid, None)
        self._unconsumed.pop(rid, None)

    def __contains__(self, rid: str) -> bool:
        return rid in self._matchers or rid in self._pending

    def _matcher(self, rid: str) -> Any:
        pending = self._pending.pop(rid, None)
        if pending is not None:
            future, replay = pending
            matcher = future.result().deep_copy()  # waits only if this sequence samples before its compile ends
            if replay and not matcher.consume_tokens(replay):
                log.warning("sequence %s: its output no longer fits its grammar: %s", rid, matcher.get_error())
            self._matchers[rid] = matcher
        self._catch_up(rid)
        return self._matchers[rid]

    def _catch_up(self, rid: str) -> None:
        for token in self._unconsumed.pop(rid, ()):
            self.accept(rid, token)

    def fill(self, rids: Sequence[str]) -> torch.Tensor:
        """Bitmasks [len(rids), ceil(vocab / 32)] int32 on the CPU, one row per constrained rid."""
        import llguidance
        import llguidance.torch as lt

        mask = torch.full((len(rids), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        matchers = [(self._matcher(rid), row) for row, rid in enumerate(rids)]
        if len(matchers) < self.parallel_from:
            for matcher, row in matchers:
                lt.fill_next_token_bitmask(matcher, mask, row)
        elif matchers:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            lt.fill_next_token_bitmask_par(self._executor, matchers, mask)
        return mask

    def accept(self, rid: str, token: int) -> None:
        matcher = self._matchers.get(rid)
        if matcher is not None and not matcher.consume_token(token):
            log.warning("sequence %s: token %d broke its grammar: %s", rid, token, matcher.get_error())

    def mask_for(self, rids: Sequence[str]) -> Callable[[torch.Tensor], None] | None:
        """The sampler's masking hook for a step sampling ``rids`` (None when none is constrained). Call it
        after the step's forward is queued: the masks are filled now, on the CPU, while the GPU runs."""
        rows = [i for i, rid in enumerate(rids) if rid in self]
        if not rows:
            return None
        mask = self.fill([rids[i] for i in rows])
        # Row indices ride along as a first column: one pinned, non-blocking copy for the whole step.
        packed = torch.cat([torch.tensor(rows, dtype=torch.int32).unsqueeze(1), mask], dim=1)
        return lambda logits: apply_bitmask(logits, packed)

    def accept_all(self, rids: Sequence[str], tokens: Sequence[int]) -> None:
        """Record the step's sampled tokens; each matcher takes its token before its next mask."""
        for rid, token in zip(rids, tokens, strict=True):
            if rid in self._matchers:
                self._unconsumed.setdefault(rid, []).append(token)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def apply_bitmask(logits: torch.Tensor, packed: torch.Tensor) -> None:
    """Each row of ``packed`` (int32, host) is [batch row, mask words...]: that row of ``logits`` keeps only
    the tokens whose bit is set (in place, on the device)."""
    device = logits.device
    sent = to_device([packed], device)
    at, words = sent[:, 0].long(), sent[:, 1:]
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
    logits[at] = logits[at].masked_fill(~allowed, float("-inf"))

