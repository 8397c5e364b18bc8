"""An FP8 copy of a bf16 checkpoint directory, in the layout a published FP8 repo has, so two servers can load the
same FP8 weights from disk (vLLM cannot take glimpse's ``--load-format dummy`` FP8 layers):

    python -m benchmarks.tools.fp8_checkpoint /tmp/ck8 /tmp/ck8fp8 [--format fp8-block|fp8-dynamic]
    SHAPE=qwen3-8b CK=/tmp/ck8fp8 bash tools/vllm-sbs/run.sh vllm   # then glimpse: both on the FP8 copy

Each safetensors shard is quantized as ``glimpse demo-model --quantize`` quantizes the demo's
(demo_quantize.quantize_tensors: the language model's Linear weights and stacked experts, Qwen's
``weight_scale_inv`` 128 x 128 tiles or compressed-tensors' per-row ``weight_scale``), on the GPU when there is
one; the shard index gains the scales, config.json the ``quantization_config``, and every other file is linked.
The destination gets the vLLM harness's ``.ok`` mark, so its checkpoint step leaves it as it is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from benchmarks.args import parser
from workers.engine.models.demo_quantize import QUANTIZE_FORMATS, quantize_tensors, write_quantization_config

INDEX = "model.safetensors.index.json"


def write_fp8_copy(src: Path, dest: Path, fmt: str, device: torch.device) -> list[str]:
    """Write ``src`` into ``dest`` in ``fmt``; returns the shard files written."""
    from safetensors.torch import load_file, save_file

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise SystemExit(f"no safetensors files in {src}")
    for f in src.iterdir():
        if not f.is_file() or f.suffix == ".safetensors" or f.name in (INDEX, "config.json", ".ok"):
            continue
        if f.stat().st_dev == dest.stat().st_dev:
            os.link(f, dest / f.name)
        else:
            shutil.copy(f, dest / f.name)
    shutil.copy(src / "config.json", dest / "config.json")
    weight_map: dict[str, str] = {}
    not_converted: list[str] = []
    for shard in shards:
        tensors = {name: t.to(device) for name, t in load_file(shard).items()}
        result, skipped = quantize_tensors(tensors, fmt)
        del tensors
        save_file({name: t.cpu().contiguous() for name, t in result.items()}, dest / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(result, shard.name))
        not_converted += skipped
        del result
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if (src / INDEX).exists():
        index = json.loads((src / INDEX).read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        (dest / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    write_quantization_config(dest, fmt, not_converted)
    (dest / ".ok").touch()
    return [s.name for s in shards]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("src", type=Path)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--format", default="fp8-block", choices=QUANTIZE_FORMATS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    written = write_fp8_copy(args.src, args.dest, args.format, torch.device(args.device))
    print(f"{args.format} copy of {args.src} in {args.dest}: {len(written)} shard(s)")


if __name__ == "__main__":
    main()
