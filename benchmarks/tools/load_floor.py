"""The floor of a bench's load on a card, from a shape's config alone: what no server can beat.

A burst of ``--requests`` requests of ``--images-per-request`` images each (the side-by-side harness's (b): 64 of one
1080p image, 128 tokens out) must at least

- run every prompt token through the language model's projections and every image patch through the vision tower's
  (GEMMs: 2 FLOPs per weight and row, routed experts at their top-k share), at ``--gemm-tflops``;
- run the attention over them (the tower's full or windowed blocks, the LM's full-attention layers, the Gated DeltaNet
  layers' chunked recurrence), at ``--attn-tflops``;
- and then, after the last prompt's prefill, decode that request's remaining ``--output-len - 1`` tokens one step at a
  time, each step reading at least the weights a single row needs at ``--tbps``.

The sum is a lower bound: decode rows that ride in prefill steps are counted as free, the rates are the card's best
(defaults: an H200's 8192-cubed bf16 GEMM, 790 TFLOP/s as measured in docs/benchmarks.md; 500 TFLOP/s for
attention, FlashAttention-3/4's range at heads of 64-128; 4.0 TB/s of its 4.8 of HBM bandwidth), and launches, norms,
copies and the sampler cost nothing. A goal stated as a multiple of another server's requests/s is checked against it:

    python -m benchmarks.tools.load_floor --shape qwen3.5-9b --server vLLM=8.175 --server glimpse=8.933 --goal 1.3

With ``--trace DIR`` (a served run of the same load with ``GLIMPSE_STEP_TRACE=DIR``) the floor's parts stand beside
what the run spent on them: the tower (the steps' ViT phases), the LM's prefill (the forward of every step up to the
last one that carried prompt tokens), the tail (the steps after it) and the rest (host phases, decode-only steps
between prefills, waits), from the last ``--requests`` requests' first submit to the last step's end.
``--vit-attn-tflops`` rates the tower's attention apart from the LM's (its heads are 72 or 80 wide, where kernels run
slower than at 128: docs/benchmarks.md).

Parameters are counted on transformers' own model class built on the meta device (no memory, no weights); image
patches come from the shape's image processor on a blank image of ``--resolution``.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoints import SHAPES, shaped_checkpoint

TAIL = "last request's decode steps"
GDN_CHUNK = 64  # the chunked gated delta rule's chunk length (fla's and transformers' torch path)


@dataclass(frozen=True)
class Params:
    """Weights of one model by where they act (matrices only: norms and biases add no GEMM FLOPs)."""

    lm_dense: int  # every projection a token passes through, shared experts and router included
    lm_experts: int  # routed experts, all of them
    experts_active: float  # the share of routed-expert weights one token uses (top-k / experts)
    lm_head: int
    vision_per_patch: int  # the tower's blocks and patch embedding: once per patch
    vision_per_token: int  # the merger: once per merged token


@dataclass(frozen=True)
class Shape:
    """What the FLOP count needs from a shape's config."""

    full_layers: int  # LM layers with softmax attention over the whole prompt
    attn_width: int  # their query heads x head_dim
    gdn_layers: int
    gdn_heads: int  # value heads of a Gated DeltaNet layer
    gdn_key_dim: int
    gdn_value_dim: int
    vision_depth: int
    vision_width: int
    vision_heads: int
    vision_full_blocks: int  # tower blocks that attend over the whole image (the rest: windows)
    window_patches: int  # patches per window of the windowed blocks (0: none)
    merge: int  # patches per LM token along each side


def count_params(model: torch.nn.Module) -> Params:
    """``model``'s weights by role, from transformers' parameter names (Qwen2.5-VL, Qwen3-VL, Qwen3.5 and their MoE)."""
    dense = experts = head = per_patch = per_token = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if p.ndim < 2 or "embed_tokens" in name or "pos_embed" in name:
            continue  # norms, biases, gates' scalars, and lookups: no GEMM
        if name.startswith("lm_head"):
            head += n
        elif ".visual." in f".{name}":
            if "merger" in name:  # the merger and Qwen3-VL's DeepStack mergers
                per_token += n
            else:
                per_patch += n
        elif ".experts." in name:
            experts += n
        else:
            dense += n
    text = getattr(model.config, "text_config", model.config)
    routed = getattr(text, "num_experts", 0) or 0
    active = (getattr(text, "num_experts_per_tok", 0) or 0) / routed if routed else 0.0
    return Params(dense, experts, active, head, per_patch, per_token)


