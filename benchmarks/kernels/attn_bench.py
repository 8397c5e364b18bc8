"""Attention kernels on the card, for the two shapes that matter: the ViT's full-attention blocks and the
LM's prefill chunks.

- ViT full block: one 1080p frame, 10,764 patches x 16 heads of 80, no mask. FlashAttention-2 varlen (what the
  windowed blocks use) against cuDNN's fused SDPA (what the full blocks use on CUDA).
- LM prefill chunk: q new tokens against the sequence's whole context (GQA, 28 query / 4 KV heads of 128),
  causal aligned bottom-right. FlashAttention-2 varlen (the flash backend) against cuDNN SDPA, which has no
  bottom-right causal mask: the context before the chunk without a mask plus the chunk's own causal square,
  merged by their log-sum-exp, with the KV heads expanded for GQA.
- LM prefill step, ragged (``--ragged``): several sequences packed as the flash backend packs them (GQA heads
  as they are), FlashAttention-2 varlen against cuDNN's own varlen entry (``_cudnn_attention_forward`` with
  cumulative lengths), which would need neither the split nor the expanded heads. Its error column says whether
  its causal mask is aligned bottom-right (new tokens after their context) as the LM needs.

- The LM's backends as served (``--backends``): the flash backend (decode rows on the paged-decode kernel,
  prefill chunks gathered and run on FlashAttention-2) against ``--attn-backend fa3`` (one FlashAttention-3 call
  over the paged cache in place, where an FA3 build is installed), each with its KV write, on a paged cache.
- The ViT on FA3 (``--vit-fa3``): a 1080p frame's windowed and full blocks, FA2 varlen against FA3's packed call.
- ``--other fa4``: the step and ViT rows on FlashAttention-4 (pip ``flash-attn-4``) instead of FA3, and each step
  once more as ``GLIMPSE_FA4_WIDE_HEADS=gather`` serves it (the chunks' keys packed: FA4's TMA path whatever the
  block size).
- The ViT's windows (``--vit-windows``): FA2 varlen against the Triton kernel for short segments, three frame sizes.

    python -m benchmarks.kernels.attn_bench
    python -m benchmarks.kernels.attn_bench --chunks "" --backends "64x1:2800+4096:4096,4096:21579,2800:22000"
    python -m benchmarks.kernels.attn_bench --chunks "" --backends "2800:25000" --block-sizes 16,128
    python -m benchmarks.kernels.attn_bench --chunks "" --vit-fa3 --vit-windows
    python -m benchmarks.kernels.attn_bench --chunks "" --other fa4 --vit-fa3 --backends "2800:25000" --block-sizes 16,128
    python -m benchmarks.kernels.attn_bench --chunks "" --ragged "1385:1385+2711:2711,1326:2711+2770:2770,4096:21579"
    python -m benchmarks.kernels.attn_bench --lm-heads 16:4:256 --vit 8160:16:72 --other fa4 --backends "2100:17000" --block-sizes 128
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.args import parser
from benchmarks.engine.vit_bench import cuda_ms


def _cudnn(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def lm_chunk_cudnn(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q [Q, H, D], k/v [S, Hkv, D] (the chunk is the last Q of S) -> [Q, H, D]."""
    (nq, heads, d), s = q.shape, k.shape[0]
    group = heads // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh, vh = (t[:, :, None].expand(s, k.shape[1], group, d).reshape(s, heads, d).transpose(0, 1).unsqueeze(0)
              for t in (k, v))
    prefix = s - nq
    o1, l1 = _cudnn(qh, kh[:, :, :prefix], vh[:, :, :prefix], False, scale)
    o2, l2 = _cudnn(qh, kh[:, :, prefix:], vh[:, :, prefix:], True, scale)
    if l1 is None or l2 is None:  # seen at heads of 256 (torch 2.11, H200): no log-sum-exp to merge the halves by
        raise RuntimeError(f"cuDNN returned no log-sum-exp at heads of {d}")
    l1, l2 = l1.view(1, heads, nq, 1).float(), l2.view(1, heads, nq, 1).float()
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
    merged = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    return merged.to(q.dtype)[0].transpose(0, 1)


