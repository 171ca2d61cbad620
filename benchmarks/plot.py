"""The benchmarks' pictures, drawn from their result files: a video clip's seconds by stage and precision, and each
model's step speed-up against its number of GPUs.

    python -m benchmarks.plot clip \\
        --generation docs/bench/2026-11-27-h200x4/wan14b-generation-*/wan14b-generation.json \\
        --steps docs/bench/2026-11-28-h200x1-attention/wan14b-step-fp8-attention.json \\
        docs/bench/2026-11-29-h200x1/wan14b-step-fp8-linears-and-attention.json --count 40 --out clip.png
    python -m benchmarks.plot scaling docs/bench/2026-11-27-h200x4/*/*-step.json ... --out scaling.png

A clip is composed from its stages where no command is long enough to run it whole (a 1 GPU Wan 2.1 14B 720p clip
is 15 minutes): its text encode, decode and file write from a generation row (benchmarks.generation, a few steps at
the clip's shape) and its steps from step rows (benchmarks.step) at each precision, `--count` steps of which the
first and last FULL_PRECISION_EDGE_STEPS run at full attention precision, as the app runs them
(engines.options.attention_precision_at). A GPU count gets a bar per precision its step rows measured; a step row's
plan must be the generation row's (1 GPU, or "ours ulysses-N"). Each bar is labelled with its total.

Scaling: for each model and shape, the best of our plans at each GPU count and diffusers' own Ulysses where measured,
as the 1 GPU row's step time over theirs (the same file's 1 GPU row, our engine: a file is one run; diffusers runs
eager, so its points say how far it is from our 1 GPU step, not how it scales alone). FP8 and quantized-attention
rows are left out: their speed-ups are the precision's, not the GPUs'.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.options import attention_precision_at

STAGES = ("encode", "steps", "decode", "write")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of one benchmark result file (benchmarks.step or benchmarks.generation)."""
    data = json.loads(path.read_text())
    return data["rows"] if isinstance(data, dict) else data


def precision(row: dict[str, Any]) -> tuple[bool, str]:
    """(FP8 linears, attention precision) of a step row, from its mode: "1 GPU fp8 attention fp8" is both."""
    words = row["mode"].split()
    before = words[:words.index("attention")] if "attention" in words else words
    return "fp8" in before, row.get("attention") or "full"


def precision_label(fp8: bool, attention: str) -> str:
    parts = (["FP8 linears"] if fp8 else []) + ([f"{attention} attention"] if attention != "full" else [])
    return " + ".join(parts) or "bf16"


def plan_of(mode: str) -> str:
    """A row's plan: "1 GPU" or "ours ulysses-4", without its precision words."""
    return " ".join(mode.split()[:2])


@dataclass(frozen=True)
class Clip:
    """One bar: a clip's seconds by stage at one GPU count and precision."""

    gpus: int
    label: str
    seconds: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def compose_clips(generation: list[dict[str, Any]], steps: list[dict[str, Any]], count: int) -> list[Clip]:
    """Every clip the rows can compose: per generation row (its GPU count and plan; the first of several), one per
    precision that the step rows measured there, `count` steps each with full attention on the edge steps (a
    quantized-attention clip needs the full-attention row of the same linears). Where no step row measured the plan
    in bf16, the generation row's own steps give its bf16 step (their median)."""
    times: dict[tuple[int, str, bool, str], float] = {}
    for row in steps:
        if row.get("ms") and row.get("error") is None and "cached" not in row["mode"]:
            fp8, attention = precision(row)
            times.setdefault((row["gpus"], plan_of(row["mode"]), fp8, attention), row["ms"] / 1000)
    clips, seen = [], set()
    for row in generation:
        gpus, plan = row["gpus"], plan_of(row["mode"])
        if not row.get("total_s") or (gpus, plan) in seen:
            continue
        seen.add((gpus, plan))
        if (gpus, plan, False, "full") not in times and row.get("step_s"):
            times[(gpus, plan, False, "full")] = statistics.median(row["step_s"])
        measured = sorted({(fp8, attention) for g, p, fp8, attention in times if (g, p) == (gpus, plan)},
                          key=lambda key: (key[0], key[1] != "full", key[1]))
        for fp8, attention in measured:
            full = times.get((gpus, plan, fp8, "full"))
            if full is None:
                continue
            step_s = sum(full if attention_precision_at(attention, index, count) == "full"
                         else times[(gpus, plan, fp8, attention)] for index in range(count))
            clips.append(Clip(gpus=gpus, label=precision_label(fp8, attention),
                              seconds={"encode": row["encode_s"], "steps": step_s, "decode": row["decode_s"],
                                       "write": row.get("write_s") or 0.0}))
    return clips