def shape_of(config: Any) -> Shape:
    text = getattr(config, "text_config", config)
    vision = config.vision_config
    n = text.num_hidden_layers
    kinds = list(getattr(text, "layer_types", None) or ["full_attention"] * n)[:n]
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    full = sum(kind == "full_attention" for kind in kinds)
    gdn = sum(kind == "linear_attention" for kind in kinds)
    depth = vision.depth
    window = getattr(vision, "window_size", 0) or 0
    fullatt = getattr(vision, "fullatt_block_indexes", None)
    full_blocks = len(fullatt) if window and fullatt is not None else depth
    merge = vision.spatial_merge_size
    # Qwen2.5-VL's windows: window_size pixels a side, in whole merged tokens
    side = window // vision.patch_size // merge * merge if window else 0
    return Shape(
        full_layers=full, attn_width=text.num_attention_heads * head_dim,
        gdn_layers=gdn, gdn_heads=getattr(text, "linear_num_value_heads", 0) or 0,
        gdn_key_dim=getattr(text, "linear_key_head_dim", 0) or 0,
        gdn_value_dim=getattr(text, "linear_value_head_dim", 0) or 0,
        vision_depth=depth, vision_width=vision.hidden_size, vision_heads=vision.num_heads, vision_full_blocks=full_blocks,
        window_patches=side * side, merge=merge,
    )  # fmt: skip


@dataclass(frozen=True)
class Load:
    requests: int
    images_per_request: int
    patches_per_image: int
    image_tokens: int  # LM tokens of an image: its patches over the merge's square
    text_tokens: int  # prompt tokens of a request besides its images'
    output_len: int

    @property
    def prompt_tokens(self) -> int:
        return self.images_per_request * self.image_tokens + self.text_tokens


@dataclass(frozen=True)
class Floor:
    """FLOPs (and the decode tail's bytes) of a load, by part."""

    lm_gemm: float
    vision_gemm: float
    vision_attn: float
    lm_attn: float  # full-attention layers (causal) and the Gated DeltaNet recurrence
    tail_bytes: float  # weights one decode row reads in one step
    tail_steps: int

    def flops(self) -> dict[str, float]:
        return {"LM projections": self.lm_gemm, "vision projections": self.vision_gemm,
                "vision attention": self.vision_attn, "LM attention and recurrence": self.lm_attn}  # fmt: skip

    def seconds(self, gemm_tflops: float, attn_tflops: float, tbps: float, vit_attn_tflops: float = 0.0,
                lm_gemm_tflops: float = 0.0) -> dict[str, float]:
        # in flops()'s order
        rates = (lm_gemm_tflops or gemm_tflops, gemm_tflops, vit_attn_tflops or attn_tflops, attn_tflops)
        parts = {part: value / (rate * 1e12) for (part, value), rate in zip(self.flops().items(), rates, strict=True)}
        parts[TAIL] = self.tail_steps * self.tail_bytes / (tbps * 1e12)
        parts["floor"] = sum(parts.values())
        return parts


def floor_of(params: Params, shape: Shape, load: Load, weight_bytes: float = 2.0) -> Floor:
    tokens = load.requests * load.prompt_tokens
    patches = load.requests * load.images_per_request * load.patches_per_image
    per_token = params.lm_dense + params.lm_experts * params.experts_active
    lm_gemm = 2.0 * per_token * tokens + 2.0 * params.lm_head * load.requests  # one logits row per prompt
    vision_gemm = 2.0 * params.vision_per_patch * patches + 2.0 * params.vision_per_token * (patches / shape.merge**2)
    p = load.patches_per_image
    windowed = shape.vision_depth - shape.vision_full_blocks
    # QK^T and PV: 2 x 2 x keys x width per query; windowed blocks see only their window's patches
    per_image = 4.0 * shape.vision_width * p * (shape.vision_full_blocks * p + windowed * min(p, shape.window_patches))
    vision_attn = per_image * load.requests * load.images_per_request
    t = load.prompt_tokens
    causal = 2.0 * shape.attn_width * t * t  # half of the square for each of QK^T and PV
    # per token and value head: its chunk's QK^T and AV (C x (Dk + Dv)), the state read, update and readout (3 Dk Dv)
    recurrence = 2.0 * shape.gdn_heads * t * (GDN_CHUNK * (shape.gdn_key_dim + shape.gdn_value_dim)
                                              + 3 * shape.gdn_key_dim * shape.gdn_value_dim)  # fmt: skip
    lm_attn = load.requests * (shape.full_layers * causal + shape.gdn_layers * recurrence)
    tail_bytes = weight_bytes * per_token + 2.0 * params.lm_head  # lm_head stays bf16 in FP8 checkpoints
    return Floor(lm_gemm, vision_gemm, vision_attn, lm_attn, tail_bytes, max(0, load.output_len - 1))


# The floor's parts a step trace can time, each with the floor parts it holds (trace_parts' keys).
TRACED = {
    "vision tower": ("vision projections", "vision attention"),
    "LM prefill": ("LM projections", "LM attention and recurrence"),
    TAIL: (TAIL,),
    "the rest": (),
}