def row(what: str, flops: float, fa: Callable[[], Tensor], cudnn: Callable[[], Tensor]) -> None:
    t_fa = cuda_ms(fa, 20)
    try:
        t_cu = cuda_ms(cudnn, 20)
    except RuntimeError as exc:  # the other kernel refuses this shape: FA2's time alone, and the rows after it still run
        print(f"{what:34} {t_fa:>8.3f} {flops / t_fa / 1e9:>7.0f}   other: {str(exc).splitlines()[0][:80]}", flush=True)
        return
    ref = fa().float()
    err = float((cudnn().float() - ref).norm() / ref.norm())
    print(f"{what:34} {t_fa:>8.3f} {flops / t_fa / 1e9:>7.0f} {t_cu:>9.3f} {flops / t_cu / 1e9:>7.0f} "
          f"{t_fa / t_cu:>7.2f}x {err:>9.1e}", flush=True)


LM_HEADS = (28, 4, 128)  # Qwen2.5-VL-7B's query heads, KV heads, head width


def ragged_row(spec: str, dev: torch.device, lm_heads: tuple[int, int, int] = LM_HEADS) -> None:
    """One packed step: ``new:context`` per sequence, joined by '+'."""
    pairs = [tuple(int(v) for v in seq.split(":")) for seq in spec.split("+")]
    heads, kv_heads, d = lm_heads
    q = torch.randn(sum(n for n, _ in pairs), heads, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(sum(c for _, c in pairs), kv_heads, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    cq, ck = (F.pad(torch.tensor(lens, device=dev).cumsum(0), (1, 0)).int()
              for lens in ([n for n, _ in pairs], [c for _, c in pairs]))
    mq, mk = max(n for n, _ in pairs), max(c for _, c in pairs)
    args = (q, k, v, None, cq, ck, mq, mk, False, 0.0, True, False)

    def fa() -> Tensor:
        out: Tensor = torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, mq, mk, 0.0, True, False,
                                                              scale=d**-0.5)[0]
        return out

    def cudnn() -> Tensor:
        out: Tensor = torch.ops.aten._cudnn_attention_forward(*args, scale=d**-0.5)[0]
        return out

    flops = sum(4 * n * (c - n / 2) * d * heads for n, c in pairs)
    try:
        row(f"ragged {spec}", flops, fa, cudnn)
    except RuntimeError as exc:
        print(f"ragged {spec}: cuDNN refused ({str(exc).splitlines()[0][:120]})", flush=True)


def backend_row(
    spec: str, dev: torch.device, block: int = 16, other: str = "fa3", lm_heads: tuple[int, int, int] = LM_HEADS
) -> None:
    """One step through both served backends: ``new:context`` per sequence joined by '+'; ``NxA:B`` is N of them.
    ``block``: tokens per KV block (FA3 loads a paged cache with TMA only where a block holds whole key tiles).
    ``other``: fa3 or fa4, the paged FlashAttention backend set against the flash backend."""
    from workers.engine.kernels.attention import build_attention_metadata
    from workers.engine.kernels.backends import get_attention_backend
    from workers.engine.kernels.torch_attention import FlashVarlenBackend

    if reason := _unavailable(other, dev):
        print(f"backends {spec}: no {other} ({reason[:200]})", flush=True)
        return
    pairs: list[tuple[int, int]] = []
    for seq in spec.split("+"):
        count, _, shape = seq.rpartition("x")
        pairs += [(int(shape.split(":")[0]), int(shape.split(":")[1]))] * int(count or 1)
    pairs.sort(key=lambda p: p[0] != 1)  # decode rows first, as the scheduler orders a step
    heads, kv_heads, d = lm_heads
    need = [-(-c // block) for _, c in pairs]
    order = torch.randperm(sum(need)).tolist()
    tables = [order[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(need))]
    meta = build_attention_metadata([n for n, _ in pairs], [c for _, c in pairs], tables, block, dev)
    cache = torch.randn(2, sum(need), block, kv_heads, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(sum(n for n, _ in pairs), heads, d, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(q.shape[0], kv_heads, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    flash, fast = FlashVarlenBackend(), get_attention_backend(other, dev)
    flops = sum(4 * n * (c - n / 2) * d * heads for n, c in pairs)
    row(f"step {spec} /{block} {other}", flops, lambda: flash.forward(q, k, v, cache, meta, d**-0.5),
        lambda: fast.forward(q, k, v, cache, meta, d**-0.5))
    if other == "fa4":
        # FA4 loads a paged cache by TMA only where a block is one key tile (128 at heads of 128; 80 at 256, so
        # 256-wide heads read 128-token blocks on its slower non-TMA path): the same step as GLIMPSE_FA4_WIDE_HEADS
        # =gather serves it (decode rows on the Triton kernel, the chunks' keys packed for FA4), against FA2.
        gathered = get_attention_backend("fa4", dev)
        gathered.wide_heads, gathered.wide_above = "gather", 0  # type: ignore[attr-defined]
        row(f"step {spec} /{block} fa4 gathered", flops, lambda: flash.forward(q, k, v, cache, meta, d**-0.5),
            lambda: gathered.forward(q, k, v, cache, meta, d**-0.5))


def _unavailable(other: str, dev: torch.device) -> str:
    from workers.engine.kernels import fa3_attention, fa4_attention

    return (fa4_attention if other == "fa4" else fa3_attention).unavailable_reason(dev)


def vit_fa3_rows(dev: torch.device, other: str, full: tuple[int, int, int]) -> None:
    """The ViT's two kernels under ``--attn-backend fa3`` / ``fa4`` (that kernel's packed call) against FA2
    varlen: one 1080p frame's windowed block (8 x 8-patch windows, ragged at the edges) and a full block of
    ``full`` (patches, heads, head width: by default Qwen2.5-VL's 1080p frame, the windows' patches whole)."""
    from workers.engine.kernels.backends import vision_kernel

    if reason := _unavailable(other, dev):
        print(f"ViT on {other}: unavailable ({reason[:200]})", flush=True)
        return
    packed_kernel = vision_kernel(other if other == "fa4" else "fa3", dev)
    assert packed_kernel is not None
    rows, cols = 39, 69  # 1080p: 78 x 138 patches, merged 2 x 2, windows of 4 x 4 merged units (heads 16 x 80)
    windows = [min(4, rows - r) * min(4, cols - c) * 4 for r in range(0, rows, 4) for c in range(0, cols, 4)]
    for name, lengths, h, d in (("windows", windows, 16, 80), ("full block", [full[0]], full[1], full[2])):
        n = sum(lengths)
        x = torch.randn(n, h, d, device=dev, dtype=torch.bfloat16)
        bounds = list(accumulate(lengths, initial=0))
        cu, top = torch.tensor(bounds, dtype=torch.int32, device=dev), max(lengths)
        flops = sum(4 * m * m * h * d for m in lengths)
        row(f"ViT {name} {n} x {h}h x {d}, {other}", flops,
            lambda x=x, cu=cu, top=top, d=d: torch.ops.aten._flash_attention_forward(  # type: ignore[misc]
                x, x, x, cu, cu, top, top, 0.0, False, False, scale=d**-0.5)[0],
            lambda x=x, cu=cu, top=top, d=d: packed_kernel(x, x, x, cu, top, d**-0.5))  # type: ignore[misc]


def vit_window_rows(dev: torch.device) -> None:
    """The ViT's windowed blocks: FA2 varlen (the old path) against the Triton kernel for short segments
    (window_attention.py), one frame per row, windows of 8 x 8 patches ragged at the edges. Timed from CUDA graphs
    (a Triton launch costs more host time than these kernels take)."""
    from benchmarks.kernels.rope_bench import graph_us
    from workers.engine.kernels import window_attention

    h, d = 16, 80
    print(f"{'ViT windows (graph-timed)':34} {'FA2 us':>8} {'Triton us':>10} {'speedup':>8} {'rel err':>9}")
    for name, (rows, cols) in (("1080p", (39, 69)), ("720p", (26, 46)), ("448 x 448", (16, 16))):  # merged units
        lengths = [min(4, rows - r) * min(4, cols - c) * 4 for r in range(0, rows, 4) for c in range(0, cols, 4)]
        n, bounds = sum(lengths), list(accumulate(lengths, initial=0))
        q, k, v = (torch.randn(n, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        cu, top = torch.tensor(bounds, dtype=torch.int32, device=dev), max(lengths)

        def fa2(q: Tensor = q, k: Tensor = k, v: Tensor = v, cu: Tensor = cu, top: int = top) -> Tensor:
            out: Tensor = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, top, top, 0.0, False, False,
                                                                  scale=d**-0.5)[0]
            return out

        for warps in (0, 2, 8) if name == "1080p" else (0,):
            def tri(q: Tensor = q, k: Tensor = k, v: Tensor = v, cu: Tensor = cu, top: int = top,
                    w: int = warps) -> Tensor:
                return window_attention.attend(q, k, v, cu, top, d**-0.5, warps=w)

            a, b = graph_us(fa2), graph_us(tri)
            err = float((tri().float() - fa2().float()).norm() / fa2().float().norm())
            label = f"{name}, {n} patches, warps {warps or 'auto'}"
            print(f"{label:34} {a:>8.1f} {b:>10.1f} {a / b:>7.2f}x "
                  f"{err:>9.1e}", flush=True)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--chunks", default="1024:4096,1024:16384,1024:21504,4096:16384",
                    help="LM shapes as new_tokens:context, comma separated")
    ap.add_argument("--backends", default="", help="served LM steps, comma separated: new:context per sequence, "
                    "joined by '+' (NxA:B repeats one N times)")
    ap.add_argument("--block-sizes", default="16", help="KV block sizes for the --backends rows, comma separated")
    ap.add_argument("--vit-fa3", action="store_true", help="the ViT's windows and full block on FA3 against FA2")
    ap.add_argument("--vit-windows", action="store_true", help="the ViT's windows on the Triton kernel against FA2")
    ap.add_argument("--other", default="fa3", choices=["fa3", "fa4"],
                    help="the FlashAttention set against FA2 in the --backends and --vit-fa3 rows")
    ap.add_argument("--ragged", default="", help="packed LM steps, comma separated: new:context per sequence, "
                    "joined by '+'")
    ap.add_argument("--lm-heads", default="28:4:128", help="the LM rows' query heads:KV heads:head width (Qwen3.5's "
                    "gated attention: 16:4:256 on the 9B, 24:4:256 on the 27B)")
    ap.add_argument("--vit", default="10764:16:80", help="the ViT full-block row's patches:heads:head width "
                    "(Qwen3-VL's and Qwen3.5's tower at 1080p: 8160:16:72)")
    args = ap.parse_args()
    lm_q, lm_kv, lm_d = (int(v) for v in args.lm_heads.split(":"))
    lm_heads = (lm_q, lm_kv, lm_d)
    vit_n, vit_h, vit_d = (int(v) for v in args.vit.split(":"))
    dev, bf = torch.device("cuda"), torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, bf16; ms and TFLOP/s per call; the other kernel is cuDNN, or FA3 on the"
          " step rows; rel err = the other kernel's output against FlashAttention-2's")
    print(f"{'shape':34} {'FA2 ms':>8} {'TFLOP/s':>7} {'other ms':>9} {'TFLOP/s':>7} {'speedup':>8} {'rel err':>9}")
    with torch.inference_mode():
        n, h, d = vit_n, vit_h, vit_d
        x = torch.randn(n, h, d, device=dev, dtype=bf)
        cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
        xs = x.transpose(0, 1).unsqueeze(0)

        def vit_cudnn() -> Tensor:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                out: Tensor = torch.nn.functional.scaled_dot_product_attention(xs, xs, xs, scale=d**-0.5)
            return out[0].transpose(0, 1)

        row(f"ViT full block {n} x {h}h x {d}", 4 * n * n * h * d,
            lambda: torch.ops.aten._flash_attention_forward(x, x, x, cu, cu, n, n, 0.0, False, False,
                                                            scale=d**-0.5)[0], vit_cudnn)
        heads, kv_heads, d = lm_heads
        for spec in filter(None, args.chunks.split(",")):
            nq, s = (int(v) for v in spec.split(":"))
            q = torch.randn(nq, heads, d, device=dev, dtype=bf)
            k, v = (torch.randn(s, kv_heads, d, device=dev, dtype=bf) for _ in range(2))
            cq, ck = (torch.tensor([0, m], dtype=torch.int32, device=dev) for m in (nq, s))

            def fa(q: Tensor = q, k: Tensor = k, v: Tensor = v, cq: Tensor = cq, ck: Tensor = ck,
                   nq: int = nq, s: int = s) -> Tensor:
                out: Tensor = torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, nq, s, 0.0, True, False,
                                                                      scale=d**-0.5)[0]
                return out

            flops = 4 * nq * (s - nq / 2) * d * heads
            row(f"LM chunk {nq} new / {s} context", flops, fa,
                lambda q=q, k=k, v=v: lm_chunk_cudnn(q, k, v, d**-0.5))  # type: ignore[misc]
        for spec in filter(None, args.ragged.split(",")):
            ragged_row(spec, dev, lm_heads)
        for spec in filter(None, args.backends.split(",")):
            for block in (int(b) for b in args.block_sizes.split(",")):
                backend_row(spec, dev, block, args.other, lm_heads)
        if args.vit_fa3:
            vit_fa3_rows(dev, args.other, (vit_n, vit_h, vit_d))
        if args.vit_windows:
            vit_window_rows(dev)


if __name__ == "__main__":
    main()
