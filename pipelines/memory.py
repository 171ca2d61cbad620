"""Parameter memory per rank of a checkpoint, counted without reading weights: the transformer built on the
meta device and split at a tp degree (its family's split), the other components from their safetensors
headers (a real folder) or their published configs (benchmarks on random weights).

Context parallelism (Ulysses, ring, all-gather, CFG) splits the tokens, not the weights: only tensor
parallelism divides the transformer's bytes. The text encoders and the VAE live on rank 0 only. With --fp8 the
transformer's block linears (engines/levers/fp8.py) keep 1 byte an element and a float32 scale per output row, and
the rest of it stays in bfloat16 (embedders, modulation, norms, the final projection).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipelines.family import ModelFamily, load
from pipelines.registry import ModelSpec

GIB = 1024**3
BF16_BYTES = 2
"""Bytes of a parameter on the GPUs (bfloat16)."""
FP8_BYTES = 1
"""Bytes of an FP8 weight's element (--fp8: float8_e4m3fn)."""
FP8_SCALE_BYTES = 4
"""Bytes of an FP8 weight's scale, one per output row (float32)."""
WEIGHTS_SHARE = 0.85
"""Share of a GPU's memory that weights may fill; the rest is for activations, workspaces, the CUDA context."""
HOST_TEXT_ENCODER_PARAMETERS = 12e9
"""A text encoder larger than this (FLUX.2-dev's 24B Mistral) stays in rank 0's host memory and runs with its
layers streamed to the GPU one at a time (docs/tensor-parallel.md) unless the GPU has room for it: it would
take most of a GPU for a few hundred tokens per request."""


def on_host(component: str, parameters: int, host_above: float = HOST_TEXT_ENCODER_PARAMETERS) -> bool:
    """Whether rank 0 may keep `component` (of `parameters`) in host memory rather than on its GPU: the memory
    plan counts it there, and loading keeps it there unless the GPU has room (fits_beside)."""
    return component.startswith("text_encoder") and parameters > host_above


def fits_beside(module_bytes: int, free_bytes: int, total_bytes: int) -> bool:
    """Whether `module_bytes` more on a GPU with `free_bytes` of `total_bytes` free still leave the share
    that is not for weights (1 - WEIGHTS_SHARE) free."""
    return free_bytes - module_bytes >= (1 - WEIGHTS_SHARE) * total_bytes


def _meta_transformer(family: ModelFamily, config: dict[str, Any], tp: int) -> Any:
    """The family's transformer built from `config` on the meta device (no memory), once `tp` is checked against
    its attention heads (ValueError where it does not divide them)."""
    import torch

    from engines.parallel.plan import ParallelPlan

    ParallelPlan(tp=tp).check(num_heads=config["num_attention_heads"])
    with torch.device("meta"):
        return load(family.transformer)(**config)


def transformer_parameters(family: ModelFamily, config: dict[str, Any], tp: int) -> int:
    """Parameters one rank keeps of the family's transformer built from `config`, split over `tp` ranks;
    ValueError when the split does not divide (heads, K/V heads or widths)."""
    from engines.parallel.tensor_parallel import rank_parameters

    model = _meta_transformer(family, config, tp)
    if tp == 1:  # nothing split (a family whose attention tp cannot split, Wan's, runs whole)
        return sum(parameter.numel() for parameter in model.parameters())
    split = load(family.tensor_parallel)(model, tp)
    split.check(model, tp)
    return rank_parameters(model, split, tp)


def transformer_bytes(family: ModelFamily, config: dict[str, Any], tp: int, *, fp8: bool = False) -> int:
    """Bytes one rank keeps of the family's transformer built from `config`, split over `tp` ranks, in bfloat16
    (BF16_BYTES a parameter); with `fp8` its FP8 layers (engines.levers.fp8.fp8_linear_names of the rank's shares) at
    FP8_BYTES an element plus one float32 scale per output row. ValueError as transformer_parameters."""
    from engines.levers.fp8 import fp8_linear_names
    from engines.parallel.tensor_parallel import split_weights

    model = _meta_transformer(family, config, tp)
    if tp > 1:  # a family whose attention tp cannot split (Wan's) runs whole at tp 1
        split_weights(model, load(family.tensor_parallel)(model, tp), tp=tp, rank=0)  # meta: local shapes, no data
    quantized = set(fp8_linear_names(model, family.compiled_blocks)) if fp8 else set()
    total = 0
    for name, parameter in model.named_parameters():
        module, _, kind = name.rpartition(".")
        if module in quantized and kind == "weight":
            total += parameter.numel() * FP8_BYTES + parameter.shape[0] * FP8_SCALE_BYTES
        else:
            total += parameter.numel() * BF16_BYTES
    return total


def folder_transformer_config(folder: Path) -> dict[str, Any]:
    """The transformer's config in a diffusers folder, without its private keys."""
    config = json.loads((Path(folder) / "transformer" / "config.json").read_text())
    return {key: value for key, value in config.items() if not key.startswith("_")}


def safetensors_parameters(folder: Path) -> int:
    """Parameters stored in the safetensors files under `folder`, from their headers alone (the format's 8-byte
    length and JSON header: no tensor is read, and neither torch nor safetensors is imported)."""
    total = 0
    for path in Path(folder).rglob("*.safetensors"):
        with path.open("rb") as stream:
            length = int.from_bytes(stream.read(8), "little")
            header = json.loads(stream.read(length))
        total += sum(math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return total


def rank0_components(folder: Path, names: list[str]) -> dict[str, int]:
    """Parameters of the components `names` (text encoders, VAE) of a diffusers folder, by name."""
    return {name: safetensors_parameters(Path(folder) / name) for name in names if (Path(folder) / name).is_dir()}


def published_rank0_components(spec: ModelSpec) -> dict[str, int]:
    """Parameters of the text encoders and VAE of a checkpoint's published architecture, by component name."""
    import torch

    arch = spec.architecture
    if arch is None:
        raise ValueError(f"no published architecture is recorded for '{spec.name}'")
    with torch.device("meta"):
        out = {"vae": sum(p.numel() for p in load(arch.vae_class)(**arch.vae).parameters())}
        for name, (reference, config) in arch.text_encoders.items():
            cls = load(reference)
            out[name] = sum(p.numel() for p in cls(cls.config_class(**config)).parameters())
    return out


def rank0_gpu_parameters(spec: ModelSpec, folder: Path | None) -> int:
    """Parameters rank 0 holds on its GPU besides its transformer share: its folder's text encoders and VAE
    where it has them (else the published ones), less those kept in host memory (on_host)."""
    names = ["vae", *(spec.architecture.text_encoders if spec.architecture else ()), "text_encoder", "text_encoder_2"]
    if folder is not None and any((Path(folder) / name).is_dir() for name in names):
        components = rank0_components(folder, list(dict.fromkeys(names)))
    else:
        components = published_rank0_components(spec)
    return sum(count for name, count in components.items() if not on_host(name, count))


def spec_transformer_config(spec: ModelSpec, folder: Path | None) -> dict[str, Any]:
    """The transformer config of `spec`: its folder's where the folder has one, else the published one."""
    if folder is not None and (Path(folder) / "transformer" / "config.json").is_file():
        return folder_transformer_config(folder)
    if spec.architecture is None:
        raise ValueError(f"'{spec.name}' has neither a local transformer config nor a published architecture")
    return dict(spec.architecture.transformer)