def trace_parts(folder: Path, requests: int) -> dict[str, float]:
    """Seconds a step-traced run of the load spent by TRACED's parts, and its whole window ("window")."""
    from benchmarks.tools.step_trace import load as load_trace

    records = load_trace(folder)
    submits = sorted(r["t"] for r in records.get("frontend", []) if r["kind"] == "submit")
    if len(submits) < requests:
        raise SystemExit(f"--trace: {len(submits)} requests in {folder}, fewer than --requests {requests}")
    since = submits[-requests]
    steps = [r for r in records.get("worker0", []) if r["kind"] == "step" and r["start"] >= since]
    prompt_steps = [i for i, s in enumerate(steps) if s["tokens"] > s["decodes"]]  # tokens count the decode rows too
    if not prompt_steps:
        raise SystemExit(f"--trace: no step in {folder} after the load's first request carried prompt tokens")
    last = prompt_steps[-1]
    vision = sum(s.get("vit", 0.0) for s in steps)
    prefill = sum(steps[i].get("forward", 0.0) + steps[i].get("graph", 0.0) for i in prompt_steps)
    window = steps[-1]["end"] - since
    tail = steps[-1]["end"] - steps[last]["end"]
    return {"vision tower": vision, "LM prefill": prefill, TAIL: tail,
            "the rest": window - vision - prefill - tail, "window": window}  # fmt: skip


def trace_report(s: dict[str, float], spent: dict[str, float]) -> str:
    lines = ["", "| part | floor, s | traced run, s | floor / run |", "|---|---|---|---|"]
    for part, holds in TRACED.items():
        floor = sum(s[h] for h in holds)
        ratio = f"{floor / spent[part]:.2f}" if holds and spent[part] > 0 else ""
        lines.append(f"| {part} | {floor:.3f} | {spent[part]:.3f} | {ratio} |")
    lines.append(f"| **burst** | **{s['floor']:.3f}** | **{spent['window']:.3f}** | "
                 f"**{s['floor'] / spent['window']:.2f}** |")  # fmt: skip
    return "\n".join(lines)


def patches_per_image(checkpoint: Path, resolution: tuple[int, int]) -> int:
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(checkpoint))
    grid = processor(images=Image.new("RGB", resolution), return_tensors="pt")["image_grid_thw"][0]
    return int(grid.prod())


