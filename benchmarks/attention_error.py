"""Benchmark: each attention call's error at a quantized precision, on a model's own activations.

    python -m benchmarks.attention_error --model wan2.1-t2v-14b --video 81x720x1280 --out wan.json     # a GPU
    python -m benchmarks.attention_error --model flux-dev,cosmos3-nano --out real.json
    python -m benchmarks.attention_error --embedded tiny-flux,tiny-cosmos --prompts 4 --out tiny.json  # CPU

Every attention call of a forward runs at full precision, and beside it the same call (the same q, k, v) at each
`--precisions` (engines/levers/quantized_attention.py): the call's error is the relative norm of the quantized output's
difference from the full one, and the largest difference of their log-sum-exps. The model goes on with the full
output, so each call's error is its own, not what earlier calls' errors added to its inputs (the whole output's
error, all calls quantized, is benchmarks/step.py's rel_error_attention).

- `--model`: random weights of a registered checkpoint's published architecture (benchmarks.inputs.build_random), at
  `--sizes` or `--video` (default the family's benchmark shapes), one forward through the family's adapter on one
  process, as benchmarks.step's 1-GPU rows call it.
- `--embedded`: the trained tiny models in assets/, generating the first `--prompts` held-out prompts as
  training.evaluate does (registry defaults, seed = index): every step's calls but the first and last step's, which
  `--attention-precision` keeps at full precision (engines.options.attention_precision_at).

Each row is one model, shape and precision: its calls in order (forward, index within the forward, query and key
tokens, heads, error) and their summary (mean, largest, the call with the largest). Calls are numbered within a
forward in the model's order: for a model of N blocks with one attention each, call i is block i's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import engines.levers.quantized_attention as quantized_attention
import engines.parallel.attention as split_attention
from engines.levers.quantized_attention import attention_precision

PRECISIONS = ("fp8", "int8")


@contextmanager
def call_errors(precisions: tuple[str, ...], model: torch.nn.Module) -> Iterator[list[dict[str, Any]]]:
    """Within (with attention_precision(precisions[0]) entered around it, so that every call reaches the quantized
    kernel): each attention call returns its full-precision result and appends its error at each of `precisions` to
    the yielded list; `model`'s forwards are counted by a pre-hook, so each record names its forward."""
    quantized = quantized_attention.quantized_attention_with_lse
    records: list[dict[str, Any]] = []
    state = {"forward": -1, "call": 0}

    def measured(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, precision: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        groups = q.shape[1] // k.shape[1]
        with attention_precision("full"):
            full_k, full_v = ((k, v) if groups == 1 else (t.repeat_interleave(groups, dim=1) for t in (k, v)))
            full, full_lse = split_attention.attention_with_lse(q, full_k, full_v)
        record = dict(forward=state["forward"], call=state["call"], heads=q.shape[1], query_tokens=q.shape[2],
                      key_tokens=k.shape[2])
        reference = full.float()
        for name in precisions:
            out, lse = quantized(q, k, v, name)
            record[name] = dict(error=float((out.float() - reference).norm() / reference.norm()),
                                lse_error=float((lse.float() - full_lse.float()).abs().max()))
        records.append(record)
        state["call"] += 1
        return full, full_lse

    def next_forward(*_: Any) -> None:
        state["forward"] += 1
        state["call"] = 0

    for name in precisions:  # each precision's kernel looked up (fp8's FlashAttention-3) before any traced call
        with attention_precision(name):
            pass
    hook = model.register_forward_pre_hook(next_forward)
    split_attention.quantized_attention_with_lse = measured
    quantized_attention.quantized_attention_with_lse = measured
    try:
        with attention_precision(precisions[0]):
            yield records
    finally:
        split_attention.quantized_attention_with_lse = quantized
        quantized_attention.quantized_attention_with_lse = quantized
        hook.remove()


def summary(records: list[dict[str, Any]], precision: str) -> dict[str, Any]:
    """The mean and largest error of `records` at `precision`, and where the largest is."""
    if not records:
        return dict(calls=0)
    errors = [r[precision]["error"] for r in records]
    worst = max(range(len(records)), key=errors.__getitem__)
    return dict(calls=len(records), mean_error=sum(errors) / len(errors), max_error=errors[worst],
                max_at=dict(forward=records[worst]["forward"], call=records[worst]["call"]),
                max_lse_error=max(r[precision]["lse_error"] for r in records))


def random_weights(name: str, sizes: str | None, video: str | None, text_tokens: int, precisions: tuple[str, ...],
                   device: torch.device) -> list[dict[str, Any]]:
    """One forward of checkpoint `name`'s architecture with random bf16 weights, per shape."""
    from benchmarks.inputs import bench_model, build_random, model_shapes
    from benchmarks.step import single_process_forward

    spec = bench_model(name)
    bench = spec.family.bench
    shapes = model_shapes(spec, sizes=sizes, video=video, text_tokens=text_tokens)
    model = build_random(spec, device=device, dtype=torch.bfloat16)
    forward = single_process_forward(spec, model, device)
    rows = []
    for shape in shapes:
        kwargs, _ = spec.inputs(shape, batch=bench.batch, device=device, dtype=torch.bfloat16)
        with call_errors(precisions, forward) as records, torch.no_grad():
            forward(**kwargs)
        rows += [dict(model=name, weights="random", shape=shape.label, precision=p, **summary(records, p),
                      calls_each=[{**{k: r[k] for k in ("call", "heads", "query_tokens", "key_tokens")}, **r[p]}
                                  for r in records]) for p in precisions]
        print(f"[attention error] {name} {shape.label}: " + "; ".join(
            f"{p} mean {rows[-len(precisions) + i]['mean_error']:.4f} max {rows[-len(precisions) + i]['max_error']:.4f}"
            for i, p in enumerate(precisions)), file=sys.stderr, flush=True)
    forward.restore()
    del model, forward
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def embedded(name: str, prompts: int, precisions: tuple[str, ...], device: torch.device) -> list[dict[str, Any]]:
    """Model `name` (embedded in assets/) generating `prompts` held-out prompts at the first of `precisions`' schedule,
    every quantized call's error at each of them."""
    from pipelines.registry import default_folder, get_spec
    from training.evaluate import generate
    from training.shapes import held_out_image_prompts, held_out_video_prompts

    spec = get_spec(name)
    texts = (held_out_video_prompts() if spec.media == "video" else held_out_image_prompts())[:prompts]
    records: list[dict[str, Any]] = []

    @contextmanager
    def watch(pipe: Any) -> Iterator[None]:
        with call_errors(precisions, pipe.transformer) as found:
            yield
        records.extend(found)

    generate(name, default_folder(spec), texts, device=str(device), attention_precision=precisions[0], watch=watch)
    rows = []
    for p in precisions:
        per_call: dict[int, list[float]] = {}
        for r in records:
            per_call.setdefault(r["call"], []).append(r[p]["error"])
        rows.append(dict(model=name, weights="trained", prompts=len(texts), precision=p, **summary(records, p),
                         calls_each=[dict(call=c, mean_error=sum(e) / len(e), max_error=max(e), forwards=len(e))
                                     for c, e in sorted(per_call.items())]))
        print(f"[attention error] {name}, {len(texts)} prompts: {p} mean {rows[-1]['mean_error']:.4f} "
              f"max {rows[-1]['max_error']:.4f}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="comma-separated registered checkpoints (random weights)")
    parser.add_argument("--sizes", default=None, help="image sizes HxW, comma-separated (default: the family's)")
    parser.add_argument("--video", default=None, help="video sizes FxHxW, comma-separated (default: the family's)")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--embedded", default="", help="comma-separated embedded models (trained weights)")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts each embedded model generates")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated: fp8, int8")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    precisions = tuple(p for p in args.precisions.split(",") if p)
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or not precisions:
        parser.error(f"--precisions: choose from {', '.join(PRECISIONS)}")
    if not args.model and not args.embedded:
        parser.error("name --model or --embedded")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[dict[str, Any]] = []
    for name in filter(None, args.model.split(",")):
        rows += random_weights(name, args.sizes, args.video, args.text_tokens, precisions, device)
    for name in filter(None, args.embedded.split(",")):
        rows += embedded(name, args.prompts, precisions, device)
    for row in rows:
        print(f"{row['model']:<18} {row.get('shape', row.get('prompts')):<14} {row['precision']:<5} "
              f"calls {row['calls']:>5}  mean {row['mean_error']:.4f}  max {row['max_error']:.4f} "
              f"(forward {row['max_at']['forward']}, call {row['max_at']['call']})  LSE max {row['max_lse_error']:.4f}")
    if args.out is not None:
        meta = dict(command=" ".join(sys.argv), torch=torch.__version__, python=platform.python_version(),
                    device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    fa3=quantized_attention.fa3_forward() is not None)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
