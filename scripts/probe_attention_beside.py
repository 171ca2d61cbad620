"""GPU probe: can work that does not depend on the attention fill the SMs its last wave leaves idle?

    python scripts/probe_attention_beside.py [--out result.json]

A FLUX ring-2 rank attends 2304 queries to 4608 keys (24 heads of 128, bf16): cuDNN runs that as
four rounds of 132 CTAs, the last one a quarter full (scripts/probe_attention_split.py). A
single-stream block has work beside it that does not depend on it: the MLP's GELU (2304 x 12288,
memory-bound, many small CTAs) and the MLP's share of proj_out (a GEMM). Times (CUDA-graph replays,
median of 20 replays of 20 calls, us), for a ring-2 rank's shapes and 1 GPU's (4608 queries):
- attention alone, GELU alone, GEMM alone;
- attention then GELU on one stream (what the engines run now);
- GELU beside the attention on a second stream, forked before the attention but enqueued after it
  ("after"), or enqueued first ("first");
- the same with the GEMM instead of the GELU.
cuBLAS runs without its workspace, as the engines set it on GPUs (engines.distributed).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from engines.distributed import use_cublas_without_workspace

use_cublas_without_workspace()  # before the first cuBLAS call

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from probe_attention_split import probe_output, replay_us, write_result  # noqa: E402  (this folder: run as scripts/probe_attention_beside.py)


def beside(side: torch.cuda.Stream, main: Callable[[], object], other: Callable[[], object], other_first: bool) -> None:
    """`main` on the current stream and `other` on `side`, both after what the current stream has
    queued so far, joined at the end; `other` enqueued first or after `main`."""
    fork = torch.cuda.Event()
    fork.record()
    if other_first:
        with torch.cuda.stream(side):
            side.wait_event(fork)
            other()
        main()
    else:
        main()
        with torch.cuda.stream(side):
            side.wait_event(fork)
            other()
    torch.cuda.current_stream().wait_stream(side)


def main() -> None:
    out = probe_output(__doc__)
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for queries in (2304, 4608):
        q = torch.randn(1, 24, queries, 128, **bf16)
        k, v = torch.randn(1, 24, 4608, 128, **bf16), torch.randn(1, 24, 4608, 128, **bf16)
        mlp = torch.randn(queries, 12288, **bf16)
        w_out = torch.randn(3072, 12288, **bf16) * 0.01

        def attention(q=q, k=k, v=v) -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        def gelu(mlp=mlp) -> torch.Tensor:
            return F.gelu(mlp, approximate="tanh")

        def gemm(mlp=mlp, w_out=w_out) -> torch.Tensor:
            return F.linear(mlp, w_out)

        times = {
            "attention": replay_us(attention),
            "gelu": replay_us(gelu),
            "gemm": replay_us(gemm),
            "attention then gelu": replay_us(lambda: (attention(), gelu())),
            "gelu beside, after": replay_us(lambda: beside(side, attention, gelu, other_first=False)),
            "gelu beside, first": replay_us(lambda: beside(side, attention, gelu, other_first=True)),
            "attention then gemm": replay_us(lambda: (attention(), gemm())),
            "gemm beside, after": replay_us(lambda: beside(side, attention, gemm, other_first=False)),
            "gemm beside, first": replay_us(lambda: beside(side, attention, gemm, other_first=True)),
        }
        key = f"{queries} queries"
        result["shapes"][key] = times
        print(key, json.dumps({name: round(us, 1) for name, us in times.items()}), flush=True)
    write_result(result, out)


if __name__ == "__main__":
    main()
