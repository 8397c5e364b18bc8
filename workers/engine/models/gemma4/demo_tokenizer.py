"""The Gemma 4 demo checkpoint's tokenizer, trained on the spot: Gemma's own tokenizer design (transformers'
``GemmaTokenizer``: BPE over the text with spaces spelled ``▁``, byte fallback through ``<0x00>`` ... ``<0xFF>``) with
a small vocabulary learned from demo_writer.CORPUS, and Gemma 4's control tokens under the names its tokenizer_config
gives them (``image_token``, ``boi_token``, ``sot_token`` ...), so ``Gemma4Processor`` finds them as it finds the real
ones. Ids differ from the real vocabulary's (whose image tokens sit past 255,000): config.json names the demo's.
"""

from __future__ import annotations

import json
from typing import Any

from workers.engine.models.demo_writer import CORPUS

# In the real vocabulary's order where it has them first (pad, eos, bos, unk, mask), then Gemma 4's control tokens.
CONTROL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<unk>", "<mask>",
    "<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>",
    "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
    "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>",
)  # fmt: skip
# Gemma 4's tokenizer_config names (transformers 5 makes each an attribute, and ``<name>_id``).
NAMED_TOKENS = {
    "image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
    "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
    "sot_token": "<|turn>", "eot_token": "<turn|>", "soc_token": "<|channel>", "eoc_token": "<channel|>",
    "std_token": "<|tool>", "etd_token": "<tool|>", "stc_token": "<|tool_call>", "etc_token": "<tool_call|>",
    "str_token": "<|tool_response>", "etr_token": "<tool_response|>", "think_token": "<|think|>",
    "escape_token": '<|"|>',
}  # fmt: skip
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))
BPE_VOCAB_SIZE = 1500  # with the control and byte tokens; the corpus runs out of merges a little below it


def train_gemma_tokenizer() -> tuple[Any, dict[str, int]]:
    """A ``GemmaTokenizer`` whose merges are learned from the demo corpus, and the ids of its control tokens."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import GemmaTokenizer

    raw = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # What GemmaTokenizer builds around its vocabulary, so the merges are learned on the text it will see.
    raw.normalizer = normalizers.Replace(" ", "▁")
    raw.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    # The control and byte tokens go in as the trainer's specials: the first ids, in this order, never merged.
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False,
        special_tokens=[*CONTROL_TOKENS, *BYTE_TOKENS],
    )
    paragraphs = [p for text in (CORPUS, CORPUS.upper()) for p in text.split("\n\n") if p.strip()]
    raw.train_from_iterator(paragraphs, trainer=trainer)
    trained = json.loads(raw.to_str())["model"]  # the vocabulary (specials included) and merges, in order
    # (left, right) pairs, which the tokenizers library takes (transformers' annotation says strings)
    merges: Any = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in trained["merges"]]
    # pad, eos, bos, unk and mask are GemmaTokenizer's own; the others become special tokens through their names,
    # except <|video|>, which Gemma4Processor adds itself (as it does to the real tokenizer). The chat template writes
    # <bos> itself, so the tokenizer adds none (as the real one).
    tokenizer = GemmaTokenizer(
        vocab=trained["vocab"], merges=merges, extra_special_tokens=NAMED_TOKENS, add_bos_token=False
    )
    vocab = tokenizer.get_vocab()
    ids = {t: vocab[t] for t in CONTROL_TOKENS}
    return tokenizer, ids
