"""Common shell of a parallelized transformer: holds the diffusers model and undoes the change."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engines.mesh import ParallelMesh


class ParallelTransformer(nn.Module):
    """A diffusers transformer run across the ranks of `mesh`; called like the model itself.

    The model's attention processors are replaced in place while this wrapper is in use (call
    `restore()` to put the originals back and close the mesh); the model's classes and code are
    untouched. With a tp axis the model's block weights are split for good (engines/tensor_parallel.py):
    restore() gives back a model that keeps this rank's share only.
    """

    def __init__(self, model: nn.Module, mesh: ParallelMesh, replaced: list[tuple[nn.Module, Any]]) -> None:
        super().__init__()
        self.model = model
        self.mesh = mesh
        self._replaced = replaced
        self.real_tokens: tuple[int, int] | None = None
        """(dim, count) of the real tokens in the blocks' main stream (FLUX's image, Cosmos' video, Cosmos 3's
        gen) on this rank during the current call; the rest of the shard is padding. None: no padding.
        The step cache (engines.step_cache) measures only these."""
        self.step_cache: Any = None
        """The model's step cache (engines.step_cache), if one is installed; a wrapper that runs one guidance
        branch per rank group (engines.cosmos3) tells it which."""

    @property
    def config(self) -> Any:
        """The diffusers model's config (pipelines read it)."""
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype of the model."""
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        """Parameter device of the model."""
        return self.model.device

    def restore(self) -> nn.Module:
        """Put the original attention processors back, close the mesh (its copy-engine buffers are
        freed: release the compiled Engine, and its CUDA graphs, first) and return the plain model."""
        for module, processor in self._replaced:
            module.set_processor(processor)
        self._replaced = []
        self.mesh.close()  # nothing runs on the mesh once the processors are back
        return self.model


def replace_processors(modules: list[nn.Module], processor: Any) -> list[tuple[nn.Module, Any]]:
    """Install `processor` on each attention module; return (module, original) pairs for restore()."""
    replaced = [(module, module.processor) for module in modules]
    for module in modules:
        module.set_processor(processor)
    return replaced
