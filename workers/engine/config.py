"""Engine configuration: one frozen, picklable object built in the parent and copied to every process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # torch is imported where a dtype is needed, so the CLI can read these defaults cheaply
    import torch

    from workers.engine.models.model_spec import ModelSpec

MMCacheMode = Literal["image", "request"]
# vLLM's spellings of --kv-cache-dtype; fp8 means e4m3 (fp8_e5m2 is not served).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
LoadFormat = Literal["auto", "dummy"]
# FlashAttention-3's key tile for head sizes up to 128 under a causal mask (its tile_size_fwd_sm90). A paged cache
# whose blocks hold whole tiles is loaded with TMA; smaller blocks take a cp.async gather: on an H200 the LM's
# prefill attention over a 25k context ran 8-9% faster with blocks of 128 than of 16 (docs/perf-notes.md, s. 18).
FA3_KEY_TILE = 128


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine. ``model`` is a local Hugging Face checkpoint directory."""

    model: str
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    load_format: LoadFormat = "auto"
    attn_backend: Literal["auto", "sdpa", "flash", "fa3", "fa4"] = "auto"
    # Scheduling: per-step token budget shared by decodes and prefill chunks. 4096 measured best under load
    # (64 concurrent 1080p requests on an H200: 4.9-5.6 req/s at 1024, 6.2 at 2048, 6.8 at 4096, with a lower
    # mean TPOT too): eager mixed steps have a fixed host cost, which larger chunks spread over more tokens.
    chunk_size: int = 4096
    # Budget of a step in which no sequence is decoding (so no inter-token latency is at stake): a lone
    # prompt prefills in chunks this large. 0: chunk_size.
    lone_prefill_tokens: int = 4096
    # Tokens of images a step that carries decodes may send through the vision encoder (the images its chunks reach
    # that are in neither tier of the embedding cache), at least one image; 0: no cap beyond the chunks. Each image's
    # encode runs inside the step, so every decoding request waits for it: the cap bounds that wait.
    decode_step_image_tokens: int = 0
    # What each image token a step with decodes sends through the vision encoder costs of its token budget
    # (``chunk_size``), so that the ViT and the chunk together stay within it: an image's encode and its first tokens
    # go in one step, the rest of its tokens in the next (at least one token of an image a step). 0: encodes are free.
    encode_token_cost: float = 0.0
    # Image tokens a step may encode for later steps (images past its chunks, the waiting queue's head), on a second
    # CUDA stream beside its forward, so the ViT overlaps the LM (core/encode_ahead.py); 0: off. TP 1 only. Off
    # until a GPU has measured it against the cap above (issue 36: the inter-token tail under load).
    encode_ahead_tokens: int = 0
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # Paged KV cache. num_kv_blocks wins over kv_cache_mb when both are set.
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_mb: int | None = None  # default: 512 on CPU, 40% of free memory on CUDA
    # The paged KV cache's element type: auto = the model's dtype; fp8 / fp8_e4m3 = e4m3 with per-head scales
    # (workers/engine/kernels/kv_quant.py), half the bytes of bf16, so twice the blocks for the same memory.
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    # Families with sliding-window layers (Gemma 4): blocks of those layers' own pool (None: cache_memory.py's rule).
    num_window_blocks: int | None = None
    # Per-image embedding cache.
    mm_cache_mb: float = 1024  # fractions allowed (tests size the cache below one request)
    mm_cache_mode: MMCacheMode = "image"
    # The embedding cache's host tier, per rank: pinned host memory that GPU evictions spill into and hits reload
    # from (core/mm_host_tier.py). None: default_host_cache_mb(device, tp_size); 0: off.
    mm_host_cache_mb: float | None = None
    # A ViT call takes the step's images until this many patches (always at least one image). One 1080p image
    # (10,764 patches) already fills the GEMMs, but each call has a fixed cost (rotary and window tables, a
    # cuDNN call per frame, launches): under load (64 concurrent 1080p requests, chunk 4096, H100) 32768, up to
    # three such images a call, served 6.08-6.17 req/s against 5.56-6.06 at 16384, at the same inter-token
    # tail; the transient grows with the images of a call (docs/perf-notes.md, session 10).
    vit_max_patches: int = 32768
    # Kept ViT call plans (workers/engine/layers/vit_plans.py), per tower: device bytes on CUDA, host bytes on the CPU.
    vit_plan_cache_mb: float = 64
    # CUDA: the elementwise work between GEMMs (norms, rotary, SiLU*up, residual adds) as torch.compile'd
    # kernels (workers/engine/kernels/fused.py), compiled at start-up; off = eager PyTorch ops. CPU is always eager.
    fused_kernels: bool = True
    # CUDA: steps of up to this many tokens that are not pure decode (short prompts, a chat turn's new text, small
    # chunks beside decodes) replay graphs between the layers' attention calls (workers/engine/runner/piecewise_graphs.py);
    # rounded down to a bucket, 0 = off. None: the model's default (piecewise_graphs.default_tokens): 1024 for dense
    # attention-only models (steps of 512-1024 tokens are still partly host-bound on a 7B: 691 new tokens over a 15k
    # context 52.9 ms with graphs against 58.6 eagerly, H200; above, eager is as fast), 4096 for MoE and hybrid ones
    # (a 2,048-token prefill step of the Qwen3.5-35B-A3B shape 78.0 -> 37.8 ms, H200).
    piecewise_graph_tokens: int | None = None
    # Share computed KV blocks between requests with the same prefix (a chat's earlier turns).
    enable_prefix_caching: bool = True
    # Host-RAM tier under the prefix cache, per rank: registered KV blocks the GPU pool recycles are copied here first,
    # and a later prompt whose prefix continues there loads them back instead of recomputing them
    # (core/host_kv_index.py, runner/host_kv.py). 0: off, on every device: opt-in as vLLM's and SGLang's host KV
    # offload are, and its pinned pages would compete with --mm-host-cache-mb's default share of the RAM.
    kv_host_cache_mb: float = 0
    # Hybrid models (Qwen3.5's linear attention): slots of the per-sequence state pool (live states and prefix
    # snapshots; None: workers/engine/runner/cache_memory.py's rule), and a state snapshot every this many KV
    # blocks of a prompt besides the one at its last full block (0: only that one). Each snapshot costs a slot.
    state_slots: int | None = None
    state_snapshot_every: int = 16
    seed: int = 0
    tp_size: int = 1
    # Build and load the vision tower in the model runner. False in a model worker of a server with
    # --encoder-workers (its process sets it): encoder workers run the tower, the model worker only imports their
    # entries, so it reads no ``visual.*`` weight and its caches get the tower's memory.
    vision_tower: bool = True
    # The checkpoint's parsed config.json: the launcher reads it once and every process gets this copy.
    # None (the offline Engine, tests): read on first use by ``model_spec()``.
    spec: ModelSpec | None = None

    def model_spec(self) -> ModelSpec:
        if self.spec is not None:
            return self.spec
        from workers.engine.models import load_spec

        return load_spec(self.model)

    def kv_host_cache_refusal(self, spec: ModelSpec) -> str | None:
        """Why --kv-host-cache-mb cannot serve ``spec`` under these settings (one line), or None when it can."""
        if self.kv_host_cache_mb < 0:
            return "--kv-host-cache-mb must be 0 (off) or more"
        if self.kv_host_cache_mb == 0:
            return None
        if not self.enable_prefix_caching:
            return "--kv-host-cache-mb holds prefix-cache blocks: it needs prefix caching (drop --no-prefix-caching)"
        if spec.recurrent is not None:
            # A hit there resumes from a state snapshot taken at the block, which the host tier does not keep.
            return f"--kv-host-cache-mb is not supported for {spec.architecture} (linear-attention state); use 0"
        if spec.window > 0 and self.num_window_blocks != 0:
            # The sliding layers' blocks live in a pool of their own, indexed by another table.
            return (f"--kv-host-cache-mb is not supported for {spec.architecture} with a sliding-window block pool; "
                    "use 0 (or --num-window-blocks 0)")
        return None

    def host_cache_bytes(self) -> int:
        """The host tier's budget per rank in bytes: --mm-host-cache-mb, else the default for this device."""
        mb = self.mm_host_cache_mb
        return int((default_host_cache_mb(self.device, self.tp_size) if mb is None else mb) * 2**20)

    def dtype_name(self) -> str:
        """The model's dtype: --dtype, or for auto bfloat16 on CUDA and float32 on the CPU."""
        if self.dtype == "auto":
            return "bfloat16" if self.device.startswith("cuda") else "float32"
        return self.dtype

    def torch_dtype(self) -> torch.dtype:
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype_name()]

    def kv_dtype_name(self) -> str:
        """How stats name the KV cache's element type (kv_quant.dtype_name's spelling), read without torch."""
        return self.dtype_name() if self.kv_cache_dtype == "auto" else "fp8_e4m3"

    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type: auto keeps the model's; fp8 is e4m3 (ValueError for an unknown name)."""
        import torch

        if self.kv_cache_dtype == "auto":
            return self.torch_dtype()
        if self.kv_cache_dtype in ("fp8", "fp8_e4m3"):
            return torch.float8_e4m3fn
        raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; known: {', '.join(KV_CACHE_DTYPES)}")


