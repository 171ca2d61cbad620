"""Parameter memory per rank of a registered architecture, counted on the meta device (no weights, no GPU).

    python -m benchmarks.memory --model cosmos3-super,flux2-dev --tp 1,2,4,8

Context parallelism (Ulysses, ring, all-gather, CFG) splits the tokens, not the weights: without
tensor parallelism every rank holds the whole transformer. With --tp N each rank keeps 1/N of every
block's linear weights (engines/parallel/tensor_parallel.py) and the small replicated layers (embedders,
modulation, norms) whole. The text encoders and the VAE live on rank 0 only and are listed apart
(FLUX.2-dev's 24B text encoder stays in rank 0's host memory: docs/tensor-parallel.md).
"""

from __future__ import annotations

import argparse

from benchmarks.inputs import bench_model, benchmarkable
from pipelines.memory import GIB, published_rank0_components, transformer_parameters
from pipelines.registry import get_spec


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cosmos3-nano,cosmos3-super",
                        help=f"comma-separated, of {', '.join(benchmarkable())}")
    parser.add_argument("--tp", default="1", help="comma-separated tensor-parallel degrees (default 1), e.g. 1,2,4,8")
    parser.add_argument("--bytes", type=int, default=2, help="bytes per parameter (default 2: bfloat16)")
    args = parser.parse_args(argv)
    degrees = [int(tp) for tp in args.tp.split(",")]
    columns = "".join(f"{f'tp {tp} per rank':>16}" for tp in degrees)
    print(f"{'model':<32} {'transformer':>12}{columns} {'rank 0 adds':>12}")
    for name in args.model.split(","):
        model = bench_model(name)
        whole = transformer_parameters(model.family, model.config, 1)
        cells = ""
        for tp in degrees:
            try:
                cells += f"{transformer_parameters(model.family, model.config, tp) * args.bytes / GIB:>12.1f} GiB"
            except ValueError:  # this degree does not split the model (heads, K/V heads)
                cells += f"{'-':>16}"
        extra = sum(published_rank0_components(get_spec(name)).values())
        print(f"{name:<32} {whole / 1e9:>10.2f} B{cells} {extra * args.bytes / GIB:>8.1f} GiB")


if __name__ == "__main__":
    main()
