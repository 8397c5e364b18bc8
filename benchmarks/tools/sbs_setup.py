"""Copy the side-by-side harness (``../shared/vllm-sbs``: vLLM 0.24 and glimpse on one GPU) into a git-ignored folder
of the checkout, with the knobs docs/benchmarks.md's commands use added to its ``sbs.py``:

- ``SBS_BENCHES=warmup,b``: run only these of warm-up and (a)-(d), in their order;
- ``SBS_GLIMPSE_EXTRA="--flag value ..."``: more ``glimpse serve`` flags (a later flag wins over the harness's);
- ``SBS_VLLM_EXTRA="--flag value ..."``: more vLLM server flags;
- ``SBS_LOGPROBS=0``: (a)-(c) without ``--logprobs`` (on by default: every token is a chunk of its own, so TTFT and
  the inter-token gaps count tokens that decode to no text too).

    python -m benchmarks.tools.sbs_setup                      # ../shared/vllm-sbs -> tools/vllm-sbs
    python -m benchmarks.tools.sbs_setup SRC DEST

The harness itself is not glimpse's (the device machine does not get ``../shared``, so it travels as a carried
folder); this only adds environment hooks after its flag lists, and refuses a harness whose lists it cannot find.
"""

from __future__ import annotations

import shutil
import stat
import sys
from pathlib import Path

from benchmarks.args import parser

# Placed right after the line that defines VLLM_FLAGS: BENCHES, GLIMPSE_FLAGS and VLLM_FLAGS exist by then.
HOOKS = '''
# --- added by glimpse's benchmarks/tools/sbs_setup.py ---
import shlex as _shlex  # noqa: E402

GLIMPSE_FLAGS = GLIMPSE_FLAGS + _shlex.split(os.environ.get("SBS_GLIMPSE_EXTRA", ""))
VLLM_FLAGS = VLLM_FLAGS + _shlex.split(os.environ.get("SBS_VLLM_EXTRA", ""))
if os.environ.get("SBS_LOGPROBS", "1") != "0":
    BENCHES = [(n, m, [*f, "--logprobs"] if n in ("a", "b", "c") else f) for n, m, f in BENCHES]
if os.environ.get("SBS_BENCHES"):
    _wanted = os.environ["SBS_BENCHES"].split(",")
    _unknown = set(_wanted) - {n for n, _, _ in BENCHES}
    if _unknown:
        raise SystemExit(f"SBS_BENCHES names unknown benches: {sorted(_unknown)}")
    BENCHES = [b for b in BENCHES if b[0] in _wanted]
# --- end of glimpse's hooks ---
'''
MARK = "# --- added by glimpse's benchmarks/tools/sbs_setup.py ---"


def add_hooks(source: str) -> str:
    """``sbs.py``'s text with the hooks after its ``VLLM_FLAGS = ...`` statement (once: a second run changes nothing)."""
    if MARK in source:
        return source
    lines = source.splitlines(keepends=True)
    for name in ("BENCHES", "GLIMPSE_FLAGS", "VLLM_FLAGS"):
        if not any(line.startswith(name) for line in lines):
            raise ValueError(f"sbs.py defines no {name} at the top level: not the harness these hooks were written for")
    if not any(line.startswith("import os") for line in lines):
        raise ValueError("sbs.py does not import os at the top level")
    start = next(i for i, line in enumerate(lines) if line.startswith("VLLM_FLAGS"))
    end = start
    while lines[end].count("[") > lines[end].count("]") or lines[end].rstrip().endswith(("\\", ",")):
        end += 1  # a list written over several lines
    return "".join(lines[: end + 1]) + HOOKS + "".join(lines[end + 1 :])


def setup(src: Path, dest: Path) -> Path:
    """Copy ``src`` to ``dest`` (replacing it), writable, with the hooks in ``dest/sbs.py``."""
    if not (src / "sbs.py").is_file() or not (src / "run.sh").is_file():
        raise FileNotFoundError(f"{src} holds no sbs.py and run.sh: not the side-by-side harness")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    for path in [dest, *dest.rglob("*")]:  # ../shared is read-only; the copy must not be
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    sbs = dest / "sbs.py"
    sbs.write_text(add_hooks(sbs.read_text()))
    return dest


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[2]
    ap = parser(__doc__)
    ap.add_argument("src", nargs="?", type=Path, default=root.parent / "shared" / "vllm-sbs")
    ap.add_argument("dest", nargs="?", type=Path, default=root / "tools" / "vllm-sbs")
    args = ap.parse_args(argv)
    try:
        out = setup(args.src, args.dest)
    except (FileNotFoundError, ValueError) as exc:
        print(f"sbs_setup: {exc}", file=sys.stderr)
        return 1
    print(f"harness with glimpse's hooks in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
