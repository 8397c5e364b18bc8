"""Grammar engines side by side for structured outputs: xgrammar and llguidance on one tokenizer.

For a JSON schema with 20 fields it measures the compile time (to the first token mask: llguidance
compiles lazily, so both are timed up to a usable mask) and the mask time per token while walking the
tokens of a valid answer. The tokenizer is the one of --model (default: a byte-level BPE of 32k tokens
trained here on Python's standard library, a real vocabulary's size, so mask times mean something).

    .venv/bin/python -m benchmarks.request_path.grammar_bench [--model DIR] [--json out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.args import parser


def schema_20() -> dict[str, Any]:
    kinds: list[dict[str, Any]] = [
        {"type": "string"},
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "string", "enum": ["draft", "sent", "paid", "void"]},
        {"type": "array", "items": {"type": "string"}},
        {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}, "required": ["city", "zip"]},
    ]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(20)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def instance_20() -> dict[str, Any]:
    values: list[Any] = ["Acme Corp, 12 Main St", 1250, 48.2, True, "paid", ["a4", "b7"], {"city": "Lyon", "zip": "69001"}]
    return {f"field_{i:02d}": values[i % len(values)] for i in range(20)}


def train_tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(json.__file__).parent.parent
    texts = [p.read_text(errors="ignore") for p in sorted(stdlib.glob("*.py"))[:400]]
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def bench_xgrammar(hf: Any, schema: str, tokens: list[int], vocab: int) -> dict[str, float]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    started = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = compiler.compile_json_schema(schema)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask, 0)
    compile_s = time.perf_counter() - started
    times = []
    for i, t in enumerate(tokens):
        if i:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
        assert matcher.accept_token(t), f"xgrammar refused token {i}"
    return {"compile_s": compile_s, "mask_us_mean": statistics.mean(times) * 1e6, "mask_us_p99": _p99(times) * 1e6}


def bench_llguidance(hf: Any, schema: str, tokens: list[int], vocab: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(tok, grammar)
    mask = lt.allocate_token_bitmask(1, vocab)
    lt.fill_next_token_bitmask(matcher, mask, 0)
    compile_s = time.perf_counter() - started
    assert not matcher.is_error(), matcher.get_error()
    times = []
    for i, t in enumerate(tokens):
        if i:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, mask, 0)
            times.append(time.perf_counter() - t0)
        assert matcher.consume_token(t), f"llguidance refused token {i}: {matcher.get_error()}"
    return {"compile_s": compile_s, "mask_us_mean": statistics.mean(times) * 1e6, "mask_us_p99": _p99(times) * 1e6}


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * 0.99))]


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", default=None, help="checkpoint dir whose tokenizer to use")
    ap.add_argument("--vocab", type=int, default=32000, help="size of the trained tokenizer without --model")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.model:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(args.model)
    else:
        hf = train_tokenizer(args.vocab)
    vocab = len(hf)
    schema = json.dumps(schema_20())
    tokens = hf(json.dumps(instance_20()), add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    rows = {}
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            runs = [fn(hf, schema, tokens, vocab) for _ in range(args.repeat)]
        except ImportError:  # xgrammar is not a dependency: pip install xgrammar==0.2.8 to compare
            print(f"{name}: not installed, skipped")
            continue
        rows[name] = {k: min(r[k] for r in runs) for k in runs[0]}
    print(f"vocab {vocab}, answer {len(tokens)} tokens, best of {args.repeat}, one thread")
    print(f"{'engine':<12} {'compile+1st mask (ms)':>22} {'mask/token mean (us)':>21} {'p99 (us)':>9}")
    for name, r in rows.items():
        print(f"{name:<12} {r['compile_s'] * 1e3:>22.1f} {r['mask_us_mean']:>21.1f} {r['mask_us_p99']:>9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"vocab": vocab, "tokens": len(tokens), "engines": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
