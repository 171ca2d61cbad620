"""FLUX's AdaLN modulations computed once per forward and shared out over the sequence ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel
from torch import nn

from engines.parallel.collectives import all_gather


class _Precomputed(nn.Module):
    """Stands in for an AdaLN modulation projection whose output SharedModulation computed ahead:
    returns columns [start, stop) of what the block now receives as `temb` (the projection's
    output, or, in a double-stream block, the outputs of both its streams' projections side by
    side). The projection stays a child, so that .to() and state_dict still reach its weights."""

    def __init__(self, source: nn.Linear, start: int, stop: int) -> None:
        super().__init__()
        self.source = source
        self.start, self.stop = start, stop

    def forward(self, modulation: torch.Tensor) -> torch.Tensor:
        return modulation[:, self.start:self.stop]


class SharedModulation:
    """FLUX's AdaLN modulations, computed once per forward and shared out over the sequence ranks.

    Every block (and norm_out) projects the same conditioning vector silu(temb) into its shifts,
    scales and gates: 115 matrix-vector products that read 6.5 GB of weights (~2 ms on an H200), the
    same on every rank. Here each rank of the sequence group computes the blocks it owns (balanced
    by output width) and ONE all-gather brings every block's modulation to every rank, so a rank
    reads 1/n of those weights. The blocks then receive their modulation as `temb` and their norm
    layers skip the projection (silu -> Identity, linear -> _Precomputed); install() makes that
    change and restore() undoes it. Only for plans whose sequence ranks form one group (one
    sequence axis: Ulysses, ring or all-gather).
    """

    def __init__(self, model: FluxTransformer2DModel, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        # consumers in call order: each double block (image and text stream), each single block, norm_out
        self.norms: list[list[nn.Module]] = (
            [[b.norm1, b.norm1_context] for b in model.transformer_blocks]
            + [[b.norm] for b in single_blocks(model)]
            + [[model.norm_out]]
        )
        self.linears = [[norm.linear for norm in norms] for norms in self.norms]
        widths = [sum(linear.out_features for linear in linears) for linears in self.linears]
        # owner of each consumer: the least loaded rank, widest consumers first (the same on every rank)
        load = [0] * size
        self.owner = [0] * len(widths)
        for index in sorted(range(len(widths)), key=lambda i: (-widths[i], i)):
            self.owner[index] = min(range(size), key=lambda r: (load[r], r))
            load[self.owner[index]] += widths[index]
        self.width = max(load)  # every rank's packed length (the others are zero-padded)
        self.spans: list[tuple[int, int]] = []  # (offset, width) of each consumer in its owner's packed row
        offsets = [0] * size
        for index, width in enumerate(widths):
            self.spans.append((offsets[self.owner[index]], width))
            offsets[self.owner[index]] += width
        self._originals: list[tuple[nn.Module, nn.Module, nn.Module]] = []

    def __call__(self, temb: torch.Tensor) -> list[torch.Tensor]:
        """Each consumer's modulation (B, width), in call order, from the model's temb."""
        condition = F.silu(temb)
        mine = [linear(condition)  # the module: a LoRA term on it (engines.weights.lora) applies
                for index, linears in enumerate(self.linears) if self.owner[index] == self.rank
                for linear in linears]
        missing = self.width - sum(m.shape[1] for m in mine)  # a rank may own less, or (tiny models) nothing
        if missing:
            mine.append(condition.new_zeros(condition.shape[0], missing))
        packed = torch.cat(mine, dim=1)
        gathered = all_gather(packed.unsqueeze(0), 0, self.group, self.size)  # (size, B, width)
        return [gathered[owner, :, offset:offset + width]
                for owner, (offset, width) in zip(self.owner, self.spans, strict=True)]

    def install(self) -> None:
        for norms, linears in zip(self.norms, self.linears, strict=True):
            start = 0
            for norm, linear in zip(norms, linears, strict=True):
                self._originals.append((norm, norm.silu, norm.linear))
                norm.silu = nn.Identity()
                norm.linear = _Precomputed(linear, start, start + linear.out_features)
                start += linear.out_features

    def restore(self) -> None:
        for norm, silu, linear in self._originals:
            norm.silu, norm.linear = silu, linear
        self._originals = []




def single_blocks(model: FluxTransformer2DModel) -> list[nn.Module]:
    """The single-stream blocks, looking through the overlapped blocks that wrap them."""
    return [getattr(b, "block", b) for b in model.single_transformer_blocks]
