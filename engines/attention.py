"""Context-parallel attention: Ulysses, Ring, AllGather-KV and Ulysses x Ring, on sequence shards.

All communication goes through engines.collectives (functional collectives, traceable by
torch.compile with fullgraph=True), and every shape and split is a Python int fixed by the
ShardLayout, so the graph is static.

Shape legend: B batch, S local tokens, H heads (h = H / ulysses), D head dim; "BSHD" is the
diffusers layout of q/k/v at the attention call, "BHSD" the layout of the SDPA kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines import copy_engine
from engines.collectives import (
    all_to_all,
    finish,
    finish_all_gather,
    start_all_gather,
    start_all_to_all,
    start_ring_shift,
)
from engines.mesh import ParallelMesh
from engines.sharding import ShardLayout

Runs = tuple[tuple[int, int], ...]


def context_parallel_attention(
    q_BSHD: torch.Tensor,
    k_BSHD: torch.Tensor,
    v_BSHD: torch.Tensor,
    *,
    mesh: ParallelMesh,
    layout: ShardLayout,
) -> torch.Tensor:
    """Attention of this rank's query shard over the keys/values of all shards; returns BSHD.

    Ulysses (if ulysses > 1) first trades sequence shards for head shards inside the ulysses
    group; the K/V axis (if ring > 1) then shares K/V by passing them around ("ring") or by one
    all-gather ("allgather", GatherAttention). Padded key positions (see ShardLayout) are left out
    of the softmax.
    """
    plan = mesh.plan
    if plan.ring > 1 and plan.kv_exchange == "allgather":  # a plan with no Ulysses axis (ParallelPlan)
        gather = GatherAttention(mesh=mesh, layout=layout)
        return gather.finish(gather.attend(gather.start(q_BSHD, k_BSHD, v_BSHD)))
    if plan.ulysses > 1:
        q, k, v = _ulysses_scatter_heads(q_BSHD, k_BSHD, v_BSHD, mesh)
    else:
        q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSHD, v_BSHD))

    if plan.ring == 1:
        out = _attention(q, k, v, layout.valid_runs(mesh.ring_shards(mesh.ring_rank)))
    else:
        out = _ring_attention(q, k, v, mesh, layout)

    if plan.ulysses > 1:
        return _ulysses_gather_heads(out, mesh)
    return out.transpose(1, 2)


def ulysses_all_to_all(x: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """Even all_to_all along dim 0 over the Ulysses group, by the mesh's transport."""
    if mesh.all_to_all == "nccl":
        return all_to_all(x, mesh.ulysses_group)
    return finish(start_all_to_all(x, mesh.ulysses_group_name, mesh.plan.ulysses, mesh.all_to_all))


