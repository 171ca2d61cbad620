"""Common shell of a parallelized transformer: holds the diffusers model and undoes the change."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from engines.parallel.collectives import all_gather
from engines.parallel.mesh import ParallelMesh


class ParallelTransformer(nn.Module):
    """A diffusers transformer run across the ranks of `mesh`; called like the model itself.

    The model's attention processors are replaced in place while this wrapper is in use (call
    `restore()` to put the originals back and close the mesh); the model's classes and code are
    untouched. With a tp axis the model's block weights are split for good (engines/parallel/tensor_parallel.py):
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
        The step cache (engines.levers.step_cache) measures only these."""
        self.step_cache: Any = None
        """The model's step cache (engines.levers.step_cache), if one is installed; forward_guided tells it which
        guidance branch this rank group runs."""
        self.one_branch = False
        """True while forward_guided runs this CFG group's own call: its arguments are one branch's, whole (a
        wrapper that splits a guidance-batched call's batch over the CFG groups leaves it as it is)."""

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

    def forward_guided(self, passes: list[dict[str, Any]], call: Any = None) -> list[Any]:
        """The predictions (the model's `sample`: a tensor, or Cosmos 3's list of one per sample) of each of
        guidance's calls in `passes` (keyword arguments of the model, conditional first), on every rank: for
        models whose guidance branches are separate calls (their text lengths differ: Cosmos 3, FLUX.3 base,
        and the others whose record says guidance_calls). With a CFG axis of len(passes) rank groups, group i runs
        passes[i] while the others run theirs, and the predictions are exchanged; without one, the calls run in turn.
        `call` runs one pass (default: this module; an Engine passes itself, so its compiled forward runs)."""
        call = call or self
        cfg = self.mesh.plan.cfg
        if cfg == 1:
            return [call(**kwargs, return_dict=False)[0] for kwargs in passes]
        if len(passes) != cfg:
            raise ValueError(f"the CFG axis has {cfg} rank groups for {len(passes)} guidance passes")
        branch = self.step_cache.branch(self.mesh.cfg_rank) if self.step_cache is not None else nullcontext()
        self.one_branch = True
        try:
            with branch:
                mine = call(**passes[self.mesh.cfg_rank], return_dict=False)[0]
        finally:
            self.one_branch = False
        if isinstance(mine, torch.Tensor):
            gathered = all_gather(mine.unsqueeze(0), 0, self.mesh.cfg_group, cfg)
            return [gathered[i] for i in range(cfg)]
        gathered = [all_gather(x.unsqueeze(0), 0, self.mesh.cfg_group, cfg) for x in mine]
        return [[g[i] for g in gathered] for i in range(cfg)]

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
