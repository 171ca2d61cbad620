"""FLUX.2-dev's 24B text encoder (Mistral Small 3.1, published config, zero weights) on one GPU: resident, and
kept in host memory with its layers streamed to the GPU as they run (accelerate's cpu_offload: what
pipelines.loading.place does with a text encoder above 12B parameters when the GPU has no room for it).
One prompt of --tokens tokens per call, as Flux2Pipeline encodes it (all hidden states); time per call and
peak GPU memory of each.

    python -m benchmarks.text_encoder_offload --out text-encoder.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipelines.family import load
from pipelines.registry import get_spec

GIB = 1024**3


def build_encoder() -> torch.nn.Module:
    """The text encoder of flux2-dev's published architecture in bfloat16 on the host, weights zero."""
    reference, config = get_spec("flux2-dev").architecture.text_encoders["text_encoder"]
    cls = load(reference)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = cls(cls.config_class(**config))
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.zero_()
    return model.eval()


def timed_calls(model: torch.nn.Module, ids: torch.Tensor, calls: int) -> list[float]:
    seconds = []
    with torch.no_grad():
        for _ in range(calls + 1):  # the first call warms up
            torch.cuda.synchronize()
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    return seconds[1:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    model = build_encoder()
    parameters = sum(p.numel() for p in model.parameters())
    built = time.perf_counter() - start
    ids = torch.randint(0, 1000, (1, args.tokens), device="cuda")
    rows = {}

    print(f"built {parameters / 1e9:.1f}B parameters in {built:.0f} s", flush=True)
    torch.cuda.reset_peak_memory_stats()
    model.to("cuda")
    rows["resident"] = dict(seconds=timed_calls(model, ids, args.calls),
                            peak_gib=torch.cuda.max_memory_allocated() / GIB)
    print(f"resident: {rows['resident']}", flush=True)
    model.to("cpu")
    torch.cuda.empty_cache()

    torch.cuda.reset_peak_memory_stats()
    from accelerate import cpu_offload

    cpu_offload(model, execution_device=torch.device("cuda"))
    rows["host, streamed"] = dict(seconds=timed_calls(model, ids, args.calls),
                                  peak_gib=torch.cuda.max_memory_allocated() / GIB)
    result = dict(model="flux2-dev text_encoder", parameters=parameters, tokens=args.tokens, build_seconds=built,
                  device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