def measure_rates(shape: Shape, patches: int) -> tuple[float, float, float]:
    """This card's (GEMM TFLOP/s, attention TFLOP/s, TB/s): an 8192-cubed bf16 matmul, torch's SDPA over one image's
    patches at the tower's heads (no mask: what torch picks, cuDNN's or FlashAttention-2's kernel), a 1 GiB copy."""
    if not torch.cuda.is_available():
        raise SystemExit("--measure needs a CUDA device")
    from benchmarks.engine.vit_bench import cuda_ms, matmul_peak_tflops

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    gemm = matmul_peak_tflops()
    head_dim = shape.vision_width // shape.vision_heads
    q, k, v = (torch.randn(1, shape.vision_heads, patches, head_dim, device=cuda, dtype=bf16) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    attn = 4 * patches**2 * shape.vision_width / cuda_ms(lambda: sdpa(q, k, v), 10) / 1e9
    src = torch.empty(1 << 30, dtype=torch.uint8, device=cuda)
    dst = torch.empty_like(src)
    tbps = 2 * (1 << 30) / cuda_ms(lambda: dst.copy_(src), 10) / 1e9
    return gemm, attn, tbps


def build(shape: str, layers: int, scratch: Path) -> tuple[Params, Shape, Path]:
    from transformers import AutoConfig, AutoModelForImageTextToText

    checkpoint = shaped_checkpoint(scratch / shape, shape, layers=layers)
    config = AutoConfig.from_pretrained(str(checkpoint))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return count_params(model), shape_of(config), checkpoint


def parse_servers(values: list[str]) -> list[tuple[str, float]]:
    out = []
    for value in values:
        name, _, rate = value.partition("=")
        if not rate:
            raise SystemExit(f"--server wants NAME=REQ_PER_S, got {value!r}")
        out.append((name, float(rate)))
    return out


def report(args: argparse.Namespace, params: Params, load: Load, floor: Floor) -> str:
    s = floor.seconds(args.gemm_tflops, args.attn_tflops, args.tbps, args.vit_attn_tflops, args.lm_gemm_tflops)
    lines = [
        f"{args.shape}{f' ({args.layers} layers)' if args.layers else ''}: {load.requests} requests x "
        f"{load.images_per_request} x {args.resolution} ({load.patches_per_image} patches, {load.image_tokens} tokens "
        f"an image), {load.prompt_tokens} prompt tokens each, {load.output_len} out",
        f"weights: LM {params.lm_dense / 1e9:.2f} B dense + {params.lm_experts / 1e9:.2f} B routed "
        f"(x {params.experts_active:.3f} a token), head {params.lm_head / 1e9:.2f} B, vision "
        f"{(params.vision_per_patch + params.vision_per_token) / 1e9:.2f} B",
        f"rates: GEMM {args.gemm_tflops:g} TFLOP/s"
        + (f" (the LM's {args.lm_gemm_tflops:g}, {args.lm_weight_bytes:g} bytes a weight)" if args.lm_gemm_tflops else "")
        + f", attention {args.attn_tflops:g} TFLOP/s"
        + (f" (the tower's {args.vit_attn_tflops:g})" if args.vit_attn_tflops else "") + f", {args.tbps:g} TB/s",
        "",
        "| part | PFLOP | s |",
        "|---|---|---|",
    ]
    for part, value in floor.flops().items():
        lines.append(f"| {part} | {value / 1e15:.3f} | {s[part]:.3f} |")
    lines.append(f"| {TAIL} ({floor.tail_steps} x {floor.tail_bytes / 1e9:.1f} GB) | | {s[TAIL]:.3f} |")
    lines.append(f"| **floor** | | **{s['floor']:.3f}** ({load.requests / s['floor']:.2f} req/s at most) |")
    servers = parse_servers(args.server)
    if servers:
        lines += ["", "| server | req/s | burst, s | floor / burst |", "|---|---|---|---|"]
        for name, rate in servers:
            burst = load.requests / rate
            lines.append(f"| {name} | {rate:.3f} | {burst:.3f} | {s['floor'] / burst:.2f} |")
        if args.goal:
            name, rate = servers[0]
            burst = load.requests / (rate * args.goal)
            lines.append(f"| {args.goal:g} x {name} (goal) | {rate * args.goal:.3f} | {burst:.3f} | "
                         f"{s['floor'] / burst:.2f} |")  # fmt: skip
    if args.trace is not None:
        lines.append(trace_report(s, trace_parts(args.trace, load.requests)))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    qwen = [name for name, (family, _, _) in SHAPES.items() if not family.startswith("gemma")]
    ap.add_argument("--shape", choices=qwen, default="qwen3.5-9b")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers kept (0: all), as the harness's LAYERS")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--images-per-request", type=int, default=1)
    ap.add_argument("--resolution", default="1920x1080")
    ap.add_argument("--text-tokens", type=int, default=95, help="prompt tokens besides the images' ((b): 2,135 - 2,040)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--gemm-tflops", type=float, default=790.0)
    ap.add_argument("--attn-tflops", type=float, default=500.0)
    ap.add_argument("--vit-attn-tflops", type=float, default=0.0,
                    help="the tower's attention rate (0: --attn-tflops); an H200's best at 72-wide heads: 353")
    ap.add_argument("--lm-gemm-tflops", type=float, default=0.0,
                    help="the LM projections' rate (0: --gemm-tflops); an FP8 checkpoint's: cuBLAS's block-scaled "
                    "GEMM ran 1,150-1,200 TFLOP/s at 8,192 rows on an H200 (docs/benchmarks.md, FP8 GEMMs)")
    ap.add_argument("--lm-weight-bytes", type=float, default=2.0,
                    help="bytes a decode row reads per LM weight in the tail (1 for FP8; the tower stays bf16)")
    ap.add_argument("--tbps", type=float, default=4.0)
    ap.add_argument("--measure", action="store_true", help="measure the three rates on this CUDA device instead")
    ap.add_argument("--server", action="append", default=[], help="NAME=REQ_PER_S measured on the load (repeat)")
    ap.add_argument("--goal", type=float, default=0.0, help="a multiple of the first --server's req/s to check")
    ap.add_argument("--trace", type=Path, help="a GLIMPSE_STEP_TRACE folder of a served run of this load")
    args = ap.parse_args()
    width, _, height = args.resolution.partition("x")
    with tempfile.TemporaryDirectory() as scratch:
        params, shape, checkpoint = build(args.shape, args.layers, Path(scratch))
        patches = patches_per_image(checkpoint, (int(width), int(height)))
    if args.measure:
        args.gemm_tflops, args.attn_tflops, args.tbps = (round(x, 1) for x in measure_rates(shape, patches))
        print(f"measured on {torch.cuda.get_device_name()}")
    load = Load(args.requests, args.images_per_request, patches, patches // shape.merge**2, args.text_tokens,
                args.output_len)
    print(report(args, params, load, floor_of(params, shape, load, args.lm_weight_bytes)))


if __name__ == "__main__":
    main()
