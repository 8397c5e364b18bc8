"""Tensor-parallel building blocks for glimpse's own decoders.

Every parallel layer allocates only this rank's shard and attaches a ``weight_loader`` to each of
its parameters. The loader receives the *full* checkpoint tensor (as stored by Hugging Face) and
copies this rank's slice into the parameter, so one loading loop works for any TP size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.kernels import fp8_gemm, fused, skinny_gemm, split_norm
from workers.engine.kernels.skinny_gemm import Partials
from workers.engine.layers.deferred import weight_empty

WeightLoader = Callable[..., None]


@dataclass(frozen=True)
class TPGroup:
    """Tensor-parallel coordinates of this process; the default is a single rank (no communication)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup, or None for the default (WORLD) group

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum ``x`` over the TP ranks (in place when size > 1) and return it."""
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: Tensor, src: int = 0) -> Tensor:
        """Overwrite ``x`` (contiguous, the same shape on every rank) with rank ``src``'s, in place."""
        if self.size > 1:
            root = src if self.group is None else dist.get_global_rank(self.group, src)  # broadcast takes a global rank
            dist.broadcast(x, src=root, group=self.group)
        return x

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


# Module-level default so signatures can say `tp: TPGroup = SINGLE_RANK` without a call in a default.
SINGLE_RANK = TPGroup()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """F.linear, or on CUDA at decode row counts the Triton kernel that streams large weights faster
    (skinny_gemm.py); an FP8 weight (``scale`` given: its dequantization scales) goes to fp8_gemm.py."""
    if scale is not None:
        return fp8_gemm.linear(x, weight, scale, bias)
    if skinny_gemm.wanted(x, weight):
        return skinny_gemm.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_into(x: Tensor, weight: Tensor, out: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """``linear`` with its product in ``out`` (x's rows, contiguous along the output): where F.linear would serve
    (no FP8 scale, not the decode-row kernel, 2-D x) cuBLAS writes it there itself, the same GEMM as F.linear's;
    elsewhere ``linear``'s result is copied in. Returns ``out``."""
    if scale is None and x.dim() == 2 and not skinny_gemm.wanted(x, weight):
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)
    return out.copy_(linear(x, weight, bias, scale))


