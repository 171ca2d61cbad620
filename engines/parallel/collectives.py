"""Collective primitives of the parallel layer, all built on functional collectives.

torch.distributed._functional_collectives ops are traced by torch.compile into the graph (with
fullgraph=True), unlike the in-place torch.distributed calls. In eager mode they return an
AsyncCollectiveTensor; all_to_all and all_gather unwrap it at once (their callers need the data
next, and a plain tensor avoids a subclass dispatch on every later op).

Under torch.compile, though, funcol places each wait right after its collective (the traced code
cannot see where an AsyncCollectiveTensor is first used), so a compiled graph overlaps nothing.
start_all_to_all / start_ring_shift / start_all_gather and finish (finish_all_gather) call the
collective and its wait as two ops where the caller puts them, so compute written between them
overlaps the transfer in eager and compiled code alike. Compute that the compiler could still move
ahead of a collective's start (by fusing its elementwise tail with the tail of the collective's
input) is pinned after it with linear_after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from engines.parallel import copy_engine

# torch 2.13 renamed all_gather_tensor to all_gather_single (same arguments) and deprecated the
# old name; the GPU image runs 2.11, so take whichever this torch has.
_all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def wait(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a pending collective result (a no-op for other tensors)."""
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Even all-to-all along dim 0: slice i goes to peer i; slice i of the result came from peer i."""
    return wait(funcol.all_to_all_single(x.contiguous(), None, None, group))


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Concatenate every peer's `x` along `dim`, in group-rank order (`size` = group size).

    The collective always gathers along dim 0 and the chunk/cat to `dim` happens here: funcol's own
    non-zero gather_dim path calls torch._utils._maybe_view_chunk_cat, which dynamo on torch 2.11
    refuses to trace (torch.compile fullgraph then fails). Passing `size` as a Python int keeps the
    split static in the graph.
    """
    out = wait(_all_gather_single(x.contiguous(), 0, group))  # (size * x.shape[0], ...)
    if dim == 0 or size == 1:
        return out
    return torch.cat(out.chunk(size, dim=0), dim=dim)


def all_reduce(x: torch.Tensor, group_name: str, op: str = "sum") -> torch.Tensor:
    """Sum (or `op`: "max", ...) of every peer's `x` (tensor parallelism's row-parallel layers), waited for
    at once: the next op (the bias, the residual) needs it. `group_name` is the group's name, read outside
    traced code."""
    return finish(torch.ops._c10d_functional.all_reduce(x.contiguous(), op, group_name))


def start_all_to_all(x: torch.Tensor, group_name: str, size: int, transport: str = "nccl") -> torch.Tensor:
    """all_to_all (as above) issued without waiting: pass the result to finish() before using it.

    `group_name` is the process group's `group_name` and `size` its size, both read outside any
    traced code. Until finish() the result's memory is not written yet; work issued in between runs
    while the transfer does (NCCL runs collectives on its own stream). `transport` "copy-engine"
    moves the data with the GPUs' copy engines instead (engines/parallel/copy_engine.py).
    """
    if transport == "copy-engine":
        return copy_engine.start(x, group_name)
    splits = [x.shape[0] // size] * size
    return torch.ops._c10d_functional.all_to_all_single(x.contiguous(), splits, splits, group_name)


def start_ring_shift(x: torch.Tensor, group_name: str, rank: int, size: int, transport: str = "nccl") -> torch.Tensor:
    """Send `x` to group rank+1 and receive the same shape from rank-1, without waiting: pass the
    result to finish() before using it. `rank`/`size` are this rank's place in the group and its
    size (Python ints, read outside traced code).

    With NCCL: an all-to-all whose only non-empty splits are those two peers, which NCCL turns into
    one send and one receive (funcol.permute_tensor would too, but it sizes splits in elements,
    which only fits 1-D tensors). "copy-engine": engines/parallel/copy_engine.py.
    """
    if transport == "copy-engine":
        return copy_engine.start_shift(x, group_name)
    send, receive = copy_engine.ring_splits(rank, size, x.shape[0])
    return torch.ops._c10d_functional.all_to_all_single(x.contiguous(), receive, send, group_name)


def start_all_gather(x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """Gather every peer's `x` (n, S, ...) over NCCL without waiting: pass the result to
    finish_all_gather(). (The copy-engine K/V all-gather is copy_engine.start_gather_kv: its result
    stays in the exchange buffer, read by the attention there.)"""
    return torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), size, group_name)


def finish_all_gather(pending: torch.Tensor, size: int) -> torch.Tensor:
    """Wait for start_all_gather's result: (n, size * S, ...), the peers' pieces in group-rank order
    along dim 1 (NCCL lands (size * n, S, ...): one copy)."""
    out = finish(pending)
    return out.unflatten(0, (size, out.shape[0] // size)).transpose(0, 1).flatten(1, 2)


def finish(x: torch.Tensor) -> torch.Tensor:
    """Wait for a collective issued by start_all_to_all (either transport); returns its result, ready to use."""
    return torch.ops._c10d_functional.wait_tensor(x)


@torch.library.custom_op("ulysses_studio::linear_after", mutates_args=())
def linear_after(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, token: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias), ordered after the op that produced `token` (its data is not read).

    Passing a pending collective's result as `token` keeps this projection after the collective's
    start under torch.compile. Without it inductor may run it before the start: in FLUX's
    double-stream blocks it fused the rotary embedding of the queries with that of the keys (they
    read the same cos/sin), which pulled the query projections ahead of the K/V all-gather they
    were written to hide (tests/test_engines_ring_overlap.py).
    """
    return F.linear(x, weight, bias)


@linear_after.register_fake
def _linear_after_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       token: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
