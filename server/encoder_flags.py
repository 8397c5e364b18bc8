"""`glimpse serve`'s encoder-worker flags that need the host's GPUs or other libraries: where encoders run
(--encoder-devices), the default size of their landing pools (--encoder-landing-mb) and the transport that carries
their entries (--encoder-transport)."""

from __future__ import annotations


def encoder_devices(text: str, device: str, workers: int, family: str) -> tuple[int, ...]:
    """--encoder-devices as GPU indices, checked against the GPUs this host has (refused without CUDA or without
    encoder workers, where it would mean nothing)."""
    import torch  # here, not at the top: the CLI's other commands start without it

    from workers.engine.models import family as family_package

    if workers and family_package(family).build_tower is None:
        raise SystemExit(f"glimpse serve: --encoder-workers: the {family} family has no vision tower of its own to run")
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        return ()
    if not workers or not device.startswith("cuda"):
        raise SystemExit("glimpse serve: --encoder-devices takes CUDA devices and needs --encoder-workers")
    try:
        indices = tuple(int(e) for e in entries)
    except ValueError:
        raise SystemExit(f"glimpse serve: --encoder-devices: {text!r} is not a list of GPU indices") from None
    count = torch.cuda.device_count()
    if any(not 0 <= i < count for i in indices):
        raise SystemExit(f"glimpse serve: --encoder-devices {text}: this host has GPUs 0..{count - 1}")
    return indices


# The pool on an encoder GPU of its own: measured at 16384 MiB (2 x H200: entries peer to peer served 1.19x the
# requests/s of landing through /dev/shm, docs/benchmarks.md "Encoder workers"); a quarter of a smaller card leaves
# the ViT its activations.
SPLIT_LANDING_MB = 16384


# --encoder-transport nixl's pool when no size is given: ~16 Qwen3-VL-8B 1080p entries waiting for their import.
NIXL_LANDING_MB = 1024


def check_transport(transport: str, workers: int, landing_flag: int | None) -> None:
    """--encoder-transport nixl: refused without encoder workers or with no pool, and where NIXL cannot be imported
    (at start-up, not at the first image)."""
    if transport != "nixl":
        return
    if not workers:
        raise SystemExit("glimpse serve: --encoder-transport nixl needs --encoder-workers 1 or more")
    if landing_flag == 0:
        raise SystemExit("glimpse serve: --encoder-transport nixl lands entries in a pool: --encoder-landing-mb must "
                         "be more than 0")
    from workers.common.nixl import NixlMissing, nixl_api

    try:
        nixl_api()
    except NixlMissing as exc:
        raise SystemExit(f"glimpse serve: {exc}") from None


def landing_mb(flag: int | None, encoder_devices: tuple[int, ...], lm_gpus: int, transport: str = "local") -> int:
    """--encoder-landing-mb, or its default: NIXL_LANDING_MB for the NIXL transport; else a pool where every encoder
    has a GPU no model rank uses (model ranks take GPUs 0 .. dp x tp - 1), since there it takes no memory from the KV
    cache; 0 (shared memory) where encoders share the model ranks' GPUs, whose KV budget does not count a pool."""
    if flag is not None:
        return flag
    if transport == "nixl":
        return NIXL_LANDING_MB
    if not encoder_devices or any(i < lm_gpus for i in encoder_devices):
        return 0
    import torch

    smallest = min(torch.cuda.get_device_properties(i).total_memory for i in set(encoder_devices))
    return min(SPLIT_LANDING_MB, (smallest >> 20) // 4)
