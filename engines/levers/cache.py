"""On-disk engine cache: compiler artifacts under <root>/<key>/rank<R>.bin, keyed by everything they depend on.

The key is a SHA-256 of a JSON document (kept beside the artifacts as key.json, for humans):
model class and config, parameter dtype, device kind and name, the input signature (shapes,
dtypes, strides and non-tensor values of the call), the parallel plan, world size and rank, the
engine options, the layers that --lora files adapt with their rank slots (engines.weights.lora.lora_layout;
not the LoRAs' weights or scales, which change in place without a recompile), and the versions of
Python, torch, CUDA, triton, diffusers and torch-tensorrt.
Change any of them and the key changes, so a stale artifact is never loaded: it is simply not
found, and the engine compiles and writes a new one.

Inductor artifacts are torch's "mega-cache" (torch.compiler.save_cache_artifacts /
load_cache_artifacts): the FX graph, AOTAutograd and autotuning caches of everything compiled in
this process. Loading them before the first call turns inductor's codegen and Triton builds into
cache hits; dynamo still traces the Python (seconds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from engines.levers.fp8 import fp8_form, fp8_layers
from engines.weights.lora import lora_layout


def _describe(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ["tensor", list(x.shape), list(x.stride()), str(x.dtype).removeprefix("torch."), x.device.type]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def input_signature(kwargs: dict[str, Any]) -> str:
    """A string that differs whenever a compiled graph would differ: leaf shapes/strides/dtypes and values."""
    leaves, spec = pytree.tree_flatten(kwargs)
    return json.dumps([str(spec), [_describe(x) for x in leaves]], separators=(",", ":"))


def library_versions() -> dict[str, str | None]:
    """Versions that compiled artifacts depend on."""
    versions: dict[str, str | None] = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
    }
    for name in ("triton", "diffusers", "torchao", "torch_tensorrt", "tensorrt"):
        try:
            versions[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _plain(value: Any) -> Any:
    """JSON-friendly copy of a config value (tuples -> lists, dtypes -> names, others -> repr)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def key_document(module: nn.Module, signature: str, options: Any, rank: int) -> dict[str, Any]:
    """Everything the artifacts of `module` called with `signature` depend on."""
    model = getattr(module, "model", module)
    mesh = getattr(module, "mesh", None)
    plan = getattr(mesh, "plan", None)
    device = module.device
    return {
        "model": type(model).__name__,
        "config": _plain(dict(model.config)) if hasattr(model, "config") else None,
        "dtype": str(module.dtype),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "signature": signature,
        "plan": _plain(dataclasses.asdict(plan)) if plan is not None else None,
        "all_to_all": getattr(mesh, "all_to_all", None),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "rank": rank,
        "options": _plain(dataclasses.asdict(options)),
        "fp8_layers": fp8_layers(model),
        "fp8_form": fp8_form(model),
        "lora_layers": lora_layout(model),
        "versions": library_versions(),
    }


class EngineCache:
    """Artifacts of compiled engines under `root`, one folder per key."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._documents: dict[str, dict[str, Any]] = {}

    def key(self, module: nn.Module, signature: str, options: Any, rank: int) -> str:
        """The cache key of `module` (its config, plan, ...) called with `signature` on `rank`."""
        doc = key_document(module, signature, options, rank)
        digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:24]
        self._documents[digest] = doc
        return digest

    def path(self, key: str, rank: int) -> Path:
        """Where `rank`'s artifacts for `key` live."""
        return self.root / key / f"rank{rank}.bin"

    def load(self, key: str, rank: int) -> bool:
        """Load the artifacts of `key` into torch's compiler caches; False when there are none."""
        path = self.path(key, rank)
        if not path.is_file():
            return False
        torch.compiler.load_cache_artifacts(path.read_bytes())
        return True

    def save(self, key: str, rank: int, extra: dict[str, Any]) -> Path | None:
        """Write this process's compiler artifacts for `key` (atomically); None if torch produced none."""
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return None
        data, _info = artifacts
        folder = self.root / key
        folder.mkdir(parents=True, exist_ok=True)
        doc = dict(self._documents.get(key, {}), **_plain(extra))
        _write_atomic(folder / "key.json", json.dumps(doc, indent=2, sort_keys=True).encode())
        path = self.path(key, rank)
        _write_atomic(path, data)
        return path


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
