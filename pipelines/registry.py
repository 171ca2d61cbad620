"""Named model specs and where their weights live on this machine.

A spec says what a model is (family, media, defaults); a folder says where its diffusers-format
weights are. Nothing here downloads: real checkpoints are local folders, found under the models
root ($ULYSSES_STUDIO_MODELS, default ~/models) or given with --model-path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = REPO_ROOT / "assets"
MODELS_ENV = "ULYSSES_STUDIO_MODELS"


class ModelNotFoundError(Exception):
    """A model name is unknown, or its weights are not where they were looked for."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """What a model is and how it is run by default."""

    name: str
    """Registry name, e.g. 'flux-dev'."""
    family: Literal["flux", "cosmos"]
    """Which pipeline runs it."""
    media: Literal["image", "video"]
    """What one request produces."""
    folder: str
    """Folder name under the models root (or under assets/ for embedded models)."""
    source: str
    """Where a user gets the weights (a hub id to copy locally, or 'embedded')."""
    height: int
    width: int
    steps: int
    guidance: float
    frames: int = 1
    fps: int = 16
    max_sequence_length: int = 512
    negative_prompt: str = ""
    embedded: bool = False
    """True for the tiny models shipped in assets/."""

    @property
    def pipeline_class(self) -> str:
        """The diffusers pipeline class whose model_index.json layout this model uses."""
        if self.family == "flux":
            return "FluxPipeline"
        return "Cosmos2VideoToWorldPipeline" if self.media == "video" else "Cosmos2TextToImagePipeline"


COSMOS_NEGATIVE_PROMPT = (
    "The video captures a series of frames showing ugly scenes, static with no motion, motion blur, "
    "over-saturation, shaky footage, low resolution, grainy texture, pixelated images, poorly lit areas, "
    "underexposed and overexposed scenes, poor color balance, washed out colors, choppy sequences, "
    "jerky movements, low frame rate, artifacting, color banding, unnatural transitions, outdated special effects, "
    "fake elements, unconvincing visuals, poorly edited content, jump cuts, visual noise, and flickering. "
    "Overall, the video is of poor quality."
)

_SPECS = (
    ModelSpec(name="flux-dev", family="flux", media="image", folder="FLUX.1-dev",
              source="black-forest-labs/FLUX.1-dev", height=1024, width=1024, steps=28, guidance=3.5),
    ModelSpec(name="flux-schnell", family="flux", media="image", folder="FLUX.1-schnell",
              source="black-forest-labs/FLUX.1-schnell", height=1024, width=1024, steps=4, guidance=0.0,
              max_sequence_length=256),
    ModelSpec(name="cosmos-predict2-2b-text2image", family="cosmos", media="image",
              folder="Cosmos-Predict2-2B-Text2Image", source="nvidia/Cosmos-Predict2-2B-Text2Image",
              height=768, width=1360, steps=35, guidance=7.0, negative_prompt=COSMOS_NEGATIVE_PROMPT),
    ModelSpec(name="cosmos-predict2-2b-video2world", family="cosmos", media="video",
              folder="Cosmos-Predict2-2B-Video2World", source="nvidia/Cosmos-Predict2-2B-Video2World",
              height=704, width=1280, steps=35, guidance=7.0, frames=93, fps=16,
              negative_prompt=COSMOS_NEGATIVE_PROMPT),
    ModelSpec(name="cosmos-predict2-14b-video2world", family="cosmos", media="video",
              folder="Cosmos-Predict2-14B-Video2World", source="nvidia/Cosmos-Predict2-14B-Video2World",
              height=704, width=1280, steps=35, guidance=7.0, frames=93, fps=16,
              negative_prompt=COSMOS_NEGATIVE_PROMPT),
    ModelSpec(name="tiny-flux", family="flux", media="image", folder="tiny-flux", source="embedded",
              height=256, width=256, steps=8, guidance=3.5, max_sequence_length=64, embedded=True),
    ModelSpec(name="tiny-cosmos", family="cosmos", media="video", folder="tiny-cosmos", source="embedded",
              height=128, width=128, steps=8, guidance=3.0, frames=17, fps=8, max_sequence_length=64,
              negative_prompt="blurry, static", embedded=True),
)
MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in _SPECS}
DEFAULT_IMAGE_MODEL = "tiny-flux"
DEFAULT_VIDEO_MODEL = "tiny-cosmos"


def models_root() -> Path:
    """Folder that holds real checkpoints: $ULYSSES_STUDIO_MODELS, else ~/models."""
    return Path(os.environ.get(MODELS_ENV) or Path.home() / "models").expanduser()


def get_spec(name: str) -> ModelSpec:
    """The spec registered under `name`, or a ModelNotFoundError that lists the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise ModelNotFoundError(f"unknown model '{name}'; known models: {', '.join(MODELS)}") from None


