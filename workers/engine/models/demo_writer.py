"""Tiny, random-weight checkpoints that glimpse can serve and test against with no download: one per model
family (the family's ``demo.py`` writes its config, chat template and processor settings; this module holds
what they share and the on-disk cache).

Everything is produced on the spot and deterministically: a byte-level BPE tokenizer trained on the short
corpus below, a chat template in the family's format, a config with the family's architecture at toy sizes,
weights drawn from fixed per-tensor seeds, and the image processor settings. The answers it gives are noise;
what matters is that every code path (vision tower, windowed attention, M-RoPE, chat template, image
placeholders) is exercised with the same file layout a real checkpoint has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Bump when the written files change, so caches of an older demo model are not reused.
# 2: the Qwen2.5-VL demo's tokenizer has Qwen's tool tokens and its chat template renders tools.
DEMO_MODEL_VERSION = 3
DEFAULT_CACHE_DIR = Path("~/.cache/glimpse") / f"demo-model-v{DEMO_MODEL_VERSION}"
CACHE_ENV_VAR = "GLIMPSE_DEMO_MODEL_DIR"

# Qwen's own special tokens, in Qwen's order, appended after the BPE vocabulary.
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
# Qwen's tokenizers carry these as plain added tokens (special=False: they survive skip_special_tokens,
# which the tool-call parser relies on), appended after the special tokens, in Qwen's order.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen3's reasoning markers, plain added tokens after the tool tokens as there (one id each: what a
# thinking_token_budget watches for and forces).
THINK_TOKENS = ("<think>", "</think>")
BPE_VOCAB_SIZE = 2000
SEED = 20251126
# Init scales (used by `_init_mean_std`), picked by measuring greedy decoding. With LINEAR_STD 0.08 attention
# stayed nearly uniform, so the next token hardly depended on the image or the earlier prompt. At these
# values ~29 of 32 greedy tokens are distinct, the first token changes with the pixels or with one prompt
# word, and the top-1/top-2 logit gap has median ~1.4 and 1st percentile ~0.02, against ~5e-5 between
# transformers' sdpa and eager attention on the same input.
EMBED_STD = 1.0
LM_HEAD_STD = 1.0
LINEAR_STD = 0.2
NORM_STD = 0.1

# Qwen2's pre-tokenizer split (the same regex the HF Qwen2 tokenizer rebuilds on load), so our tokenizer
# behaves the same whether it is read from tokenizer.json or reconstructed by transformers' class.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Plain English about the things a vision-language server is asked about; only used to train the BPE merges.
CORPUS = """
A document is more than the words printed on it. The layout tells the reader where to look first: a title
at the top, a date in the corner, a table of numbers in the middle, and a signature near the bottom of the
page. When a model reads a scanned letter or a photographed receipt, it has to find each of these parts,
read the text inside them, and keep track of how they relate to one another.

Images arrive in many shapes and sizes. A phone camera takes tall pictures, a screenshot of a laptop is
wide, and a scanned page is close to the proportions of a sheet of paper. Before the vision encoder can
look at an image, the processor resizes it so that its width and height are multiples of the patch size,
cuts it into small square patches, and flattens each patch into a row of numbers. Neighbouring patches are
then merged into one token, which keeps long documents from using too many tokens.

Charts are a special kind of picture. A bar chart compares quantities across categories, a line chart shows
how a value changes over time, and a pie chart splits a whole into parts. To describe a chart well, one
should read the axis labels, the units, the legend, and the title, and then say what the data shows: which
bar is the tallest, when the line rises or falls, and whether any value looks unusual. A good answer names
the numbers it reads and says how sure it is about them.

Tables carry information in rows and columns. The first row often holds the headers, and each following row
describes one item, such as a product, a city, a month, or a person. Reading a table means matching every
cell with its header. When a table is printed across two pages, the headers may repeat, and the reader must
notice that the second part continues the first one rather than starting a new table.

Photographs of everyday scenes ask different questions. How many people are standing near the window? What
colour is the car parked on the left? Is the dog sleeping or looking at the camera? Is there a sign above the
door, and what does it say? Answering these questions requires looking at small details, counting objects,
and describing where things are placed relative to each other: above, below, beside, behind, or in front.

Forms and invoices mix printed labels with handwritten or typed values. An invoice usually lists a seller,
a buyer, an invoice number, a date of issue, a list of items with quantities and prices, a subtotal, the tax,
and a total amount due. A careful reader checks that the total equals the sum of the lines, notes the
currency, and reports the due date. Handwriting can be hard to read, so it is better to say that a word is
unclear than to guess.

