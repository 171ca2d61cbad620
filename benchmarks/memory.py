"""Parameter memory per rank of a registered architecture, counted on the meta device (no weights, no GPU).

    python -m benchmarks.memory --model cosmos3-nano,cosmos3-super,flux-dev

Context parallelism (Ulysses, ring, all-gather, CFG) splits the tokens, not the weights: every rank
holds the whole transformer, so its parameter bytes are the same at 1 and at 8 ranks. The text
encoders and the VAE live on rank 0 only and are listed apart.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.inputs import bench_model, benchmarkable
from pipelines.family import load
from pipelines.registry import get_spec

GIB = 1024**3


def parameters_on_meta(cls: type, **config) -> int:
    """Parameters of cls(**config), built on the meta device."""
    with torch.device("meta"):
        module = cls(**config)
    return sum(p.numel() for p in module.parameters())


def rank0_parameters(name: str) -> int:
    """Parameters of the text encoders and VAE of checkpoint `name` (rank 0's extra share)."""
    arch = get_spec(name).architecture
    total = parameters_on_meta(load(arch.vae_class), **arch.vae)
    for reference, config in arch.text_encoders.values():
        cls = load(reference)
        with torch.device("meta"):
            total += sum(p.numel() for p in cls(cls.config_class(**config)).parameters())
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cosmos3-nano,cosmos3-super",
                        help=f"comma-separated, of {', '.join(benchmarkable())}")
    parser.add_argument("--bytes", type=int, default=2, help="bytes per parameter (default 2: bfloat16)")
    args = parser.parse_args(argv)
    print(f"{'model':<32} {'transformer':>12} {'per rank, 1-8 ranks':>20} {'rank 0 adds':>12}")
    for name in args.model.split(","):
        model = bench_model(name)
        count = parameters_on_meta(model.model_class, **model.config)
        extra = rank0_parameters(name)
        print(f"{name:<32} {count / 1e9:>10.2f} B {count * args.bytes / GIB:>16.1f} GiB "
              f"{extra * args.bytes / GIB:>8.1f} GiB")


if __name__ == "__main__":
    main()
