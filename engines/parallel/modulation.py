"""AdaLN modulations computed once per forward and shared out over the sequence ranks (a feature of the generic
path, engines.parallel.generic: a family's record names its norms and where the conditioning comes from).

In a transformer with adaptive norms every block (and the final norm) projects the same conditioning vector,
silu(temb), into its shifts, scales and gates: FLUX.1-dev's 115 matrix-vector products read 6.5 GB of weights
(~2 ms on an H200), the same on every rank. Here each rank of the sequence group computes the projections it
owns (balanced by output width) and ONE all-gather brings every consumer's modulation to every rank, so a rank
reads 1/n of those weights. Each consumer (a block, the final norm) then receives its own modulation where it
received the conditioning, and its norms skip the projection (silu -> Identity, linear -> _Precomputed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engines.parallel.collectives import all_gather


class _Precomputed(nn.Module):
    """Stands in for an AdaLN modulation projection whose output SharedModulation computed ahead:
    returns columns [start, stop) of what the consumer now receives as its conditioning (the projection's
    output, or, for a consumer with several norms, the outputs of all their projections side by side).
    The projection stays a child, so that .to() and state_dict still reach its weights."""

    def __init__(self, source: nn.Linear, start: int, stop: int) -> None:
        super().__init__()
        self.source = source
        self.start, self.stop = start, stop

    def forward(self, modulation: torch.Tensor) -> torch.Tensor:
        return modulation[:, self.start:self.stop]


class SharedModulation:
    """The modulations of `norms` (per consumer, in call order: each consumer's adaptive norms), computed from
    the conditioning once per forward over the sequence group (`group`, this `rank` of `size`). `source` is the
    plan path of the module whose output is the conditioning; `consumers` say where it then goes, in call order
    (the generic path hooks both: engines.parallel.generic)."""

    def __init__(self, norms: list[list[nn.Module]], group: dist.ProcessGroup, rank: int, size: int, *,
                 source: str, consumers: Sequence[tuple[str, str]]) -> None:
        self.group, self.rank, self.size = group, rank, size
        self.source, self.consumers = source, tuple(consumers)
        self.norms = norms
        self.linears = [[norm.linear for norm in consumer] for consumer in norms]
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
        """Each consumer's modulation (B, width), in call order, from the conditioning `temb`."""
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
        """The norms skip their projections: each takes its columns of the modulation it is handed."""
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