def _ulysses_scatter_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: ParallelMesh
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BSHD sequence shards -> BhSD head shards over degree*S tokens, with ONE all-to-all for q, k, v."""
    return _unpack_heads(ulysses_all_to_all(_pack_heads(q, k, v, mesh.plan.ulysses), mesh))


def _ulysses_gather_heads(out: torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
    """BhSD head shards over degree*S tokens -> BSHD sequence shard with all H heads."""
    return _unpack_tokens(ulysses_all_to_all(_pack_tokens(out, mesh.plan.ulysses), mesh))


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


def _pack_tokens(out: torch.Tensor, degree: int) -> torch.Tensor:
    """BhSD attention output over degree*S tokens -> (degree, B, S, h, D), leading = owner of the
    sequence shard. SDPA kernels write BSHD memory, so with B == 1 this needs no copy."""
    B, h, total, D = out.shape
    return out.transpose(1, 2).reshape(B, degree, total // degree, h, D).permute(1, 0, 2, 3, 4)


def _unpack_tokens(x: torch.Tensor) -> torch.Tensor:
    """(degree, B, S, h, D) after the all-to-all (leading axis = head group) -> BSHD with all heads."""
    degree, B, S, h, D = x.shape
    return x.permute(1, 2, 0, 3, 4).reshape(B, S, degree * h, D)


class UlyssesAttention:
    """Ulysses attention in three calls, so that a caller can compute while each all-to-all travels.

        pending = ulysses.start(q, k, v)        # head-scatter all-to-all issued
        ...independent compute...                # runs during the transfer
        pending = ulysses.attend(pending)        # wait, attention, token-gather all-to-all issued
        ...independent compute...
        out = ulysses.finish(pending)            # wait: BSHD, like context_parallel_attention

    Same result as context_parallel_attention for a Ulysses-only plan (ring == 1). The waits are
    explicit ops (engines.collectives.start_all_to_all), so the overlap survives torch.compile.
    `group_name` is mesh.ulysses_group_name; `transport` mesh.all_to_all.
    """

    def __init__(self, *, degree: int, group_name: str, layout: ShardLayout, transport: str = "nccl") -> None:
        self.degree = degree
        self.group_name = group_name
        self.transport = transport
        self.runs = layout.valid_runs(list(range(degree)))

    def start(self, q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor) -> torch.Tensor:
        packed = _pack_heads(q_BSHD, k_BSHD, v_BSHD, self.degree)
        return start_all_to_all(packed, self.group_name, self.degree, self.transport)

    def attend(self, pending: torch.Tensor) -> torch.Tensor:
        out = _attention(*_unpack_heads(finish(pending)), self.runs)
        return start_all_to_all(_pack_tokens(out, self.degree), self.group_name, self.degree, self.transport)

    def finish(self, pending: torch.Tensor) -> torch.Tensor:
        return _unpack_tokens(finish(pending))


def select_runs(x: torch.Tensor, runs: Runs, dim: int) -> torch.Tensor:
    """Keep the real-token runs of `x` along `dim` (a no-op when there is no padding)."""
    if len(runs) == 1 and runs[0] == (0, x.shape[dim]):
        return x
    return torch.cat([x.narrow(dim, start, length) for start, length in runs], dim=dim)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: Runs) -> torch.Tensor:
    """Plain attention (BHSD) over the real keys. Dropping padded keys instead of masking them
    keeps the unmasked fast kernels (flash) usable whatever the token count."""
    return F.scaled_dot_product_attention(q, select_runs(k, runs, 2), select_runs(v, runs, 2))


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (BHSD) and its float32 log-sum-exp (BHS), for merging partial results.

    Uses the SDPA kernels that return the LSE: cuDNN (CUDA fp16/bf16, head dim <= 128: on H200 it
    ran one FLUX ring-2 rank's attention in 0.27 ms where flash took 0.48; docs/bench/
    2026-11-22-h200x2-flux-ring-attention.json), flash (CPU; other CUDA fp16/bf16), memory-efficient
    (CUDA fp32); a plain float32 implementation elsewhere.
    """
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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: ParallelMesh, layout: ShardLayout
) -> torch.Tensor:
    """Ring attention (BHSD): K/V blocks travel around the ring group; partial results merge by LSE."""
    kv = torch.stack((k, v))  # one message per step
    return ring_steps(q, kv, ring_pass(kv, mesh), mesh, layout)