def serving_kv_blocks(
    device: str, attn_backend: str, block_size: int | None, num_kv_blocks: int | None
) -> tuple[int, int | None]:
    """The KV block size and count `glimpse serve` takes from its flags. Without ``--block-size``: FA3_KEY_TILE where
    the LM's attention may be FlashAttention-3 or -4 (CUDA, backend auto, fa3 or fa4: a block of whole key tiles lets
    them load pages by TMA), else EngineConfig's 16. Larger blocks also
    cut the scheduler's per-block work (prefix keys, plans): a 22k-token prompt reached its first step in 3-4.5 ms
    against 9.3. The cost is the prefix cache's grain: a chat's next turn recomputes up to 127 tokens of its history
    instead of 15. A ``--num-kv-blocks`` given without ``--block-size`` counts blocks of EngineConfig's 16 tokens (so
    a count sized for one card keeps its memory); the same tokens are then laid out in fewer, larger blocks."""
    if block_size is not None:
        return block_size, num_kv_blocks
    unit = EngineConfig.block_size
    if not (device.startswith("cuda") and attn_backend in ("auto", "fa3", "fa4")):
        return unit, num_kv_blocks
    if num_kv_blocks is None:
        return FA3_KEY_TILE, None
    return FA3_KEY_TILE, -(-num_kv_blocks * unit // FA3_KEY_TILE)


# The host tier's default: at most this many MiB per rank, and all ranks of the host together at most this share of
# its RAM. Pinned pages cannot be swapped or reclaimed, so the share leaves the OS, the tokenizers' pixels in
# /dev/shm and the page cache most of the machine. 8 GiB holds ~440 Qwen2.5-VL-7B 1080p images (2,691 tokens x
# 3,584 x 2 bytes = 18.4 MiB each), or 128 Qwen3-VL-8B ones (64 MiB with their DeepStack levels).
HOST_CACHE_CAP_MB = 8192
HOST_CACHE_RAM_SHARE = 0.2


def default_host_cache_mb(device: str, ranks: int) -> float:
    """The host tier's budget per rank when --mm-host-cache-mb is not given: off on the CPU (its GPU tier is host
    memory already), on CUDA min(HOST_CACHE_CAP_MB, HOST_CACHE_RAM_SHARE of MemTotal / ``ranks``). ``ranks``: model
    workers on this host (dp x tp), each of which holds its own copy of every entry."""
    if not device.startswith("cuda"):
        return 0.0
    try:
        with open("/proc/meminfo") as f:
            total_kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration, ValueError):
        return 0.0  # unknown RAM: pin nothing rather than guess
    return min(float(HOST_CACHE_CAP_MB), HOST_CACHE_RAM_SHARE * total_kb / 1024 / max(1, ranks))
