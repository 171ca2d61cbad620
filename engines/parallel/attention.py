"""Context-parallel attention, the one place where attention gets split: Ulysses, Ring, AllGather-KV and
Ulysses x Ring, on sequence shards.

split_attention(mesh) reads the plan's strategy (the only switch on it in engines/: tests/
test_engines_attention_split.py holds it there) and returns that strategy's SplitAttention, built once
when an adapter is installed; every model family's attention is a call of it:

    attention = split_attention(mesh)                         # once per processor or block
    out = attention(q, k, v, layout=layout)                   # BSHD in, BSHD out

with what some families need beyond q, k, v as arguments of the same call:
- extra_kv: keys/values replicated on every rank, attended by every query besides the sharded ones
  (Cosmos 3's text stream: pipelines/cosmos3/parallel.py); K/V may have fewer heads than q (grouped-query);
- while_waiting: the caller's own work, run while the exchanges travel (FLUX.1's single-stream block
  runs its MLP there: pipelines/flux/blocks.py);
- q and v given as functions that make them, so that a strategy with an exchange to hide them under
  projects them there (the all-gather: FLUX's double-stream blocks, pipelines/flux/attention.py).

All communication goes through engines.parallel.collectives (functional collectives, traceable by
torch.compile with fullgraph=True), and every shape and split is a Python int fixed by the
ShardLayout, so the graph is static. The strategy is chosen when the object is built, not per call:
a call runs its strategy's exchanges, copies and kernels (each class says which) and nothing more; its
few Python checks (is q a tensor or a function?) vanish under torch.compile.

Shape legend: B batch, S local tokens, H heads (h = H / ulysses), D head dim; "BSHD" is the
diffusers layout of q/k/v at the attention call, "BHSD" the layout of the SDPA kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engines.levers.quantized_attention import precision_in_effect, quantized_attention_with_lse
from engines.parallel import copy_engine
from engines.parallel.collectives import (
    finish,
    finish_all_gather,
    start_all_gather,
    start_all_to_all,
    start_ring_shift,
)
from engines.parallel.mesh import ParallelMesh
from engines.parallel.sharding import ShardLayout

Runs = tuple[tuple[int, int], ...]
Made = torch.Tensor | Callable[[torch.Tensor | None], torch.Tensor | list[torch.Tensor]]
"""q or v, or a function that makes it (BSHD; v may come in consecutive parts along the sequence, a
list) given `after`: the pending exchange that its projections are to follow (collectives.linear_after),
or None when nothing travels yet."""
ExtraKV = tuple[torch.Tensor, torch.Tensor] | None
"""Replicated keys and values (BSHD, with the K/V heads), placed before the sharded keys."""


def split_attention(mesh: ParallelMesh) -> SplitAttention:
    """The attention of the mesh's plan, by its strategy: the one switch on the strategy."""
    plan = mesh.plan
    if plan.seq_degree == 1:
        raise ValueError("the plan splits no sequence: the model's own attention serves it")
    if plan.kv_exchange == "allgather":  # a plan with no Ulysses axis (ParallelPlan)
        return GatherAttention(mesh)
    if plan.ring == 1:
        return UlyssesAttention(mesh)
    if plan.ulysses == 1:
        return RingAttention(mesh)
    return HybridAttention(mesh)