def default_folder(spec: ModelSpec) -> Path:
    """Where `spec`'s weights are looked for when no --model-path is given."""
    return (ASSETS_DIR if spec.embedded else models_root()) / spec.folder


def spec_for_folder(folder: Path, name: str | None = None) -> ModelSpec:
    """A spec for an arbitrary diffusers folder, by its model_index.json (and `name`'s defaults if given)."""
    index = read_model_index(folder)
    class_name = index.get("_class_name", "")
    if name is not None:
        spec = get_spec(name)
        if spec.pipeline_class != class_name:
            raise ModelNotFoundError(
                f"{folder} holds a {class_name or 'unknown'} checkpoint, but model '{name}' is a {spec.pipeline_class}"
            )
        return spec
    for spec in MODELS.values():
        if spec.pipeline_class == class_name and not spec.embedded:
            return spec
    raise ModelNotFoundError(
        f"{folder}: model_index.json names '{class_name}', which ulysses-studio cannot run "
        "(supported: FluxPipeline, Cosmos2VideoToWorldPipeline, Cosmos2TextToImagePipeline)"
    )


def read_model_index(folder: Path) -> dict:
    """model_index.json of a diffusers-format folder, with a one-line error when it is missing."""
    index_path = folder / "model_index.json"
    if not index_path.is_file():
        raise ModelNotFoundError(f"{folder} is not a diffusers model folder (no model_index.json in it)")
    return json.loads(index_path.read_text())


def resolve_model(name: str | None, model_path: str | Path | None) -> tuple[ModelSpec, Path]:
    """The spec and weights folder for `--model NAME` and/or `--model-path DIR`.

    Raises ModelNotFoundError with one line that says which folder was looked for and how to provide it.
    """
    if model_path is not None:
        folder = Path(model_path).expanduser().resolve()
        if not folder.is_dir():
            raise ModelNotFoundError(f"--model-path {folder} does not exist or is not a folder")
        return spec_for_folder(folder, name), folder
    spec = get_spec(name or DEFAULT_IMAGE_MODEL)
    folder = default_folder(spec)
    if not (folder / "model_index.json").is_file():
        if spec.embedded:
            raise ModelNotFoundError(
                f"embedded model '{spec.name}' is missing from {folder}; rebuild it with: python scripts/make_tiny_models.py"
            )
        raise ModelNotFoundError(
            f"weights for '{spec.name}' not found in {folder}: copy a diffusers-format checkout of {spec.source} "
            f"there, set {MODELS_ENV} to the folder that holds {spec.folder}/, or pass --model-path DIR"
        )
    return spec, folder


def read_component_config(folder: Path, name: str) -> dict:
    """A component's config.json (scheduler: scheduler_config.json) without loading weights."""
    for filename in ("config.json", "scheduler_config.json"):
        path = folder / name / filename
        if path.is_file():
            return json.loads(path.read_text())
    raise ModelNotFoundError(f"{folder / name} has no config.json")