def scaling(rows_by_file: list[list[dict[str, Any]]]) -> dict[tuple[str, str], dict[str, dict[int, float]]]:
    """(model, shape) -> {"ours" | "diffusers": {GPUs: speed-up}}: each file's rows against its own 1 GPU row (bf16,
    full attention), the best plan of each side per GPU count, over every file."""
    out: dict[tuple[str, str], dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for rows in rows_by_file:
        rows = [r for r in rows if isinstance(r, dict) and "mode" in r and "ms" in r and "gpus" in r]
        base = {(r["model"], r["shape"]): r["ms"] for r in rows
                if r["mode"] == "1 GPU" and r.get("ms") and r.get("error") is None}
        for r in rows:
            key = (r["model"], r["shape"])
            words = r["mode"].split()
            side = words[0]
            if key not in base or side not in ("ours", "diffusers") or not r.get("ms") or r.get("error") is not None:
                continue
            if r["ms"] != r["ms"] or "fp8" in words or "attention" in words or "cached" in words:
                continue  # NaN: not measured; precision rows are not the GPUs' speed-up
            curve = out[key][side]
            curve[1] = 1.0
            curve[r["gpus"]] = max(curve.get(r["gpus"], 0.0), base[key] / r["ms"])
    return out


def draw_clips(clips: list[Clip], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.55 * len(clips) + 1.6))
    names = [f"{c.gpus} GPU{'s' if c.gpus > 1 else ''}, {c.label}" for c in clips]
    left = [0.0] * len(clips)
    for stage in STAGES:
        widths = [c.seconds[stage] for c in clips]
        ax.barh(names, widths, left=left, label=stage)
        left = [a + b for a, b in zip(left, widths)]
    for y, clip in enumerate(clips):
        ax.text(clip.total, y, f" {clip.total:.0f} s", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_xlim(0, max(c.total for c in clips) * 1.15)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def draw_scaling(curves: dict[tuple[str, str], dict[str, dict[int, float]]], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    most = max(g for sides in curves.values() for curve in sides.values() for g in curve)
    ax.plot([1, most], [1, most], color="0.8", linestyle=":", label="linear")
    for index, ((model, shape), sides) in enumerate(sorted(curves.items())):
        color = f"C{index % 10}"
        for side, style in (("ours", "-o"), ("diffusers", "--x")):
            if len(sides.get(side, {})) > 1:
                gpus = sorted(sides[side])
                ax.plot(gpus, [sides[side][g] for g in gpus], style, color=color,
                        label=f"{model} {shape}" + (" (diffusers' Ulysses)" if side == "diffusers" else ""))
    ax.set_xlabel("GPUs")
    ax.set_ylabel("step speed-up over our 1 GPU step")
    ax.set_xticks(range(1, most + 1))
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="figure", required=True)
    clip = sub.add_parser("clip", help="a clip's seconds by stage and precision")
    clip.add_argument("--generation", type=Path, nargs="+", required=True, help="benchmarks.generation results")
    clip.add_argument("--steps", type=Path, nargs="+", required=True, help="benchmarks.step results")
    clip.add_argument("--count", type=int, required=True, help="the clip's denoising steps")
    clip.add_argument("--title", default="")
    clip.add_argument("--out", type=Path, required=True)
    scale = sub.add_parser("scaling", help="each model's step speed-up against GPUs")
    scale.add_argument("files", type=Path, nargs="+", help="benchmarks.step results")
    scale.add_argument("--title", default="")
    scale.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.figure == "clip":
        clips = compose_clips([r for f in args.generation for r in read_rows(f)],
                              [r for f in args.steps for r in read_rows(f)], args.count)
        if not clips:
            p.error("no clip: the step rows measure no plan of the generation rows at full attention precision")
        clips.sort(key=lambda c: (c.gpus, -c.total))
        for c in clips:
            print(f"{c.gpus} GPU(s), {c.label}: {c.total:.1f} s ("
                  + ", ".join(f"{stage} {c.seconds[stage]:.1f}" for stage in STAGES) + ")")
        draw_clips(clips, args.title or f"a {args.count}-step clip, seconds by stage", args.out)
    else:
        curves = scaling([read_rows(f) for f in args.files])
        if not curves:
            p.error("no model has a 1 GPU row and a parallel row in one file")
        for (model, shape), sides in sorted(curves.items()):
            for side, curve in sides.items():
                print(f"{model} {shape} {side}: " + ", ".join(f"{g} GPUs {s:.2f}x" for g, s in sorted(curve.items())))
        draw_scaling(curves, args.title or "step speed-up against GPUs", args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