def ring_steps(
    q: torch.Tensor, kv: torch.Tensor, pending: torch.Tensor | None, mesh: ParallelMesh, layout: ShardLayout,
    *, groups: int = 1, start: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The ring's attention steps, from this rank's own K/V block `kv`, whose pass `pending` is issued.

    Each block's pass to the next member is issued before attending to it (explicit start/finish
    ops, so the order survives torch.compile): the transfer runs during that block's attention.
    `groups`: query heads per K/V head (grouped-query attention: the blocks travel with the K/V
    heads only, and are widened on arrival). `start`: the float32 (output, LSE) of keys outside
    the ring, merged with the blocks' (Cosmos 3's replicated text keys).
    """
    size, rank = mesh.plan.ring, mesh.ring_rank
    out, lse = start if start is not None else (None, None)
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


class RingAttention:
    """Ring attention (a ring-only plan) in UlyssesAttention's three calls:

        pending = ring.start(q, k, v)     # this rank's K/V pass issued
        ...independent compute...          # runs during the transfer
        out = ring.attend(pending)         # local block, wait, next blocks, merged
        out = ring.finish(out)             # BSHD, like context_parallel_attention
    """

    def __init__(self, *, mesh: ParallelMesh, layout: ShardLayout) -> None:
        self.mesh = mesh
        self.layout = layout

    def start(
        self, q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kv = torch.stack((k_BSHD.transpose(1, 2), v_BSHD.transpose(1, 2)))
        return q_BSHD.transpose(1, 2), kv, ring_pass(kv, self.mesh)

    def attend(self, pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return ring_steps(*pending, self.mesh, self.layout)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return out.transpose(1, 2)


class GatherAttention:
    """Attention over all keys of an all-gather plan ("allgather": no Ulysses axis) with ONE K/V
    exchange, in UlyssesAttention's three calls (for a block that has independent compute to hide
    the exchange behind):

        pending = gather.start(q, k, v)   # all-gather of this rank's K/V issued
        ...independent compute...          # runs during the transfer
        out = gather.attend(pending)       # wait, one attention kernel over every key
        out = gather.finish(out)           # BSHD, like context_parallel_attention

    or, when the queries can be computed while the K/V travel (FLUX's double blocks):

        kv = gather.start_kv(k, v)         # all-gather of this rank's K/V issued
        q = ...                            # query projections run during the transfer
        out = gather.finish(gather.attend_query(q, kv))

    and with the keys ahead of the values (FLUX's double blocks; k/v may come in parts):

        keys = gather.start_keys(k)        # copy engines: the keys travel ...
        v = ...                            # ... while the value projections run
        kv = gather.start_values(v, keys)  # then as above

    Same result as ring attention without its split: one kernel over all keys instead of one per
    block plus the log-sum-exp merge. On FLUX's single blocks at 1024² on 2 GPUs the exchange hides
    under the MLP GEMM, and one kernel over 2x the keys is faster than two plus a merge
    (docs/benchmarks.md). It holds every rank's K/V at once, which ring attention does not: the
    memory the choice between the two strategies trades.
    """

    def __init__(self, *, mesh: ParallelMesh, layout: ShardLayout) -> None:
        self.mesh = mesh
        self.runs = gathered_runs(mesh, layout)

    def start(
        self, q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q_BSHD, self.start_kv(k_BSHD, v_BSHD)

    def start_kv(self, k_BSHD: torch.Tensor | list[torch.Tensor], v_BSHD: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """Issue the all-gather of this rank's K/V; pass the result to attend_query(). Either may
        come in consecutive parts along the sequence (a list), as FLUX's text and image streams."""
        keys, values = _parts(k_BSHD), _parts(v_BSHD)
        mesh = self.mesh
        if mesh.all_to_all == "copy-engine":  # lands in the exchange buffer, read there by attend_query
            # each part pushed from where it was made: no stacking or concatenation copy first
            return copy_engine.start_gather_kv(_sbhd(keys), _sbhd(values), mesh.ring_group_name, mesh.plan.ring)
        # (2, S, B, H, D): the sequence right after the k/v axis, so that gathered pieces land in
        # sequence order
        kv = torch.stack((torch.cat(keys, dim=1), torch.cat(values, dim=1))).transpose(1, 2)
        return start_all_gather(kv, mesh.ring_group_name, mesh.plan.ring)

    def start_keys(self, k_BSHD: torch.Tensor) -> torch.Tensor:
        """Issue the all-gather of this rank's keys ahead of its values; pass the result to
        start_values(). On copy engines the keys travel while the values are made; NCCL gathers
        both in one collective, issued by start_values() (the result is then the keys themselves)."""
        mesh = self.mesh
        if mesh.all_to_all == "copy-engine":
            return copy_engine.start_gather_kv(_sbhd([k_BSHD]), [], mesh.ring_group_name, mesh.plan.ring)
        return k_BSHD

    def start_values(self, v_BSHD: torch.Tensor | list[torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
        """Issue the all-gather of this rank's values, after start_keys() (its result is `keys`);
        pass the result to attend_query()."""
        mesh = self.mesh
        if mesh.all_to_all == "copy-engine":
            return copy_engine.start_gather_kv([], _sbhd(_parts(v_BSHD)), mesh.ring_group_name, mesh.plan.ring,
                                               keys_sent=keys)
        return self.start_kv(keys, v_BSHD)

    def attend(self, pending: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.attend_query(*pending)

    def attend_query(self, q_BSHD: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        """Wait for the K/V all-gather, then attention (BHSD) of this rank's queries over every key."""
        mesh = self.mesh
        if mesh.all_to_all == "copy-engine":
            runs = [i for run in self.runs for i in run]
            return gathered_attention(q_BSHD, finish(gathered), mesh.ring_group_name, mesh.plan.ring, runs).transpose(1, 2)
        kv = finish_all_gather(gathered, mesh.plan.ring)  # (2, ring*S, B, H, D)
        return _kv_attention(q_BSHD, kv, self.runs)

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return out.transpose(1, 2)


def _parts(x: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """A tensor, or its consecutive parts along the sequence, as a list of parts."""
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _sbhd(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """BSHD parts seen in the gathered layout's order, SBHD (with batch 1 the transpose moves no data)."""
    return [p.transpose(0, 1) for p in parts]


def _kv_attention(q_BSHD: torch.Tensor, kv: torch.Tensor, runs: Runs) -> torch.Tensor:
    """Attention (BHSD) of q over gathered K/V (2, ring*S, B, H, D), their real-token runs only."""
    k, v = (t.permute(1, 2, 0, 3) for t in kv)  # BHSD views
    return _attention(q_BSHD.transpose(1, 2), k, v, runs)


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