def unsummed_linear(
    x: Tensor, weight: Tensor, scale: Tensor | None = None, bias: Tensor | None = None
) -> Tensor | Partials:
    """``linear`` for x [T, K], but a decode GEMM that splits K returns its partials unsummed (the bias with them),
    for the next kernel to sum: the RMSNorm's (split_norm.py) or the SiLU's (silu_kernel.py)."""
    if scale is not None:
        return fp8_gemm.unsummed(x, weight, scale, bias)
    if skinny_gemm.wanted(x, weight):
        return skinny_gemm.unsummed(x, weight, bias)
    return F.linear(x, weight, bias)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads stored per rank: split when there are enough, else one replicated head per rank."""
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size)
    divide(tp_size, num_kv_heads)  # replication needs the same number of ranks for every KV head
    return 1


def set_weight_loader(param: Tensor, loader: WeightLoader) -> None:
    # Parameters are plain tensors; the attribute rides along so the model loader can find it.
    setattr(param, "weight_loader", loader)  # noqa: B010 - mypy rejects the attribute form


def copy_into(dst: Tensor, src: Tensor, what: str = "shard") -> None:
    """Copy a checkpoint tensor (or this rank's slice of it) into a parameter (or a slice of one), checking the
    shape first: a mismatch means the checkpoint and the model disagree, never something to broadcast."""
    if dst.shape != src.shape:
        raise ValueError(f"{what} shape mismatch: parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
    """Copy a replicated (unsharded) tensor, checking the shape."""
    copy_into(param, loaded, what="tensor")


def get_weight_loader(param: Tensor) -> WeightLoader:
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader


def sharded_parameters(
    weight_shape: tuple[int, int], bias_size: int | None, weight_loader: WeightLoader, bias_loader: WeightLoader
) -> tuple[nn.Parameter, nn.Parameter | None]:
    """A parallel linear's (weight, bias or None), allocated uninitialised at this rank's shapes, each carrying the
    loader that copies its slice out of the full checkpoint tensor."""
    weight = nn.Parameter(weight_empty(*weight_shape), requires_grad=False)  # meta while deferred (deferred.py)
    set_weight_loader(weight, weight_loader)
    if bias_size is None:
        return weight, None
    bias = nn.Parameter(torch.empty(bias_size), requires_grad=False)
    set_weight_loader(bias, bias_loader)
    return weight, bias


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: each rank computes a slice of the output features."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        tp: TPGroup = SINGLE_RANK,
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features = out_features
        self.out_local = divide(out_features, tp.size)
        self.gather_output = gather_output
        self.weight, self.bias = sharded_parameters(
            (self.out_local, in_features), self.out_local if bias else None, self.weight_loader, self.weight_loader
        )
        self.weight_scale: Tensor | None
        self.register_buffer("weight_scale", None)  # set when the weight becomes FP8 (models/fp8_layers.py)

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        n = param.shape[0]
        copy_into(param, loaded.narrow(0, self.tp.rank * n, n))

    def forward(self, x: Tensor) -> Tensor:
        y = linear(x, self.weight, self.bias, self.weight_scale)
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y

    def forward_into(self, x: Tensor, out: Tensor) -> Tensor:
        """``forward`` with the result in ``out`` ([rows, this rank's outputs]): a static buffer that piecewise CUDA
        graphs read between two pieces, written by the GEMM itself rather than copied there (linear_into)."""
        if self.gather_output:
            return out.copy_(self(x))
        return linear_into(x, self.weight, out, self.bias, self.weight_scale)

    def unsummed(self, x: Tensor) -> Tensor | Partials:
        """``forward`` for a caller whose next kernel sums a split-K decode product's partials itself (each rank's
        output columns are whole after the sum: nothing to reduce across ranks first)."""
        if self.gather_output or x.dim() != 2:
            out: Tensor = self(x)
            return out
        return unsummed_linear(x, self.weight, self.weight_scale, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (e.g. gate_up).

    Each rank stores, for every sub-projection in order, its own slice; ``shard_id`` is the index
    of the sub-projection a checkpoint tensor belongs to.
    """

    def __init__(
        self, in_features: int, output_sizes: Sequence[int], bias: bool = True, tp: TPGroup = SINGLE_RANK
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(in_features, sum(self.output_sizes), bias=bias, tp=tp)

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        if not isinstance(shard_id, int):
            raise TypeError(f"MergedColumnParallelLinear needs an integer shard_id, got {shard_id!r}")
        local = [divide(s, self.tp.size) for s in self.output_sizes]
        offset = sum(local[:shard_id])
        n = local[shard_id]
        copy_into(param.narrow(0, offset, n), loaded.narrow(0, self.tp.rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projection; heads are split across ranks.

    Query heads must divide evenly. KV heads are split when ``num_kv_heads >= tp.size``; otherwise
    each KV head is replicated on ``tp.size // num_kv_heads`` consecutive ranks so that every rank
    still holds the KV head its query heads attend to.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = True,
        tp: TPGroup = SINGLE_RANK,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_heads_local = divide(num_heads, tp.size)
        self.num_kv_heads_local = kv_heads_per_rank(num_kv_heads, tp.size)
        self.q_size = self.num_heads_local * head_dim
        self.kv_size = self.num_kv_heads_local * head_dim
        # The parent divides out_features by tp.size, so hand it the global-equivalent width.
        super().__init__(hidden_size, (self.q_size + 2 * self.kv_size) * tp.size, bias=bias, tp=tp)

    def kv_head_start(self) -> int:
        """Index of the first (global) KV head stored on this rank."""
        if self.num_kv_heads >= self.tp.size:
            return self.tp.rank * self.num_kv_heads_local
        return self.tp.rank * self.num_kv_heads // self.tp.size

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        d = self.head_dim
        if shard_id == "q":
            dst = param.narrow(0, 0, self.q_size)
            src = loaded.narrow(0, self.tp.rank * self.q_size, self.q_size)
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            dst = param.narrow(0, offset, self.kv_size)
            src = loaded.narrow(0, self.kv_head_start() * d, self.kv_size)
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        copy_into(dst, src)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced across ranks.

    The input is expected already split along its last dim (the output of a column-parallel layer).
    The bias is replicated and added once, after the reduction.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        tp: TPGroup = SINGLE_RANK,
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.in_local = divide(in_features, tp.size)
        self.reduce_output = reduce_output
        # The bias is replicated: every rank loads it whole.
        self.weight, self.bias = sharded_parameters(
            (out_features, self.in_local), out_features if bias else None, self.weight_loader, default_weight_loader
        )
        self.weight_scale: Tensor | None
        self.register_buffer("weight_scale", None)  # set when the weight becomes FP8 (models/fp8_layers.py)

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        n = param.shape[1]
        copy_into(param, loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x: Tensor) -> Tensor:
        y = linear(x, self.weight, scale=self.weight_scale)
        if self.reduce_output:
            y = self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y

    def into_norm(self, x: Tensor) -> Tensor | Partials:
        """``forward`` for a caller that hands the result straight to ``RMSNorm.add``: on one rank, without a bias,
        a split-K decode product comes back unsummed and that norm's kernel sums it (split_norm.py)."""
        if self.tp.size == 1 and self.bias is None and x.dim() == 2 and split_norm.available():
            return unsummed_linear(x, self.weight, self.weight_scale)
        out: Tensor = self(x)
        return out


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows; ranks look up their own ids and all-reduce.

    The vocabulary is padded up to a multiple of the TP size; padded rows stay zero.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.num_embeddings_padded = -(-num_embeddings // tp.size) * tp.size
        self.rows_local = self.num_embeddings_padded // tp.size
        self.vocab_start = tp.rank * self.rows_local
        self.vocab_end = min(self.vocab_start + self.rows_local, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_local, embedding_dim), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: Tensor, loaded: Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(
                f"vocab size mismatch: expected {self.num_embeddings}, checkpoint has {loaded.shape[0]}"
            )
        n = self.vocab_end - self.vocab_start
        with torch.no_grad():
            param.zero_()
        copy_into(param.narrow(0, 0, n), loaded.narrow(0, self.vocab_start, n))

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids owned by other ranks look up row 0 and are zeroed, so the all-reduce sums exactly one hit.
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding (so tied weights share one shard layout)."""

    def forward(self, hidden: Tensor) -> Tensor:
        """Return this rank's logits slice ``[N, rows_local]`` (gather with ``TPGroup.all_gather``)."""
        return linear(hidden, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm in float32, cast back before the weight multiply (as transformers does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.fused = False  # CUDA: one compiled kernel (see fused.py); set by fused.enable

    def add(self, x: Tensor, delta: Tensor | Partials) -> tuple[Tensor, Tensor]:
        """Residual add then norm: (x + delta, norm(x + delta)), fused into one pass when enabled; a split-K
        product's partials (``RowParallelLinear.into_norm``) are summed in that pass too."""
        if isinstance(delta, Partials):
            if self.fused and split_norm.available():
                return split_norm.add_rms_norm(x, delta, self.weight, self.eps)
            delta = delta.settle()
        if self.fused and fused.worth_it(x):
            # one Triton launch where it serves: the compiled call's Dynamo guards cost more host time than the
            # kernel takes on the GPU (split_norm.py)
            if split_norm.rows_usable(x, self.weight, delta):
                return split_norm.add_rms_norm_rows(x, delta, self.weight, self.eps)
            out: tuple[Tensor, Tensor] = fused.compiled(fused.add_rms_norm)(x, delta, self.weight, self.eps)
            return out
        s = x + delta
        return s, self(s)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused and fused.worth_it(x):
            if split_norm.rows_usable(x, self.weight):
                return split_norm.rms_norm_rows(x, self.weight, self.eps)
            out: Tensor = fused.compiled(fused.rms_norm)(x, self.weight, self.eps)
            return out
        variance = x.float().pow(2).mean(-1, keepdim=True)
        # x * rsqrt promotes to float32 (exact widening of x) and the out= store rounds once to x's dtype:
        # the same values as normalizing a float32 copy and casting it, without writing and re-reading
        # that copy (36 -> 26 bytes moved per element in bf16).
        normed = torch.mul(x, torch.rsqrt(variance + self.eps), out=torch.empty_like(x))
        return self.weight * normed
