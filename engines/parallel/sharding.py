"""Token layout across sequence shards, and the entry/exit moves of a sharded forward.

Every segment of the sequence (FLUX: text then image; Cosmos: video) of n tokens is padded to
degree * ceil(n / degree) tokens and cut into `degree` equal chunks; shard i holds chunk i of every
segment, in segment order. Equal shapes on every rank keep every collective even (and traceable
with static shapes); padded positions are dropped from the keys inside attention and cut off at
the exit, so padding never changes a real token's output.

Shape legend: B batch, S tokens (local unless named), C channels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engines.parallel.collectives import all_gather
from engines.parallel.mesh import ParallelMesh


@dataclass(kw_only=True, frozen=True, slots=True)
class ShardLayout:
    """Split of a multi-segment token sequence into `degree` equal, zero-padded shards."""

    lengths: tuple[int, ...]
    """Real token count of each segment, in the order the local sequence concatenates them."""
    degree: int
    """Number of sequence shards."""

    def __post_init__(self) -> None:
        if self.degree < 1:
            raise ValueError(f"degree must be >= 1, got {self.degree}")
        if any(n < 0 for n in self.lengths):
            raise ValueError(f"segment lengths must be >= 0, got {self.lengths}")

    def chunk(self, segment: int) -> int:
        """Tokens of `segment` per shard, padding included."""
        return math.ceil(self.lengths[segment] / self.degree)

    @property
    def local_length(self) -> int:
        """Tokens per shard, all segments and padding included."""
        return sum(self.chunk(i) for i in range(len(self.lengths)))

    @property
    def padded(self) -> bool:
        """True when any shard carries padding."""
        return any(n % self.degree for n in self.lengths)

    def valid(self, segment: int, shard: int) -> int:
        """Real (non-padding) tokens of `segment` held by `shard`."""
        chunk = self.chunk(segment)
        return max(0, min(chunk, self.lengths[segment] - shard * chunk))

    def valid_runs(self, shards: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """(start, length) runs of real tokens in a buffer that concatenates the local sequences
        of `shards`, in that order; adjacent runs are merged, so an unpadded buffer is one run."""
        runs: list[tuple[int, int]] = []
        offset = 0
        for shard in shards:
            for segment in range(len(self.lengths)):
                n = self.valid(segment, shard)
                if n:
                    if runs and runs[-1][0] + runs[-1][1] == offset:
                        runs[-1] = (runs[-1][0], runs[-1][1] + n)
                    else:
                        runs.append((offset, n))
                offset += self.chunk(segment)
        return tuple(runs)


def shard_tokens(x: torch.Tensor, layout: ShardLayout, *, segment: int, shard: int, dim: int) -> torch.Tensor:
    """This shard's chunk of one segment of `x` along `dim`, zero-padded to layout.chunk(segment)."""
    n, chunk = layout.lengths[segment], layout.chunk(segment)
    if x.shape[dim] != n:
        raise ValueError(f"expected {n} tokens along dim {dim}, got shape {tuple(x.shape)}")
    valid = layout.valid(segment, shard)
    piece = x.narrow(dim, min(shard * chunk, n), valid)
    if valid == chunk:
        return piece
    pad_shape = list(x.shape)
    pad_shape[dim] = chunk - valid
    return torch.cat([piece, x.new_zeros(pad_shape)], dim=dim)


def gather_tokens(x: torch.Tensor, mesh: ParallelMesh, *, length: int, dim: int) -> torch.Tensor:
    """All-gather a single-segment sequence sharded along `dim` and cut the padding (to `length`)."""
    # Shard s = ring_rank * ulysses + ulysses_rank: gathering the inner axis first yields shard order.
    for axis in mesh.sequence_axes():
        x = all_gather(x, dim, axis.group, axis.size)
    return x.narrow(dim, 0, length)


def check_batch(batch: int, mesh: ParallelMesh) -> None:
    """Raise ValueError unless the batch splits evenly over the CFG groups."""
    if batch % mesh.plan.cfg != 0:
        raise ValueError(
            f"cfg degree {mesh.plan.cfg} needs a batch divisible by {mesh.plan.cfg} "
            f"(conditional and unconditional inputs concatenated), got batch {batch}"
        )


def split_batch(x: torch.Tensor | None, mesh: ParallelMesh, *, batch: int) -> torch.Tensor | None:
    """This CFG group's slice of the batch; tensors with batch 1 broadcast and stay whole."""
    cfg = mesh.plan.cfg
    if x is None or cfg == 1 or x.ndim == 0 or x.shape[0] == 1:
        return x
    if x.shape[0] != batch:
        raise ValueError(f"expected a leading batch dimension of {batch} (or 1), got shape {tuple(x.shape)}")
    size = batch // cfg
    return x.narrow(0, mesh.cfg_rank * size, size)


def gather_batch(x: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """Concatenate the CFG groups' batch slices (in group order) on every rank."""
    if mesh.plan.cfg == 1:
        return x
    return all_gather(x, 0, mesh.cfg_group, mesh.plan.cfg)
