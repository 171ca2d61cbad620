"""GPU micro-benchmark: one FLUX attention on 2 ranks, Ulysses split against ring split.

    torchrun --nproc-per-node 2 scripts/check_ring_split.py [--out result.json]

Per rank, at FLUX.1-dev 1024² and 2048² (24 heads of 128, 512 text tokens, bf16), CUDA-graph
replays, median ms:
- "ulysses attention": the attention a Ulysses-2 rank runs (all tokens, 12 heads), cuDNN;
- "ring attention (local+remote+merge)": what a ring-2 rank runs instead (its queries against its
  own and then the peer's keys, all 24 heads, cuDNN with log-sum-exp, merged);
- the same with the peer's K/V pulled over NVLink by a copy engine while the local half runs
  ("... with kv pull"), and the bare pull alone.
Ulysses also needs two all-to-alls a block (q/k/v before, output after) that nothing in the block
hides; ring needs only that K/V pull, which the local half can hide.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from scripts.check_copy_engine import graphed, run_on_ranks, time_graph


def cudnn_with_lse(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    return out, lse.reshape(q.shape[:3])


def flash_with_lse(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
    return out, lse


@torch.compile(fullgraph=True)
def merge(o1, l1, o2, l2):
    w1 = torch.sigmoid(l1 - l2).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * (1 - w1)).to(o1.dtype)


def check(ctx, result: dict) -> None:
    from torch.distributed import _symmetric_memory as symm_mem

    group, device = ctx.group, ctx.device
    peer = (ctx.rank + 1) % 2
    holder = {}
    for side_px in (1024, 2048):
        total = (side_px // 16) ** 2 + 512
        local = total // 2
        heads, dim = 24, 128
        t = {}
        q = torch.randn(1, local, heads, dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
        k, v = torch.randn_like(q), torch.randn_like(q)
        qu = torch.randn(1, total, heads // 2, dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
        ku, vu = torch.randn_like(qu), torch.randn_like(qu)
        t["ulysses attention"] = time_graph(graphed(lambda: holder.__setitem__("u", F.scaled_dot_product_attention(qu, ku, vu))), group)
        for name, fn in (("cudnn", cudnn_with_lse), ("flash", flash_with_lse)):
            def ring(fn=fn) -> None:
                o1, l1 = fn(q, k, v)
                o2, l2 = fn(q, k, v)
                holder["r"] = merge(o1, l1, o2, l2)
            t[f"ring attention {name} (local+remote+merge)"] = time_graph(graphed(ring), group)
        # the peer's K/V (28 MB at 1024²) in symmetric memory, pulled by a copy engine
        kv = torch.stack((k, v))
        mine = symm_mem.empty(kv.numel(), dtype=kv.dtype, device=device).view(kv.shape)
        handle = symm_mem.rendezvous(mine, group.group_name)
        mine.copy_(kv)
        remote = handle.get_buffer(peer, kv.shape, kv.dtype)
        pulled = torch.empty_like(kv)
        side = torch.cuda.Stream(device=device)
        torch.cuda.synchronize()
        torch.distributed.barrier(group)

        def pull_only() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                pulled.copy_(remote)
            torch.cuda.current_stream().wait_stream(side)

        def ring_with_pull() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                pulled.copy_(remote)
            o1, l1 = cudnn_with_lse(q, k, v)
            torch.cuda.current_stream().wait_stream(side)
            o2, l2 = cudnn_with_lse(q, pulled[0], pulled[1])
            holder["r"] = merge(o1, l1, o2, l2)

        t["kv pull alone"] = time_graph(graphed(pull_only), group)
        t["ring attention cudnn with kv pull"] = time_graph(graphed(ring_with_pull), group)
        # correctness of the split: ring result equals full attention over both ranks' tokens
        gathered = [torch.empty_like(kv) for _ in range(2)]
        torch.distributed.all_gather(gathered, kv, group=group)
        k_all = torch.cat([g[0] for g in gathered], dim=2)
        v_all = torch.cat([g[1] for g in gathered], dim=2)
        reference = F.scaled_dot_product_attention(q, k_all, v_all).float()
        o1, l1 = cudnn_with_lse(q, *gathered[0])
        o2, l2 = cudnn_with_lse(q, *gathered[1])
        split = merge(o1, l1, o2, l2).float()
        t["ring max abs diff vs full"] = (split - reference).abs().max().item()
        t["kv mbytes"] = kv.numel() * kv.element_size() / 1e6
        result[f"{side_px}"] = t
        del mine, handle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run_on_ranks("check_ring_split", check, args.out)


if __name__ == "__main__":
    main()
