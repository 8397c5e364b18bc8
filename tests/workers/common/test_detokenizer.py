"""Incremental detokenization and stop strings, on the demo checkpoint's byte-level BPE tokenizer."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from workers.common.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopChecker, TextStream

MIXED = [
    "héllo 🎉 世界 café 😀 naïve",
    "数据中心的图像🖼️处理👩‍👩‍👧‍👦家庭",
    "plain ascii, then 🇯🇵 flags and ℝ³ maths ∮ E⋅da = Q",
]


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(demo_model_dir))


class CountingTokenizer:
    """Records how many ids each decode call gets, to check the per-step cost stays bounded."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sizes: list[int] = []

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        self.sizes.append(len(token_ids))
        return self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)


@pytest.mark.parametrize("text", MIXED)
def test_one_token_at_a_time_is_utf8_safe(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The point of the test: some characters really are split over several tokens here.
    assert any(REPLACEMENT_CHAR in tokenizer.decode(ids[: i + 1]) for i in range(len(ids)))
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([t]) for t in ids]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "" in deltas  # held back while a character was incomplete
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids) == text


def test_several_tokens_per_push_and_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode(MIXED[0], add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = ids[:7] + [end] + ids[7:] + [end]
    detok = IncrementalDetokenizer(tokenizer)
    out = "".join(detok.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + detok.flush()
    assert out == tokenizer.decode(ids, skip_special_tokens=True) == MIXED[0]
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(keep.push([t]) for t in ids) + keep.flush() == tokenizer.decode(ids)


def test_incomplete_tail_is_flushed_at_the_end(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer)
    emitted = "".join(detok.push([t]) for t in cut)
    assert emitted == "ok "
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT_CHAR) and emitted + tail == tokenizer.decode(cut)
    assert detok.flush() == "" and detok.push([]) == ""


def test_decode_window_stays_short(tokenizer: Any) -> None:
    ids = tokenizer.encode(" ".join(MIXED) * 20, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    out = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert out == tokenizer.decode(ids)
    assert len(ids) > 500
    # O(new tokens): every decode sees the last emitted chunk plus the pending tokens, never the output.
    assert max(counting.sizes) <= 12


def test_stop_string_spanning_deltas() -> None:
    checker = StopChecker(["o w"])
    assert checker.push("Hel") == ("Hel", False)
    assert checker.push("lo") == ("l", False)  # "o" could start "o w"
    assert checker.push(" wo") == ("", True)  # the stop itself is never emitted
    assert checker.push("rld") == ("", True)
    assert checker.flush() == ""


def test_held_back_text_is_flushed() -> None:
    checker = StopChecker(["xyz", "", "abc"])
    assert checker.stops == ("xyz", "abc")
    assert checker.push("12x") == ("12", False)
    assert checker.push("y") == ("", False)
    assert checker.push("") == ("", False)
    assert checker.flush() == "xy"
    assert StopChecker([]).push("anything") == ("anything", False)


def test_earliest_stop_wins() -> None:
    checker = StopChecker(["world", "lo"])
    assert checker.push("hello world") == ("hel", True) and checker.matched_stop == "lo"
    assert StopChecker(["ab"]).push("ab tail") == ("", True)
    tie = StopChecker(["abc", "ab"])  # two starting at one place: the one given first is named
    assert tie.push("xabcd") == ("x", True) and tie.matched_stop == "abc"


def test_stop_checker_matches_a_plain_search() -> None:
    rng = random.Random(7)
    alphabet = "ab c🎉"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        checker = StopChecker(stops)
        out, matched = "", False
        for d in deltas:
            piece, matched = checker.push(d)
            out += piece
        if not matched:
            out += checker.flush()
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        assert matched == bool(hits)
        assert out == (text[: min(hits)] if hits else text), (text, stops, deltas)


def test_text_stream_stop_across_multibyte_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode(MIXED[0], add_special_tokens=False)
    stream = TextStream(tokenizer, ["世界"], prompt_tokens=5)
    out, matched = "", False
    for t in ids:
        piece, matched = stream.push(t)
        out += piece
        if matched:
            break
    assert matched and out == "héllo 🎉 "
    assert stream.prompt_tokens == 5 and stream.completion_tokens < len(ids)
    # No stop: finish() releases held text (a partial stop prefix and an incomplete character).
    stream = TextStream(tokenizer, ["caf!"])
    out = "".join(stream.push(t)[0] for t in ids[:21])  # ends with "caf" + half of "é"
    tail, matched = stream.finish()
    assert not matched and out + tail == tokenizer.decode(ids[:21])


def test_text_stream_add_merges_the_core_verdict(tokenizer: Any) -> None:
    ids = tokenizer.encode("ab 世界 cd", add_special_tokens=False)
    # The core stops the request (length) while text is held back: it comes out with the last token.
    stream = TextStream(tokenizer, ["d!"])
    steps = [stream.add(t, None) for t in ids[:-1]] + [stream.add(ids[-1], "length")]
    assert "".join(text for text, _ in steps) == "ab 世界 cd"
    assert [reason for _, reason in steps] == [None] * (len(ids) - 1) + ["length"]
    # A stop string ends it with "stop" although the core saw no reason to stop.
    stream = TextStream(tokenizer, ["界 c"])
    out, reason = "", None
    for t in ids:
        text, reason = stream.add(t, None)
        out += text
        if reason is not None:
            break
    assert (out, reason) == ("ab 世", "stop")
    assert stream.stop_reason(t, reason) == "界 c"  # vLLM's stop_reason: the string


def test_stop_reason_is_the_string_or_the_stop_token(tokenizer: Any) -> None:
    ids = tokenizer.encode("ab cd", add_special_tokens=False)
    stream = TextStream(tokenizer, [], stop_token_ids=[ids[1]])
    assert stream.stop_reason(ids[1], "stop") == ids[1]  # a stop_token_ids entry ended it
    assert stream.stop_reason(ids[0], "stop") is None  # an end-of-sequence token: not a stop the request named
    assert stream.stop_reason(ids[1], "length") is None


def _byte_token(tokenizer: Any, byte: int) -> int:
    """The id of byte-level BPE's token for one raw byte (its alphabet holds all 256)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tid = tokenizer.convert_tokens_to_ids(bytes_to_unicode()[byte])
    assert isinstance(tid, int) and tid != tokenizer.unk_token_id
    return tid


def test_invalid_bytes_do_not_hold_the_stream(tokenizer: Any) -> None:
    """Stray continuation bytes (random weights sample them) can never complete a character: their U+FFFD goes out
    once more tokens than an incomplete character can span have followed, not when valid text comes back."""
    stray = _byte_token(tokenizer, 0x80)
    head, tail = tokenizer.encode("ok ", add_special_tokens=False), tokenizer.encode(" done", add_special_tokens=False)
    ids = head + [stray] * 8 + tail
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([t]) for t in ids]
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids)
    first_fffd = next(i for i, d in enumerate(deltas) if REPLACEMENT_CHAR in d)
    # The 4th stray byte settles the 1st: text flows while the stray run lasts, 3 tokens behind.
    assert first_fffd == len(head) + 3
    assert sum(d.count(REPLACEMENT_CHAR) for d in deltas[: len(head) + 8]) == 5


def test_a_character_cut_by_the_settled_point_is_held(tokenizer: Any) -> None:
    """'é' and the first two bytes of '€' as single byte tokens in one push: the window ends in U+FFFD with four
    tokens pending, but the settled point cuts 'é', so nothing goes out until the window agrees with it."""
    ids = [_byte_token(tokenizer, b) for b in "é€".encode()]  # c3 a9 e2 82 ac
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:4]) == ""
    assert detok.push(ids[4:]) == "é€"


def test_random_bytes_decode_the_same_incrementally(tokenizer: Any) -> None:
    rng = random.Random(7)
    pool = [_byte_token(tokenizer, b) for b in range(256)] + tokenizer.encode(" ".join(MIXED), add_special_tokens=False)
    for _ in range(150):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer)
        out = ""
        for i in range(0, len(ids), step := rng.randint(1, 3)):
            out += detok.push(ids[i : i + step])
        assert out + detok.flush() == tokenizer.decode(ids)
