"""The device mesh of a plan: one process group per parallel axis, and this rank's place on each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engines.parallel.copy_engine import CopyEngineTransport, check_transport
from engines.parallel.distributed import ParallelContext
from engines.parallel.plan import ParallelPlan

AXES = ("cfg", "ring", "ulysses", "tp")
"""Mesh axes, outermost first (ParallelPlan says why tp is innermost)."""


class SequenceAxis(NamedTuple):
    """One mesh axis that splits the sequence: its group, this rank's index on it, its size."""

    group: dist.ProcessGroup | None
    rank: int
    size: int


@dataclass(kw_only=True, frozen=True)
class ParallelMesh:
    """Process groups and coordinates of this rank for a ParallelPlan.

    The global rank is ((cfg_rank * ring + ring_rank) * ulysses + ulysses_rank) * tp + tp_rank, and
    the sequence shard held by a rank is seq_rank = ring_rank * ulysses + ulysses_rank (the same for
    every rank of a tp group).
    """

    plan: ParallelPlan
    device_mesh: DeviceMesh | None
    """None in a single process (every group below is then None and every rank index 0)."""
    ulysses_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None
    cfg_group: dist.ProcessGroup | None
    ulysses_rank: int
    ring_rank: int
    cfg_rank: int
    tp_group: dist.ProcessGroup | None = None
    """Ranks that split the weights (None without tensor parallelism)."""
    tp_rank: int = 0
    tp_group_name: str = ""
    """tp_group.group_name, read here once (the row-parallel all-reduce is traced with it)."""
    all_to_all: str = "nccl"
    """How the context-parallel exchanges (Ulysses all-to-alls, ring K/V passes) travel: "nccl"
    (the group's collectives) or "copy-engine" (engines/parallel/copy_engine.py)."""
    ulysses_group_name: str = ""
    """ulysses_group.group_name, read here once (traced code takes a plain string)."""
    ring_group_name: str = ""
    """ring_group.group_name, likewise."""
    copy_engine: CopyEngineTransport | None = None
    """The copy-engine exchanges' buffers and streams of this mesh's groups, when all_to_all is
    "copy-engine" and there is more than one process; freed by close()."""

    @property
    def seq_rank(self) -> int:
        """Index of the sequence shard this rank holds."""
        return self.ring_rank * self.plan.ulysses + self.ulysses_rank

    def sequence_axes(self) -> list[SequenceAxis]:
        """The axes that split the sequence (more than one rank), Ulysses first: gathering over them in
        this order yields the shards in seq_rank order. How attention splits over them is
        engines.parallel.attention's business (split_attention)."""
        axes = [SequenceAxis(self.ulysses_group, self.ulysses_rank, self.plan.ulysses),
                SequenceAxis(self.ring_group, self.ring_rank, self.plan.ring)]
        return [axis for axis in axes if axis.size > 1]

    def ring_shards(self, ring_rank: int) -> list[int]:
        """Sequence shards held, after the Ulysses all-to-all, by the ring member `ring_rank`."""
        u = self.plan.ulysses
        return list(range(ring_rank * u, (ring_rank + 1) * u))

    def close(self) -> None:
        """Free this mesh's copy-engine exchange buffers, retired ones included, and unregister its
        groups (idempotent; nothing to do for the "nccl" transport). Collective where it frees a
        buffer (a device synchronize and a barrier over the group first): every rank closes its
        meshes in the same order, before the process group is destroyed.

        Drop every CUDA graph captured on those buffers first: engines.levers.compile.Engine.release(),
        before ParallelTransformer.restore(), which calls this. A graph replayed on a freed buffer
        would wait on flags, and write, in memory that is no longer its own.
        """
        if self.copy_engine is not None:
            self.copy_engine.close()


def build_mesh(ctx: ParallelContext, plan: ParallelPlan, all_to_all: str = "nccl") -> ParallelMesh:
    """Create the process groups of `plan` (collective: every rank must call it, in the same order).

    `all_to_all`: the transport of the Ulysses all-to-alls and ring K/V passes, "nccl" or
    "copy-engine" (checked here, before any collective).
    """
    plan.check(world_size=ctx.world_size)
    check_transport(all_to_all, ctx.group, ctx.device)
    if ctx.world_size == 1:
        return ParallelMesh(
            plan=plan, device_mesh=None, ulysses_group=None, ring_group=None, cfg_group=None,
            ulysses_rank=0, ring_rank=0, cfg_rank=0,
        )
    if ctx.replicas == 1:
        mesh = init_device_mesh(ctx.device.type, (plan.cfg, plan.ring, plan.ulysses, plan.tp), mesh_dim_names=AXES)
    else:  # every group's axes in one mesh of the whole run (every rank builds it): each rank's groups are its group's
        mesh = init_device_mesh(ctx.device.type, (ctx.replicas, plan.cfg, plan.ring, plan.ulysses, plan.tp),
                                mesh_dim_names=("replica", *AXES))
    ulysses, ring, tp = mesh.get_group("ulysses"), mesh.get_group("ring"), mesh.get_group("tp")
    return ParallelMesh(
        plan=plan,
        device_mesh=mesh,
        ulysses_group=ulysses,
        ring_group=ring,
        cfg_group=mesh.get_group("cfg"),
        ulysses_rank=mesh.get_local_rank("ulysses"),
        ring_rank=mesh.get_local_rank("ring"),
        cfg_rank=mesh.get_local_rank("cfg"),
        tp_group=tp,
        tp_rank=mesh.get_local_rank("tp"),
        tp_group_name=tp.group_name,
        all_to_all=all_to_all,
        ulysses_group_name=ulysses.group_name,
        ring_group_name=ring.group_name,
        # the copy-engine ops find their buffers by group name: registered here, until close()
        copy_engine=CopyEngineTransport([ulysses, ring]) if all_to_all == "copy-engine" else None,
    )