Conversations about images often continue for several turns. A user may upload a diagram, ask what it shows,
then ask a follow-up question about one of its parts, and later upload a second picture to compare with the
first. The assistant should remember what it has already seen, refer to each picture by its order, and keep
its answers short and accurate. When two pictures look similar, it should point out what is different.

Maps and diagrams use symbols instead of sentences. A map has a scale, a compass, roads, rivers, and names
of places; a diagram has boxes, arrows, and short labels that explain how a process moves from one step to
the next. Describing a diagram means following the arrows in order and naming what happens at each step.
Describing a map means giving directions, distances, and the landmarks a traveller would pass on the way.

Slides from a presentation combine a heading, a few bullet points, and sometimes a picture or a small chart.
Menus list dishes and prices. Posters announce an event with a date, a time, and a place. Book covers show a
title and an author. Street signs give names, speed limits, and warnings. Each of these is a small document,
and each can be read, summarised, translated, or checked for mistakes.

Numbers deserve extra care. Read 1,250.75 as one thousand two hundred fifty point seven five, keep the
decimal point where it is, and do not drop a zero from 2024 or 0.05. Percentages, dates such as 12 March
2025, times such as 09:30, and amounts such as $48.20 or 3 kg should be copied exactly as they appear.
Phone numbers, codes, and identifiers are checked digit by digit, because a single wrong digit changes
their meaning completely.

Good answers are honest about what can and cannot be seen. If the image is too dark, too blurry, or cut off
at the edge, say so. If the question asks about something that is not in the picture, explain that it is
not visible. Describe first, then interpret: state what is in the image before drawing a conclusion from
it, and keep the two apart so the reader can judge the reasoning.

The same image is often sent again and again during a long conversation. Instead of looking at it from the
start every time, a fast system can remember the work it has already done for that picture and reuse it.
Recognising that two uploads are the same picture is done by computing a short fingerprint of the pixels.
Large images take more time and memory, so a server should process them in pieces and share the work among
many requests that arrive at the same moment.
"""

logger = logging.getLogger(__name__)


def train_tokenizer() -> Any:
    """Train the byte-level BPE (a `tokenizers.Tokenizer`) with Qwen's special tokens appended."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # The upper-cased copy doubles the distinct words, which is what lets the merges reach BPE_VOCAB_SIZE.
    paragraphs = [p for text in (CORPUS, CORPUS.upper()) for p in text.split("\n\n") if p.strip()]
    tok.train_from_iterator(paragraphs, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def demo_tokenizer() -> tuple[Any, dict[str, int], int]:
    """The trained tokenizer with Qwen's tool tokens added, the ids of the special and tool tokens, and how many
    tokens it has in all."""
    from tokenizers import AddedToken

    raw_tok = train_tokenizer()
    raw_tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS + THINK_TOKENS])
    ids = {t: raw_tok.token_to_id(t) for t in SPECIAL_TOKENS + TOOL_TOKENS + THINK_TOKENS}
    return raw_tok, ids, raw_tok.get_vocab_size(with_added_tokens=True)


def padded_vocab(n_tokens: int) -> int:
    """Embedding rows for ``n_tokens``, rounded up to a multiple of 64 as real checkpoints pad their vocabularies."""
    return -(-n_tokens // 64) * 64


def _tokenizer_config() -> dict[str, Any]:
    # Mirrors Qwen2.5-VL-Instruct: chat turns end with <|im_end|>, padding uses <|endoftext|>, no BOS.
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 8192,
    }


def _init_mean_std(name: str) -> tuple[float, float]:
    # Norm scales sit near 1 but not at it, and biases are random, so a loader that skips either one
    # (leaving the module's default 1s and 0s) changes the output instead of passing unnoticed.
    if "norm" in name or "ln_q" in name:
        return 1.0, NORM_STD
    if name.endswith("embed_tokens.weight"):
        return 0.0, EMBED_STD
    if name.startswith("lm_head"):
        return 0.0, LM_HEAD_STD
    return 0.0, LINEAR_STD