class SplitAttention:
    """Attention of this rank's query shard over the keys/values of every shard, as one strategy splits
    it (the subclasses below); padded key positions (see ShardLayout) are left out of the softmax."""

    def __init__(self, mesh: ParallelMesh) -> None:
        self.mesh = mesh

    def __call__(
        self,
        q: Made,
        k: torch.Tensor,
        v: Made,
        *,
        layout: ShardLayout,
        extra_kv: ExtraKV = None,
        while_waiting: Sequence[Callable[..., Any]] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The attention (BSHD) of q over every shard's k/v and `extra_kv`.

        Args:
            q, v: tensors, or functions that make them (Made): called at once, or, by a strategy that
                can, while its exchange of the keys travels.
            while_waiting: functions run in turn while the exchanges travel, each given the previous
                one's result (the first nothing): the first once the first exchange is issued, each
                next one once the next is, the rest at the strategy's last exchange. With them the call
                returns (attention, the last one's result).
        """
        work = _Work(while_waiting)
        out = self._attend(q, k, v, layout, extra_kv, work)
        work.rest()
        return (out, work.result) if while_waiting else out

    def _attend(self, q: Made, k: torch.Tensor, v: Made, layout: ShardLayout, extra: ExtraKV,
                work: _Work) -> torch.Tensor:
        raise NotImplementedError


class _Work:
    """A call's while_waiting functions, run in turn: each given the previous one's result."""

    def __init__(self, functions: Sequence[Callable[..., Any]]) -> None:
        self.functions, self.done, self.result = tuple(functions), 0, None

    def next(self) -> None:
        """Run the next function, if any (at a strategy's waiting point that is not its last)."""
        if self.done < len(self.functions):
            function = self.functions[self.done]
            self.result = function() if self.done == 0 else function(self.result)
            self.done += 1

    def rest(self) -> None:
        """Run every function left (at a strategy's last waiting point)."""
        while self.done < len(self.functions):
            self.next()


def _made(x: Made, after: torch.Tensor | None = None) -> torch.Tensor | list[torch.Tensor]:
    return x if isinstance(x, torch.Tensor) else x(after)


def _whole(x: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """A BSHD tensor, or its consecutive parts along the sequence joined."""
    return x if isinstance(x, torch.Tensor) else torch.cat(x, dim=1)


def _parts(x: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """A tensor, or its consecutive parts along the sequence, as a list of parts."""
    return [x] if isinstance(x, torch.Tensor) else list(x)


class UlyssesAttention(SplitAttention):
    """Ulysses: ONE all-to-all trades this rank's sequence shard of q, k and v for a head shard of every
    token, attention runs there, a second all-to-all trades the output back.

    Cost: the two all-to-alls (the q/k/v message, then the output); a copy to pack q/k/v into that
    message, one to lay them out for the kernels (none for grouped K/V heads with B == 1), one to
    unpack the output (its pack needs none when B == 1). Grouped K/V heads (fewer than q's) travel as
    K/V heads, each repeated kv_repeat() times (a copy) where the degree does not divide them;
    replicated extra K/V are narrowed to this rank's heads (a view) and concatenated ahead of the keys
    (one copy). while_waiting: the first function runs while the first all-to-all travels (before the
    attention), the rest while the second does.
    """

    def _attend(self, q: Made, k: torch.Tensor, v: Made, layout: ShardLayout, extra: ExtraKV,
                work: _Work) -> torch.Tensor:
        q, k, v, extra = self._scatter_heads(_made(q), k, _whole(_made(v)), extra, work)
        out = self._head_attention(q, k, v, layout, extra, work)
        pending = self._start(_pack_tokens(out, self.mesh.plan.ulysses))
        work.rest()
        return _unpack_tokens(finish(pending))

    def _start(self, x: torch.Tensor) -> torch.Tensor:
        mesh = self.mesh
        return start_all_to_all(x, mesh.ulysses_group_name, mesh.plan.ulysses, mesh.all_to_all)

    def _scatter_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: ExtraKV, work: _Work
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ExtraKV]:
        """BSHD sequence shards -> BhSD head shards over degree*S tokens, with ONE all-to-all for q, k,
        v (work.next() runs while it travels); `extra` narrowed to this rank's K/V heads (BSHD)."""
        degree = self.mesh.plan.ulysses
        if k.shape[2] == q.shape[2]:
            pending = self._start(_pack_heads(q, k, v, degree))
            work.next()
            q, k, v = _unpack_heads(finish(pending))
        else:
            repeat = kv_repeat(k.shape[2], degree)
            if repeat > 1:
                k, v = (t.repeat_interleave(repeat, dim=2) for t in (k, v))
                extra = None if extra is None else tuple(t.repeat_interleave(repeat, dim=2) for t in extra)
            heads = (q.shape[2] // degree, k.shape[2] // degree)
            pending = self._start(_pack_grouped_heads(q, k, v, degree))
            work.next()
            q, k, v = _unpack_grouped_heads(finish(pending), *heads)
        if extra is not None:
            local = k.shape[1]
            extra = tuple(t.narrow(2, self.mesh.ulysses_rank * local, local) for t in extra)
        return q, k, v, extra

    def _head_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ShardLayout,
                        extra: ExtraKV, work: _Work) -> torch.Tensor:
        """Attention (BHSD) of this rank's head shard, every key of it here."""
        mesh = self.mesh
        return _attention(q, k, v, layout.valid_runs(mesh.ring_shards(mesh.ring_rank)), extra)


class HybridAttention(UlyssesAttention):
    """Ulysses x Ring: Ulysses' all-to-alls inside each ring member's Ulysses group, ring attention of
    the head shards over the K/V axis between them. Cost: Ulysses' plus RingAttention's; while_waiting:
    the first function under the first all-to-all, the second under the first K/V pass, the rest under
    the second all-to-all."""

    def _head_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: ShardLayout,
                        extra: ExtraKV, work: _Work) -> torch.Tensor:
        return _ring_attention(q, k, v, self.mesh, layout, extra, work.next)


class RingAttention(SplitAttention):
    """Ring: this rank's K/V block travels around the K/V axis, one attention per block, the partial
    results merged by log-sum-exp (_ring_attention), each pass issued before the attention it hides under.

    Cost: ring - 1 passes of one (k, v) message; a copy to stack k and v, one float32 merge per block.
    Grouped K/V travel as K/V heads and are widened on arrival; replicated extra K/V are one more block,
    attended locally (no exchange). while_waiting: every function runs under the first pass, before the
    attention (nothing travels after it).
    """

    def _attend(self, q: Made, k: torch.Tensor, v: Made, layout: ShardLayout, extra: ExtraKV,
                work: _Work) -> torch.Tensor:
        q, v = _made(q), _whole(_made(v))
        out = _ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.mesh, layout, extra,
                              work.rest)
        return out.transpose(1, 2)


class GatherAttention(SplitAttention):
    """All-gather ("allgather": no Ulysses axis): ONE all-gather of every rank's K/V, then one attention
    kernel over every key.

    Same result as ring attention without its split: one kernel over all keys instead of one per
    block plus the log-sum-exp merge. On FLUX's single blocks at 1024² on 2 GPUs the exchange hides
    under the MLP GEMM, and one kernel over 2x the keys is faster than two plus a merge
    (docs/benchmarks.md). It holds every rank's K/V at once, which ring attention does not: the
    memory the choice between the two strategies trades.

    Cost: the one all-gather; with NCCL a copy to stack k and v (v made in parts, as FLUX's text and
    image streams, are joined by that copy) and one to lay the gathered K/V out in sequence order; on
    copy engines (mesh.all_to_all) each part is pushed from where it was made and the attention reads
    the K/V where they landed (gathered_attention): no copy. Replicated extra K/V are concatenated
    ahead of the gathered keys (one copy) and take the NCCL gather. When v is made by the call, the
    keys go first: on copy engines they travel while v is made, and q is made while v travels
    (FLUX's double blocks); NCCL gathers both at once, q made under it. while_waiting: every function
    runs under the gather, before the attention.
    """

    def _attend(self, q: Made, k: torch.Tensor, v: Made, layout: ShardLayout, extra: ExtraKV,
                work: _Work) -> torch.Tensor:
        mesh = self.mesh
        on_copy_engine = mesh.all_to_all == "copy-engine" and extra is None
        if isinstance(v, torch.Tensor):
            pending = self._start_kv(k, v, on_copy_engine)
        elif on_copy_engine:  # the keys travel while the values are made
            keys = copy_engine.start_gather_kv(_sbhd([k]), [], mesh.ring_group_name, mesh.plan.ring)
            values = _parts(v(keys))
            pending = copy_engine.start_gather_kv([], _sbhd(values), mesh.ring_group_name, mesh.plan.ring,
                                                  keys_sent=keys)
        else:  # NCCL gathers keys and values in one collective: the values are made first
            pending = self._start_kv(k, v(k), on_copy_engine)
        q = _made(q, pending)
        work.rest()
        runs = gathered_runs(mesh, layout)
        if on_copy_engine:
            flat = [i for run in runs for i in run]
            return gathered_attention(q, finish(pending), mesh.ring_group_name, mesh.plan.ring, flat)
        kv = finish_all_gather(pending, mesh.plan.ring)  # (2, ring*S, B, H, D)
        return _kv_attention(q, kv, runs, extra).transpose(1, 2)

    def _start_kv(self, k: torch.Tensor, v: torch.Tensor | list[torch.Tensor], on_copy_engine: bool) -> torch.Tensor:
        """Issue the all-gather of this rank's K/V (v may come in parts); finish it in _attend."""
        mesh = self.mesh
        if on_copy_engine:  # lands in the exchange buffer, read there by gathered_attention
            return copy_engine.start_gather_kv(_sbhd([k]), _sbhd(_parts(v)), mesh.ring_group_name, mesh.plan.ring)
        # (2, S, B, H, D): the sequence right after the k/v axis, so that gathered pieces land in
        # sequence order
        kv = torch.stack((k, _whole(v))).transpose(1, 2)
        return start_all_gather(kv, mesh.ring_group_name, mesh.plan.ring)


def kv_repeat(kv_heads: int, ulysses: int) -> int:
    """How many times each K/V head is repeated so that `ulysses` ranks hold whole K/V heads:
    lcm(kv_heads, ulysses) / kv_heads (1 when the degree divides the K/V heads)."""
    return math.lcm(kv_heads, ulysses) // kv_heads


def _pack_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, degree: int) -> torch.Tensor:
    """BSHD q, k, v -> (degree, 3, B, S, h, D): leading axis = destination rank (head group), q, k
    and v packed so that each peer gets one message."""
    B, S, H, D = q.shape
    h = H // degree
    return torch.stack([t.reshape(B, S, degree, h, D).permute(2, 0, 1, 3, 4) for t in (q, k, v)], dim=1)


def _unpack_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(degree, 3, B, S, h, D) after the all-to-all (leading axis = source rank = sequence shard) ->
    q, k, v as BhSD over degree*S tokens."""
    degree, _, B, S, h, D = x.shape
    # One copy to BSHD memory (the layout flash kernels use natively), seen as BhSD through a
    # transpose: the kernels need only a unit last stride.
    x = x.permute(1, 2, 0, 3, 4, 5).reshape(3, B, degree * S, h, D).transpose(2, 3)
    return x[0], x[1], x[2]


def _pack_grouped_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, degree: int) -> torch.Tensor:
    """BSHD q (H heads) and k, v (kv heads) -> (degree, B, S, h + 2 kv/degree, D): leading axis =
    destination rank (head group), q, k and v side by side along the heads, one message per peer."""
    return torch.cat([t.unflatten(2, (degree, -1)).permute(2, 0, 1, 3, 4) for t in (q, k, v)], dim=3)


def _unpack_grouped_heads(x: torch.Tensor, h: int, kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(degree, B, S, h + 2 kv, D) after the all-to-all -> q (h heads), k, v (kv heads) as BhSD over
    degree*S tokens: views when B == 1 (the tokens stay in BSHD memory)."""
    x = x.transpose(0, 1).flatten(1, 2)  # (B, degree*S, h + 2 kv, D)
    q, k, v = x.split([h, kv, kv], dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _pack_tokens(out: torch.Tensor, degree: int) -> torch.Tensor:
    """BhSD attention output over degree*S tokens -> (degree, B, S, h, D), leading = owner of the
    sequence shard. SDPA kernels write BSHD memory, so with B == 1 this needs no copy."""
    B, h, total, D = out.shape
    return out.transpose(1, 2).reshape(B, degree, total // degree, h, D).permute(1, 0, 2, 3, 4)


def _unpack_tokens(x: torch.Tensor) -> torch.Tensor:
    """(degree, B, S, h, D) after the all-to-all (leading axis = head group) -> BSHD with all heads."""
    degree, B, S, h, D = x.shape
    return x.permute(1, 2, 0, 3, 4).reshape(B, S, degree * h, D)


def select_runs(x: torch.Tensor, runs: Runs, dim: int) -> torch.Tensor:
    """Keep the real-token runs of `x` along `dim` (a no-op when there is no padding)."""
    if len(runs) == 1 and runs[0] == (0, x.shape[dim]):
        return x
    return torch.cat([x.narrow(dim, start, length) for start, length in runs], dim=dim)


def _real_keys(x: torch.Tensor, runs: Runs, extra: torch.Tensor | None) -> torch.Tensor:
    """Keys or values (BHSD) at their real-token runs, after the replicated `extra` ones (BSHD) if any:
    then ONE copy, into BSHD memory."""
    if extra is None:
        return select_runs(x, runs, 2)
    tokens = x.transpose(1, 2)
    return torch.cat([extra, *(tokens.narrow(1, start, length) for start, length in runs)], dim=1).transpose(1, 2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: Runs, extra: ExtraKV = None) -> torch.Tensor:
    """Plain attention (BHSD) over the real keys (and `extra`, ahead of them). Dropping padded keys
    instead of masking them keeps the unmasked fast kernels (flash) usable whatever the token count.
    K/V may have fewer heads than q (grouped-query attention)."""
    k = _real_keys(k, runs, None if extra is None else extra[0])
    v = _real_keys(v, runs, None if extra is None else extra[1])
    precision = precision_in_effect()
    if precision != "full":
        return quantized_attention_with_lse(q, k, v, precision)[0]
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (BHSD) and its float32 log-sum-exp (BHS), for merging partial results.

    Uses the SDPA kernels that return the LSE: cuDNN (CUDA fp16/bf16, head dim <= 128: on H200 it
    ran one FLUX ring-2 rank's attention in 0.27 ms where flash took 0.48; docs/bench/
    2026-11-22-h200x2-flux-ring-attention.json), flash (CPU; other CUDA fp16/bf16), memory-efficient
    (CUDA fp32); a plain float32 implementation elsewhere. With a quantized attention precision in effect
    (engines.levers.quantized_attention.attention_precision), that module's.
    """
    precision = precision_in_effect()
    if precision != "full":
        return quantized_attention_with_lse(q, k, v, precision)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[:2]
        return out, lse.float()
    if q.device.type == "cuda":
        half = q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
        if half and q.shape[-1] <= 128:
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
            return out, lse.reshape(q.shape[:3])  # some versions give (B, H, S, 1)
        if half and q.shape[-1] <= 256:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
            return out, lse
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
        return out, lse[..., : q.shape[2]]  # its LSE may be padded along the query axis
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()).to(q.dtype)
    return out, lse


def merge_attention(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of a block's attention into the running float32 result."""
    block_out = block_out.float()
    if out is None or lse is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse


def ring_pass(kv: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """Issue the pass of the K/V block `kv` to the next ring member (finish() it before use)."""
    return start_ring_shift(kv, mesh.ring_group_name, mesh.ring_rank, mesh.plan.ring, mesh.all_to_all)


def _ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: ParallelMesh, layout: ShardLayout, extra: ExtraKV,
    waiting: Callable[[], None],
) -> torch.Tensor:
    """Ring attention (BHSD): K/V blocks travel around the ring group; partial results merge by LSE.
    `waiting` runs once the first pass is issued; the replicated `extra` K/V (BSHD) are attended then.

    Each block's pass to the next member is issued before attending to it (explicit start/finish
    ops, so the order survives torch.compile): the transfer runs during that block's attention.
    `groups`: query heads per K/V head (grouped-query attention: the blocks travel with the K/V
    heads only, and are widened on arrival). The float32 (output, LSE) of the keys outside the ring
    (Cosmos 3's replicated text keys) is merged with the blocks'.
    """
    size, rank = mesh.plan.ring, mesh.ring_rank
    groups = q.shape[1] // k.shape[1]
    kv = torch.stack((k, v))  # one message per step
    pending = ring_pass(kv, mesh)
    waiting()
    out = lse = None
    if extra is not None and extra[0].shape[1]:
        keys, values = (t.transpose(1, 2) for t in extra)
        if groups > 1:
            keys, values = (t.repeat_interleave(groups, dim=1) for t in (keys, values))
        out, lse = merge_attention(None, None, *attention_with_lse(q, keys, values))
    for step in range(size):
        runs = layout.valid_runs(mesh.ring_shards((rank - step) % size))
        if runs:  # a block made only of padding adds nothing (and would give an empty softmax)
            k, v = (select_runs(t, runs, 2).repeat_interleave(groups, dim=1) if groups > 1 else select_runs(t, runs, 2)
                    for t in (kv[0], kv[1]))
            block_out, block_lse = attention_with_lse(q, k, v)
            out, lse = merge_attention(out, lse, block_out, block_lse)
        if pending is not None:
            kv = finish(pending)
            pending = ring_pass(kv, mesh) if step + 2 < size else None
    if out is None:
        raise ValueError("attention over an empty sequence")
    return out.to(q.dtype)


def _sbhd(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """BSHD parts seen in the gathered layout's order, SBHD (with batch 1 the transpose moves no data)."""
    return [p.transpose(0, 1) for p in parts]


def _kv_attention(q_BSHD: torch.Tensor, kv: torch.Tensor, runs: Runs, extra: ExtraKV = None) -> torch.Tensor:
    """Attention (BHSD) of q over gathered K/V (2, ring*S, B, H, D), their real-token runs only, after
    the replicated `extra` K/V (BSHD) if any."""
    k, v = (t.permute(1, 2, 0, 3) for t in kv)  # BHSD views
    return _attention(q_BSHD.transpose(1, 2), k, v, runs, extra)


@torch.library.custom_op("ulysses_studio::gathered_attention", mutates_args=())
def gathered_attention(q_BSHD: torch.Tensor, token: torch.Tensor, group_name: str, size: int,
                       runs: list[int]) -> torch.Tensor:
    """Attention (BSHD, contiguous) of q over the K/V that the group's copy-engine all-gather
    (`token`, waited for) landed in its exchange buffer: they are read there, not copied out.
    `runs` are the real-token runs of the gathered sequence, flattened (start, length, ...).

    An op of its own because the buffer outlives the call: returned to the compiled graph as a
    tensor, the compiler could reuse its memory for a later result, where the peers write.
    """
    B, S, H, D = q_BSHD.shape
    kv = copy_engine.gathered_kv(group_name, (2, size * S, B, H, D), q_BSHD.dtype, q_BSHD.device)
    out = _kv_attention(q_BSHD, kv, tuple(zip(runs[::2], runs[1::2], strict=True)))
    return out.transpose(1, 2).contiguous()  # SDPA kernels write BSHD memory: no copy


@gathered_attention.register_fake
def _gathered_attention_fake(q_BSHD: torch.Tensor, token: torch.Tensor, group_name: str, size: int,
                             runs: list[int]) -> torch.Tensor:
    return torch.empty_like(q_BSHD, memory_format=torch.contiguous_format)


def gathered_runs(mesh: ParallelMesh, layout: ShardLayout) -> Runs:
    """The real-token runs of K/V gathered from every ring member, in member order."""
    return layout.valid_runs([s for member in range(mesh.plan.ring) for s in mesh.ring_shards(member)])
