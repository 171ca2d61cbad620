"""The registry: model families and their named checkpoints, and where their weights live here.

A family record (pipelines.family, the built-in ones in pipelines.families) says what a model is
and what runs it; a folder says where its diffusers-format weights are. Nothing here downloads:
real checkpoints are local folders, found under the models root ($ULYSSES_STUDIO_MODELS, default
~/models) or given with --model-path. Torch-free: the CLI checks requests with it before loading.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipelines.families import BUILT_IN
from pipelines.family import ModelFamily, ModelSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = REPO_ROOT / "assets"
MODELS_ENV = "ULYSSES_STUDIO_MODELS"
DEFAULT_IMAGE_MODEL = "tiny-flux"
DEFAULT_VIDEO_MODEL = "tiny-cosmos"

__all__ = ["FAMILIES", "MODELS", "ModelFamily", "ModelNotFoundError", "ModelSpec", "family_of", "get_family",
           "get_spec", "register_family", "resolve_model"]


class ModelNotFoundError(Exception):
    """A model name is unknown, or its weights are not where they were looked for."""


FAMILIES: dict[str, ModelFamily] = {}
"""Family name -> record."""
MODELS: dict[str, ModelSpec] = {}
"""Checkpoint name -> spec, over every family."""


def register_family(family: ModelFamily) -> None:
    """Make `family` and its named checkpoints known (the built-in ones are registered at import).
    ValueError if it or one of its checkpoints reuses a registered name."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    taken = [spec.name for spec in family.models if spec.name in MODELS]
    if taken:
        raise ValueError(f"model name(s) {', '.join(taken)} already registered")
    FAMILIES[family.name] = family
    MODELS.update({spec.name: spec for spec in family.models})


for _family in BUILT_IN:
    register_family(_family)


def get_family(name: str) -> ModelFamily:
    """The family registered under `name`."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ModelNotFoundError(f"unknown model family '{name}'; known: {', '.join(FAMILIES)}") from None


def family_of(spec: ModelSpec) -> ModelFamily:
    """The family record of a checkpoint."""
    return get_family(spec.family)


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
    experts = folder_experts(index)
    if name is not None:
        spec = get_spec(name)
        if spec.checkpoint_class != class_name:
            raise ModelNotFoundError(
                f"{folder} holds a {class_name or 'unknown'} checkpoint, but model '{name}' is a "
                f"{spec.checkpoint_class}"
            )
        if spec.experts != experts:
            raise ModelNotFoundError(f"{folder} holds {experts} transformer{'s' if experts > 1 else ''} (model_index."
                                     f"json's transformer_2), but model '{name}' denoises with {spec.experts}")
        return spec
    candidates = [spec for spec in MODELS.values()
                  if spec.checkpoint_class == class_name and spec.experts == experts and not spec.embedded]
    if index.get("is_distilled") is False:  # a FLUX.2 Klein base checkpoint: the names that use guidance
        candidates = [spec for spec in candidates if spec.guidance_batch] or candidates
    if len(candidates) > 1:  # sizes of one class (Wan 2.1 1.3B and 14B): the name whose published transformer it is
        candidates = [spec for spec in candidates if _has_architecture(folder, spec)] or candidates
    if len(candidates) > 1:  # none whole (a shrunk folder): the names that agree on the keys where they differ
        # (two editing checkpoints of one class told apart by one transformer key)
        differing = _differing_keys(candidates)
        candidates = [spec for spec in candidates if _has_architecture(folder, spec, differing)] or candidates
    if candidates:
        return candidates[0]
    supported = dict.fromkeys(spec.checkpoint_class for spec in MODELS.values())
    raise ModelNotFoundError(
        f"{folder}: model_index.json names '{class_name}', which ulysses-studio cannot run "
        f"(supported: {', '.join(supported)})"
    )


def folder_experts(index: dict) -> int:
    """Transformers a folder's model_index.json holds: 2 where it names a transformer_2 (Wan 2.2 A14B), else 1."""
    return 2 if (index.get("transformer_2") or [None])[0] is not None else 1


def _has_architecture(folder: Path, spec: ModelSpec, keys: set[str] | None = None) -> bool:
    """Whether `folder`'s transformer config has `spec`'s published transformer (every key both give, equal; only
    `keys` where given)."""
    path = folder / "transformer" / "config.json"
    if spec.architecture is None or not path.is_file():
        return False
    config = json.loads(path.read_text())
    published = json.loads(json.dumps(spec.architecture.transformer))  # tuples as the config's lists
    return all(config[key] == value for key, value in published.items()
               if key in config and (keys is None or key in keys))


def _differing_keys(specs: list[ModelSpec]) -> set[str]:
    """The published transformer keys on which `specs` do not all agree (a key one of them leaves out counts)."""
    configs = [spec.architecture.transformer if spec.architecture else {} for spec in specs]
    keys = set().union(*configs)
    return {key for key in keys if len({json.dumps(config.get(key)) for config in configs}) > 1}


INDEX_FILES = ("model_index.json", "modular_model_index.json")
"""What names a diffusers folder's pipeline class and components: a pipeline's model_index.json, or the
modular_model_index.json of a folder that diffusers' modular pipelines save (FLUX.3)."""


def has_model_index(folder: Path) -> bool:
    """Whether `folder` is a diffusers model folder (it holds one of INDEX_FILES)."""
    return any((folder / name).is_file() for name in INDEX_FILES)


def read_model_index(folder: Path) -> dict:
    """model_index.json of a diffusers-format folder, with a one-line error when it is missing. A modular
    folder's modular_model_index.json serves in its place, each component as model_index.json writes it,
    (library, class): its third item, where to load the component from, is the folder's subfolder here."""
    index_path = folder / "model_index.json"
    if index_path.is_file():
        return json.loads(index_path.read_text())
    modular_path = folder / "modular_model_index.json"
    if not modular_path.is_file():
        raise ModelNotFoundError(f"{folder} is not a diffusers model folder (no model_index.json in it)")
    index = json.loads(modular_path.read_text())
    return {key: value[:2] if isinstance(value, list) and len(value) == 3 else value for key, value in index.items()}


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
    if not has_model_index(folder):
        if spec.embedded:
            raise ModelNotFoundError(
                f"embedded model '{spec.name}' is missing from {folder}; rebuild it with: "
                "python -m training.tiny_models"
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
