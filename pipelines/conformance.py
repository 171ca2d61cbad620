"""What a family's conformance module (conformance.py in its folder) gives the conformance suite
(tests/test_conformance.py), which runs it for every registered family on the family's tiny random checkpoints
(its record's bench.tiny_checkpoint, or its embedded model):

- CASES, name -> Case (in every module): requests whose final latents and output must equal those of diffusers'
  own pipeline, which `reference(spec, folder, request, conditioning)` runs;
- RANK_CASES, name -> RankCase (where there are any): requests that several gloo ranks, through the app's
  runtime, must answer as one process does;
- APP_CASES, name -> AppCase (where there are any): command lines that `launch --nproc 2 generate` must answer
  as `generate` does;
- SPEC (where needed): ModelSpec fields the suite's runs change (e.g. a shorter max_sequence_length, for speed).

A family whose pipeline has no diffusers counterpart to compare with says why in NO_REFERENCE instead of CASES.
Every model the cases name also has its limits checked: a size or frame count off its grid, or over its largest,
refused with the rule's message; and each family's first model takes two random LoRAs on every linear of its
repeated blocks, as diffusers' PEFT adapters do, in one process and on 2 ranks.

diffusers' pipelines are the reference, never what the product runs: that is why a family's reference is here and
not in its pipeline, and why these modules are imported by the suite alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

INPUTS = ("image.png", "odd.png", "clip.mp4")
"""The input files a case may name as its condition (the suite writes them beside the checkpoints): image.png, a
red rectangle on black, 96x64; odd.png, noise of 88x72 (sides no patch divides); clip.mp4, image.png's rectangle
moving right for 9 frames at 8 fps."""


@dataclass(frozen=True)
class Case:
    """A request run by our pipeline and by diffusers' on the same tiny checkpoint."""

    model: str
    """The registered model name (its folder: the family's tiny checkpoint of that name's pipeline class)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Request fields over the suite's defaults (pipelines.requests.make_request's); a condition names one of INPUTS."""
    tolerance: float = 1e-5
    """The largest difference of the final latents allowed."""
    relative: bool = False
    """`tolerance` is relative to the latents' largest magnitude (where one batch-2 guidance call stands for
    diffusers' two batch-1 calls and guidance amplifies their rounding), not absolute."""


@dataclass(frozen=True)
class RankCase:
    """A request answered by `ranks` gloo ranks through the app's runtime, as one process answers it."""

    model: str
    ranks: int
    options: dict[str, Any]
    """engines.options.RunOptions fields (strategy, cfg_parallel, ...). With a step cache (cache, as --cache takes
    it), every rank skips exactly the steps one process with that cache skips, and one process skips some steps but
    not all (a threshold the family's tiny weights make do so)."""
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AppCase:
    """A `generate` command line, run on one rank and by `launch --nproc 2` with each of `plans`: the same output."""

    model: str
    options: tuple[str, ...]
    """generate's options beside --model, --model-path, --prompt, --seed and --out (an --input names one of INPUTS)."""
    plans: dict[str, tuple[str, ...]]
    """Name -> the 2 ranks' options (--strategy, --cfg-parallel, ...)."""
    tolerance: int = 1
    """The largest pixel difference allowed (a video's H.264 may round a few pixels apart)."""


def diffusers_run(pipe: Any, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """Call a diffusers pipeline (progress bar off) with `inputs`: its final latents, as its last step's callback
    sees them, and its output."""
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep(_pipe, _step, _t, tensors):
        final["latents"] = tensors["latents"]
        return {}

    out = pipe(callback_on_step_end=keep, **inputs)
    return final["latents"], out


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded as our pipelines seed theirs."""
    return torch.Generator().manual_seed(seed)


def frames_as_pixels(frames: np.ndarray) -> np.ndarray:
    """A diffusers video (output_type "np": floats in [0, 1], [T, H, W, 3]) in 0-255, as our pipelines round it."""
    return (np.clip(frames, 0.0, 1.0) * 255).round()


def tiny_folder(spec: Any, root: Path) -> Path:
    """The tiny checkpoint `spec` runs on in the suite: its embedded model, or its family's tiny random checkpoint of
    its pipeline class written once under `root`."""
    from pipelines.family import load
    from pipelines.registry import default_folder, family_of

    if spec.embedded:
        return default_folder(spec)
    folder = root / spec.folder
    if not folder.is_dir():
        load(family_of(spec).bench.tiny_checkpoint)(spec, folder)
    return folder
