"""Tensor parallelism: the linear weights of every transformer block split over the ranks of a tp group.

Megatron's scheme. In each block the projections that make heads or MLP channels (q, k, v, MLP-in)
are column-parallel: a tp rank keeps the output rows of its share of the heads (whole heads: its
head h is global head rank * H/tp + h) and of the MLP channels, and computes them from the whole,
replicated activation with no communication. The projections that consume them (attention out,
MLP-out) are row-parallel: a rank keeps the matching input columns, and the partial products of
the group are summed by one all-reduce, the bias added once after it. Between the two the
attention runs on the rank's H/tp heads, and the q/k RMSNorms (over the head dimension) apply
unchanged. The context-parallel axes compose inside: tokens are sharded over the sequence ranks
as without tp, and Ulysses trades sequence shards for shards of the H/tp local heads.

Packed layers split each of their blocks alike (LinearSplit.blocks): FLUX.1's single-stream
proj_out takes [attention, MLP] concatenated, FLUX.2's fused projection makes [q, k, v, gate, up]
and its double-stream MLP-in [gate, up]. Small layers stay replicated on every rank: embedders,
AdaLN modulation, the final norm and projection. The processors that read head counts from the
attention module (Cosmos' `heads`, Cosmos 3's `num_attention_heads` / `num_key_value_heads`) get
the rank's count on the module instance (WeightSplit.head_counts); FLUX's processors infer it.
A model's split is made for one tp degree by its adapter module (pipelines.flux.parallel.flux_weights, ...).

Why our own two layer types rather than torch's DTensor tensor-parallel API (which diffusers 0.42
offers for FLUX.1 and FLUX.2): a column-parallel layer here is a plain, smaller nn.Linear, and a
row-parallel one a smaller nn.Linear plus one functional all-reduce. Everything downstream keeps
seeing plain tensors: our context-parallel processors slice and reshape q/k/v by local shapes,
pass weights to torch.library custom ops (collectives.linear_after) that a DTensor cannot enter,
and the per-block torch.compile engines trace the all-reduce like our other functional
collectives, without DTensor's per-op sharding propagation. Cosmos-Predict2 and Cosmos 3 have no
diffusers plan, and Cosmos 3's grouped K/V heads need their own split anyway.

Cosmos 3's K/V heads (fewer than the query heads) are split like the query heads, so each rank
keeps the K/V heads its query heads read (8 K/V heads for Nano and Super: tp up to 8); where tp is
a multiple of the K/V heads, consecutive ranks keep the same K/V head (LinearSplit.replicas).

Weights can be split in place (split_weights on a loaded model, as the tests do) or never loaded
whole: engines/weights/sharded_loading.py builds the model on the meta device, splits the meta layers and
reads each rank's slices from the safetensors files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from engines.levers.fp8_matmul import scaled_mm_linear
from engines.parallel.collectives import all_reduce
from engines.parallel.mesh import ParallelMesh


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearSplit:
    """How one nn.Linear is split: its output rows ("column"-parallel) or its input columns ("row")."""

    style: Literal["column", "row"]
    blocks: tuple[int, ...] = ()
    """Sizes of the packed parts along the split dimension, each split over the ranks on its own;
    () for one part (the whole dimension)."""
    replicas: int = 1
    """Consecutive ranks that keep the same slice: K/V heads fewer than the tp ranks (Cosmos 3's 2 K/V
    heads of the tiny model over 4 ranks: ranks 0-1 keep head 0, ranks 2-3 head 1)."""

    @property
    def dim(self) -> int:
        """The weight dimension that is split: 0 (output rows) or 1 (input columns)."""
        return 0 if self.style == "column" else 1

    def parts(self, size: int) -> tuple[int, ...]:
        """The packed parts of a dimension of `size`."""
        blocks = self.blocks or (size,)
        if sum(blocks) != size:
            raise ValueError(f"packed blocks {blocks} do not add up to the split dimension's {size}")
        return blocks

    def ranges(self, size: int, tp: int, rank: int) -> list[tuple[int, int]]:
        """(start, length) along the split dimension of the rows/columns that `rank` of `tp` keeps."""
        if tp % self.replicas:
            raise ValueError(f"tp degree {tp} is not a multiple of a split layer's {self.replicas} replicas")
        tp, rank = tp // self.replicas, rank // self.replicas
        out, offset = [], 0
        for part in self.parts(size):
            if part % tp:
                raise ValueError(f"tp degree {tp} does not divide a split layer's part of {part}")
            share = part // tp
            out.append((offset + rank * share, share))
            offset += part
        return out


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightSplit:
    """A model's tensor-parallel split: which linears split how, which head counts divide."""

    linears: dict[str, LinearSplit]
    """Qualified module name (as named_modules gives it) -> its split."""
    head_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    """Qualified module name -> its attributes that count heads -> their value on each rank."""

    def check(self, model: nn.Module, tp: int) -> None:
        """Raise ValueError, naming the first layer that `tp` does not split evenly."""
        modules = dict(model.named_modules())
        for name, split in self.linears.items():
            size = modules[name].weight.shape[split.dim]
            for part in split.parts(size):
                if part % (tp // split.replicas):
                    raise ValueError(f"tp degree {tp} does not divide {name}'s {part} "
                                     f"{'outputs' if split.style == 'column' else 'inputs'}")

    def parameter_ranges(self, name: str, shape: tuple[int, ...], tp: int, rank: int
                         ) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, ranges) of the parameter `name` ("module.weight" / "module.bias") that `rank` keeps,
        or None where the rank keeps it whole (replicated layers, a row-parallel layer's bias)."""
        module, _, kind = name.rpartition(".")
        split = self.linears.get(module)
        if split is None or (kind == "bias" and split.style == "row"):
            return None
        return split.dim, split.ranges(shape[split.dim], tp, rank)


COLUMN = LinearSplit(style="column")
"""A projection that makes heads or MLP channels, split by its output rows."""
ROW = LinearSplit(style="row")
"""A projection that consumes them, split by its input columns."""


class RowParallelLinear(nn.Linear):
    """nn.Linear over this rank's input columns: partial products summed over the tp group, bias after.

    `group_name` is the tp group's name (ParallelMesh.tp_group_name), set by split_weights; a layer
    built for loading before the mesh exists has none yet and refuses to run."""

    def __init__(self, in_features: int, out_features: int, bias: bool, *, tp: int, group_name: str = "",
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.tp = tp
        """The tp degree this layer was split for."""
        self.group_name = group_name
        self.lora: nn.Module | None = None
        """The rank's LoRA term over its input columns (engines.weights.lora.attach_loras), or None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.group_name:
            raise RuntimeError("this row-parallel layer has no tp group: parallelize the model first")
        # --fp8: the input's scales over its whole rows (engines/levers/fp8.py)
        if self.weight.dtype == torch.float8_e4m3fn:
            out = scaled_mm_linear(x, self.weight, self.weight_scale, None, group_name=self.group_name)
        else:
            out = F.linear(x, self.weight)
        if self.lora is not None:  # a partial product too: summed by the same all-reduce, once
            out = out + self.lora(x)
        out = all_reduce(out, self.group_name)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tp={self.tp}, group={self.group_name or None}"


def take(tensor: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The slices `ranges` of `tensor` along `dim`, concatenated (a copy: the whole can be freed)."""
    return torch.cat([tensor.narrow(dim, start, length) for start, length in ranges], dim=dim).clone()


def _split_linear(linear: nn.Linear, split: LinearSplit, tp: int, rank: int, group_name: str) -> nn.Linear:
    weight = linear.weight
    ranges = split.ranges(weight.shape[split.dim], tp, rank)
    local = sum(length for _, length in ranges)
    has_bias = linear.bias is not None
    factory = dict(device=weight.device, dtype=weight.dtype)
    if split.style == "column":
        out = nn.Linear(linear.in_features, local, bias=has_bias, device="meta", dtype=weight.dtype)
        bias = take(linear.bias, 0, ranges) if has_bias else None
    else:
        out = RowParallelLinear(local, linear.out_features, has_bias, tp=tp, group_name=group_name, device="meta",
                                dtype=weight.dtype)
        bias = linear.bias.detach().clone() if has_bias else None
    out.weight = nn.Parameter(take(weight.detach(), split.dim, ranges).to(**factory), requires_grad=False)
    if has_bias:
        out.bias = nn.Parameter(bias.to(**factory), requires_grad=False)
    out.train(linear.training)
    return out


def split_weights(model: nn.Module, weights: WeightSplit, *, tp: int, rank: int, group_name: str = "") -> None:
    """Keep only rank `rank`'s share of `model`'s split linears (of `tp` ranks), in place; weights on
    the meta device stay there, at the local shape (for sharded loading).

    Idempotent: a model already split (its row-parallel layers in place) only gets `group_name` set on
    them, so a model loaded split (engines.weights.sharded_loading) goes through its family's adapter unchanged.
    """
    if tp == 1:
        return
    modules = dict(model.named_modules())
    rows = [modules[name] for name in weights.linears if isinstance(modules[name], RowParallelLinear)]
    if rows:
        if any(row.tp != tp for row in rows):
            raise ValueError(f"this model was split for tp {rows[0].tp}, not {tp}: load it again for this plan")
        for row in rows:
            row.group_name = group_name or row.group_name
        return
    weights.check(model, tp)
    for name, split in weights.linears.items():
        parent, _, child = name.rpartition(".")
        owner = modules[parent] if parent else model
        # popped, so that nothing here keeps the whole layer: each whole weight is freed as soon as its share
        # replaces it, and splitting a model that fills most of a GPU in place needs one layer's share beside it
        setattr(owner, child, _split_linear(modules.pop(name), split, tp, rank, group_name))
    for name, counts in weights.head_counts.items():
        for attribute, count in counts.items():
            setattr(modules[name], attribute, count)


def local_heads(heads: int, tp: int) -> int:
    """Attention heads per rank: `heads` / `tp`, which must divide (a rank holds whole heads)."""
    if heads % tp:
        raise ValueError(f"tp degree {tp} does not divide the model's {heads} attention heads")
    return heads // tp


def rank_parameters(model: nn.Module, split: WeightSplit, tp: int) -> int:
    """Parameters (elements) one rank of `tp` keeps of `model` (whole, on any device, meta included)
    under `split`: every rank keeps the same count."""
    total = 0
    for name, parameter in model.named_parameters():
        ranges = split.parameter_ranges(name, tuple(parameter.shape), tp, 0) if tp > 1 else None
        if ranges is None:
            total += parameter.numel()
        else:
            dim, kept = ranges
            total += parameter.numel() // parameter.shape[dim] * sum(length for _, length in kept)
    return total


def split_over_mesh(model: nn.Module, weights: Callable[[nn.Module, int], WeightSplit], mesh: ParallelMesh) -> None:
    """Split `model`'s weights over the mesh's tp group (nothing without one), by its family's split
    `weights(model, tp)` (read from the model's config, so a model loaded split gives the same one)."""
    tp = mesh.plan.tp
    if tp > 1:
        split_weights(model, weights(model, tp), tp=tp, rank=mesh.tp_rank, group_name=mesh.tp_group_name)