def init_weights(model: Any) -> None:
    """Fill every tensor from a generator seeded by (SEED, tensor name).

    Per-name seeds make the weights independent of module construction order and of whatever init code a
    transformers version runs, so the checkpoint is the same on every version we support.
    """
    import torch

    with torch.no_grad():
        for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
            mean, std = _init_mean_std(name)
            digest = hashlib.sha256(f"{SEED}:{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            tensor.copy_(torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * std + mean)


def init_model(model_cls: Any, config: Any) -> Any:
    """``model_cls(config)`` in eval mode with every weight from ``init_weights`` (torch's global seed is fixed
    first, for whatever the constructor draws)."""
    import torch

    torch.manual_seed(SEED)
    model = model_cls(config).eval()
    init_weights(model)
    return model


def save_model(model: Any, special_ids: dict[str, int], n_tokens: int, out: Path) -> None:
    """Save the model into ``out`` with the unused outputs silenced and Qwen's generation config: greedy, stopping
    at <|im_end|> or <|endoftext|>."""
    from transformers import GenerationConfig

    _silence_unused_outputs(model, special_ids, n_tokens)
    model.generation_config = GenerationConfig(
        bos_token_id=special_ids["<|endoftext|>"],
        eos_token_id=[special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
        pad_token_id=special_ids["<|endoftext|>"],
        do_sample=False,
    )
    model.save_pretrained(out)


def _silence_unused_outputs(model: Any, special_ids: dict[str, int], n_tokens: int) -> None:
    """Zero the LM-head rows of ids a trained model never emits: vocabulary padding and the special tokens
    other than the two stop tokens. Their logit is then exactly 0, far below the top logit (std ~8 over
    ~2000 rows), so greedy output never contains an image pad or an id the tokenizer cannot decode."""
    import torch

    keep = {special_ids["<|im_end|>"], special_ids["<|endoftext|>"]}
    rows = [i for t, i in special_ids.items() if i not in keep]
    rows += range(n_tokens, model.lm_head.weight.shape[0])
    with torch.no_grad():
        model.lm_head.weight[torch.tensor(rows)] = 0.0


def write_demo_model(path: str | os.PathLike[str], family: str = "qwen2_5_vl", quantize: str | None = None) -> Path:
    """Write the demo checkpoint of ``family`` (a key of models.DEMO_FAMILIES) into `path` (created if
    missing), its language model in FP8 when ``quantize`` names a format of demo_quantize.py. Same bytes on every
    run."""
    from workers.engine.models import DEMO_FAMILIES, family as family_package
    from workers.engine.models.demo_quantize import quantize_checkpoint

    if family not in DEMO_FAMILIES:
        raise ValueError(f"no demo model for family {family!r}; choose from {', '.join(DEMO_FAMILIES)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    written = family_package(DEMO_FAMILIES[family]).write_demo(out, family)
    if quantize is not None:
        quantize_checkpoint(written, quantize)
    # safetensors writes 0600; a cache filled by one user (say, a container build) must be readable by others.
    for file in written.iterdir():
        file.chmod(0o644)
    return written


def save_tokenizer(raw_tok: Any, model_max_length: int = 8192) -> Any:
    """Let transformers load our tokenizer files and hand back its own tokenizer object, so what is saved
    with the processor is exactly what AutoTokenizer/AutoProcessor produce and re-read."""
    from transformers import AutoTokenizer

    config = {**_tokenizer_config(), "model_max_length": model_max_length}
    with tempfile.TemporaryDirectory(prefix="glimpse-demo-tok-") as staging:
        raw_tok.save(os.path.join(staging, "tokenizer.json"))
        with open(os.path.join(staging, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        tokenizer = AutoTokenizer.from_pretrained(staging)
    # Loading records where it loaded from; keep those facts about our temp dir out of the saved config.
    for key in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


def _default_cache_dir(family: str) -> Path:
    if family != "qwen2_5_vl":  # the other families live next to it, never under the env override
        return (DEFAULT_CACHE_DIR.parent / f"demo-{family}-v{DEMO_MODEL_VERSION}").expanduser()
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else DEFAULT_CACHE_DIR.expanduser()


def ensure_demo_model(cache_dir: Path | None = None, family: str = "qwen2_5_vl") -> Path:
    """Return a directory holding the demo model of ``family``, writing it there first if it is not there yet.

    `cache_dir` defaults to $GLIMPSE_DEMO_MODEL_DIR, else ~/.cache/glimpse/demo-model-v3 (Qwen2.5-VL; the
    other families: ~/.cache/glimpse/demo-FAMILY-v2). The model is
    written into a temp dir next to it and renamed into place, so a reader never sees a half-written
    checkpoint and two processes racing to create it both end up with one complete copy.
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir(family)
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it 0700, and it becomes the cache dir itself
    try:
        write_demo_model(staging, family)
        try:
            # rename() replaces an empty directory but fails on a populated one: a racing writer won.
            os.rename(staging, target)
            logger.info("wrote demo model to %s", target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
