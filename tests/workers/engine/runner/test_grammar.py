"""The grammar book of a model worker: compiled once per spec, a matcher per sequence (forked with its
sequence, replayed after a preemption), masks that allow exactly what the grammar allows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from ipc.prompts import StructuredSpec
from workers.engine.models import load_spec
from workers.engine.runner.grammar import GrammarBook, GrammarError, Validator, apply_bitmask

CHOICE = StructuredSpec("choice", json.dumps(["paid", "void"]))


@pytest.fixture(scope="module")
def book(demo_model_dir: Path) -> GrammarBook:
    spec = load_spec(demo_model_dir)
    return GrammarBook(str(demo_model_dir), spec.vocab_size, spec.eos_token_ids)


def allowed(book: GrammarBook, rid: str) -> set[int]:
    logits = torch.zeros(1, book.vocab_size)
    hook = book.mask_for([rid])
    assert hook is not None
    hook(logits)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_masks_follow_the_grammar_and_forks_go_their_own_way(book: GrammarBook, demo_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    paid, void = (tok(w, add_special_tokens=False)["input_ids"] for w in ("paid", "void"))
    book.add("a", CHOICE)
    first = allowed(book, "a")
    assert paid[0] in first and void[0] in first and tok.convert_tokens_to_ids("hello") not in first
    book.fork("a", "b")
    book.accept_all(["a", "b"], [paid[0], void[0]])
    if len(paid) > 1:
        assert allowed(book, "a") == {paid[1]}
    # A sequence re-registered after a preemption replays its output so far.
    book.add("c", CHOICE, output_ids=void)
    eos = set(load_spec(demo_model_dir).eos_token_ids)
    assert allowed(book, "c") <= eos
    assert book.mask_for(["unconstrained"]) is None
    for rid in "abc":
        book.remove(rid)


def test_one_compile_per_spec(book: GrammarBook) -> None:
    spec = StructuredSpec("regex", "[0-9]{2}")
    book.add("x", spec)
    book.add("y", spec)
    assert list(book._compiled).count(spec) == 1
    book.remove("x")
    book.remove("y")


def test_validator_names_the_reason(demo_model_dir: Path) -> None:
    spec = load_spec(demo_model_dir)
    check = Validator(AutoTokenizer.from_pretrained(demo_model_dir), spec.vocab_size, spec.eos_token_ids)
    check(StructuredSpec("json_schema", '{"type": "object"}'))
    with pytest.raises(GrammarError, match="strin"):
        check(StructuredSpec("json_schema", '{"type": "strin"}'))
    # validate_grammar alone passes this one; the build panics (too many symbols). The reason, without the backtrace.
    with pytest.raises(GrammarError, match="symbols") as refused:
        check(StructuredSpec("choice", json.dumps(["a"] * 100_000)))
    assert "backtrace" not in str(refused.value)


def test_apply_bitmask_rows() -> None:
    logits = torch.zeros(3, 40)
    packed = torch.zeros(1, 3, dtype=torch.int32)
    packed[0, 0] = 1  # batch row 1
    packed[0, 2] = 1 << 3  # token 35 only
    apply_bitmask(logits, packed)
    assert torch.isinf(logits[1]).sum() == 39 and logits[1, 35] == 0
    assert not torch.isinf(logits[0]).any() and not torch.isinf(logits[2]).any()


@pytest.mark.parametrize("kind", ["regex", "lark"])
def test_text_that_is_an_added_token_s_can_be_written_and_every_allowed_token_consumes(
    book: GrammarBook, demo_model_dir: Path, kind: str
) -> None:
    """"<tool_call>" is an added (not special) token of a Qwen vocabulary. With llguidance's token forcing on, the
    mask for these bytes offered only that token and consuming it broke the grammar (the answer then ended short).
    Unforced: at each step every allowed token consumes, and a greedy walk writes the whole text and may stop."""
    text = 'Checking.\n<tool_call>\n{"name": "f"}'
    value = {"regex": re.escape(text).replace("\\\n", "\\n"), "lark": f"start: {json.dumps(text)}"}
    rid = f"added-{kind}"
    book.add(rid, StructuredSpec(kind, value[kind]))
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    eos = set(load_spec(demo_model_dir).eos_token_ids)
    written: list[int] = []
    for _ in range(len(text) + 2):
        options = allowed(book, rid) - eos
        if not options:
            break
        for token in options:  # each offered token is one the matcher takes (on a copy of it)
            probe = book._matcher(rid).deep_copy()
            assert probe.consume_token(token), (tok.decode([token]), probe.get_error())
        pick = max(options, key=lambda t: len(tok.decode([t])))
        book.accept_all([rid], [pick])
        written.append(pick)
    assert tok.decode(written) == text
    assert book._matcher(rid).is_accepting()
    book.remove(rid)
