"""The parallel plan: how a run splits its ranks between sequence strategies and CFG branches."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engines.options import STRATEGIES, check_choice


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelPlan:
    """Degrees of each parallel axis; their product is the number of ranks.

    Rank layout (outermost first): cfg, ring, ulysses, tp. Tensor parallelism is innermost: its
    all-reduces (one to four per block) carry a whole activation each (every token of the shard,
    every channel), more bytes and more often than anything else, so its group must be neighbouring
    ranks (one NVLink island). Ulysses comes next: its all-to-all is the heaviest context-parallel exchange.
    The tp ranks of one group hold the same tokens and split the weights (engines/parallel/tensor_parallel.py);
    the context-parallel axes split the tokens as without tp, each over ranks with the same tp index.
    """

    strategy: str = "ulysses"
    """"ulysses" (default), "ring", "allgather" or the hybrid "ulysses-ring"."""
    ulysses: int = 1
    """Ranks that trade sequence shards for head shards with an all-to-all (must divide the heads)."""
    ring: int = 1
    """Ranks that share K/V (the K/V axis): passed around a ring ("ring", "ulysses-ring") or
    gathered once ("allgather"); kv_exchange names which."""
    cfg: int = 1
    """Rank groups that each run one slice of the batch (conditional / unconditional branch)."""
    tp: int = 1
    """Ranks that split every block's linear weights and attention heads (tensor parallelism); they hold
    the same tokens, and their partial outputs are summed by an all-reduce."""

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, STRATEGIES)
        for name in ("ulysses", "ring", "cfg", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} degree must be a positive integer, got {value!r}")
        if self.strategy == "ulysses" and self.ring != 1:
            raise ValueError(f"strategy 'ulysses' uses no ring axis, got ring={self.ring}; use 'ulysses-ring'")
        if self.strategy in ("ring", "allgather") and self.ulysses != 1:
            raise ValueError(
                f"strategy {self.strategy!r} uses no ulysses axis, got ulysses={self.ulysses}; use 'ulysses-ring'"
            )
        if self.strategy == "ulysses-ring" and (self.ulysses < 2 or self.ring < 2):
            raise ValueError(
                f"strategy 'ulysses-ring' needs ulysses >= 2 and ring >= 2, got ulysses={self.ulysses}, "
                f"ring={self.ring}; use 'ulysses' or 'ring' for a single axis"
            )

    @property
    def world_size(self) -> int:
        """Number of ranks the plan needs."""
        return self.cfg * self.ring * self.ulysses * self.tp

    @property
    def seq_degree(self) -> int:
        """Number of sequence shards (ranks that split one branch's tokens)."""
        return self.ring * self.ulysses

    @property
    def kv_exchange(self) -> str:
        """How the K/V axis shares K/V: "ring" (blocks passed around, one attention per block, merged
        by log-sum-exp) or "allgather" (one gather, one attention over every key). Every model runs
        exactly this exchange: it is never swapped for the other."""
        return "allgather" if self.strategy == "allgather" else "ring"

    @property
    def has_exchanges(self) -> bool:
        """Whether the plan moves tokens with the exchanges that the transport option (nccl or
        copy-engine) carries: Ulysses all-to-alls, K/V passes and gathers."""
        return self.seq_degree > 1

    @property
    def label(self) -> str:
        """Short name naming every axis and the K/V exchange, e.g. "ulysses-2", "allgather-2",
        "ulysses-2xring-2", "cfg-2xulysses-2", "ulysses-2xtp-2"; "1" for a single rank."""
        parts = [f"cfg-{self.cfg}"] if self.cfg > 1 else []
        if self.ulysses > 1:
            parts.append(f"ulysses-{self.ulysses}")
        if self.ring > 1:
            parts.append(f"{self.kv_exchange}-{self.ring}")
        if self.tp > 1:
            parts.append(f"tp-{self.tp}")
        return "x".join(parts) or "1"

    def describe(self, transport: str) -> str:
        """The plan as the status line and benchmark rows name it, with the transport of its
        exchanges when it has any, e.g. "allgather-2, all-to-all copy-engine"."""
        return self.label + (f", all-to-all {transport}" if self.has_exchanges else "")

    def check(self, *, world_size: int | None = None, num_heads: int | None = None) -> None:
        """Raise ValueError if this plan cannot run on `world_size` ranks or split `num_heads` heads."""
        if world_size is not None and self.world_size != world_size:
            raise ValueError(
                f"plan needs tp*cfg*ring*ulysses = {self.tp}*{self.cfg}*{self.ring}*{self.ulysses} = "
                f"{self.world_size} ranks, but {world_size} are running"
            )
        if num_heads is not None and num_heads % self.tp != 0:
            raise ValueError(f"tp degree {self.tp} does not divide the model's {num_heads} attention heads")
        if num_heads is not None and (num_heads // self.tp) % self.ulysses != 0:
            local = num_heads // self.tp
            where = (f"the model's {num_heads} attention heads" if self.tp == 1 else
                     f"the {local} attention heads of each tp rank (the model's {num_heads} over tp {self.tp}: "
                     f"heads must divide by tp x ulysses)")
            raise ValueError(
                f"ulysses degree {self.ulysses} does not divide {where}; "
                f"use ParallelPlan.auto(...) or strategy 'ulysses-ring' with a ulysses degree dividing {local}"
            )

    @classmethod
    def auto(cls, world_size: int, num_heads: int, strategy: str = "ulysses", cfg: int = 1, tp: int = 1
             ) -> ParallelPlan:
        """Choose degrees for `world_size` ranks: `tp` ranks split the weights, `cfg` branch groups, the
        rest split the sequence (over the num_heads / tp heads of each tp rank).

        "ulysses" falls back to the hybrid when the head count does not divide the sequence degree
        (largest ulysses degree dividing both, the rest on a ring); "ulysses-ring" uses the same
        split; "ring" and "allgather" put every sequence rank on the K/V axis.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if tp < 1 or world_size % tp != 0:
            raise ValueError(f"tp degree {tp} does not divide the {world_size} ranks")
        if num_heads % tp != 0:
            raise ValueError(f"tp degree {tp} does not divide the model's {num_heads} attention heads")
        if cfg < 1 or (world_size // tp) % cfg != 0:
            raise ValueError(f"cfg degree {cfg} does not divide the {world_size // tp} ranks left by tp {tp}")
        check_choice("strategy", strategy, STRATEGIES)
        seq = world_size // (cfg * tp)
        if strategy in ("ring", "allgather"):
            return cls(strategy=strategy, ring=seq, cfg=cfg, tp=tp)
        ulysses = math.gcd(seq, num_heads // tp)
        ring = seq // ulysses
        if ring == 1:
            return cls(strategy="ulysses", ulysses=ulysses, cfg=cfg, tp=tp)
        if ulysses == 1:
            return cls(strategy="ring", ring=ring, cfg=cfg, tp=tp)
        return cls(strategy="ulysses-ring", ulysses=ulysses, ring=ring, cfg=cfg, tp=tp)
