"""A step cache (`--cache fbcache[:threshold]`): steps whose first block barely changed skip the other blocks.

First-block cache (ParaAttention's FBCache; diffusers' FirstBlockCacheConfig): every call runs the first
block and measures how much its residual (output - input of the measured stream) changed since the last
fully computed step, relative to that residual:

    change = sum |r_now - r_ref| / sum |r_ref|

Below the threshold the remaining blocks are skipped, and the last block's output is the one of the last
computed step plus the first block's change since then: out = T_ref + (H_now - H_ref). (diffusers writes
it H_now + (T_ref - H_ref); the sum is the same, and this form survives what a model does between its
block lists: FLUX.2 concatenates its two streams there, and concatenation is linear, so the first block
hands the change on, the middle blocks pass it through, and the last block adds it to its cached output.)
The first and the last step are always computed.

Why not diffusers' hooks: they decide on each process from its own tensors. Under context parallelism a
rank holds one shard of the tokens, so ranks would decide differently and then wait for each other in
different collectives: a hang (cache-dit#1094). Here every rank adds up its shard's two sums (padding
rows left out), one all-reduce over all ranks gives every rank the same totals, and every rank takes the
same decision from them: one decision per step for the whole job. Guidance's two branches count once:
a batched call carries both in its batch (on two rank groups with --cfg-parallel, each group brings its
half to the sum); families that make one call per branch (Cosmos 3) decide on the first call of a step
(the conditional branch), later calls follow it, and with --cfg-parallel the other group adds zeros to
the same all-reduce. diffusers' hooks also replace `forward` on the block instances; here each block is
wrapped by a module in its ModuleList (after the engine compiled the blocks, so no decision is traced),
and `remove()` puts them back.

Shape legend: the measured stream is [B, S, C] (FLUX, Cosmos) or [S, C] (Cosmos 3); S local to the rank.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engines.options import CacheOptions
from engines.parallel.wrapper import ParallelTransformer

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(residual now, reference residual) of this rank's real tokens -> float64 [2]: the sums
(sum |now - ref|, sum |ref|) this rank adds to the job-wide change."""


def first_block_sums(residual: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """FBCache's change, as this rank's two sums, accumulated in float64 (totals that barely depend on how
    the tokens are split over ranks) without a float64 copy of the stream."""
    return torch.stack([(residual - reference).abs().sum(dtype=torch.float64),
                        reference.abs().sum(dtype=torch.float64)])


@dataclass(kw_only=True)
class _Branch:
    """What one guidance branch's calls keep between steps."""

    head: tuple[torch.Tensor, ...] | None = None
    """The first block's outputs at the last computed step."""
    reference: torch.Tensor | None = None
    """The first block's residual (measured stream) at the last computed step."""
    tail: tuple[torch.Tensor, ...] | None = None
    """The last block's outputs at the last computed step."""


@dataclass(kw_only=True)
class StepCache:
    """The step cache of one transformer (see the module docstring). Used by a pipeline's denoising loop:

        with cache.step(i, len(timesteps)):
            out = transformer(...)        # one call, or one per guidance branch
        cache.skipped                     # the steps of this request that reused the cached blocks
    """

    options: CacheOptions
    group: Any = None
    """Process group whose ranks decide together (every rank of the job); None: one process."""
    real_tokens: Callable[[], tuple[int, int] | None] = lambda: None
    """(dim, count) of the measured stream's real tokens on this rank in the current call (the rest is
    shard padding), from the context-parallel wrapper; None: every row is real."""
    metric: Metric = first_block_sums
    copies: bool = False
    """Keep copies of the first and last blocks' outputs across steps: where each block is a CUDA graph
    (+blockgraph), its next replay overwrites them. Without graphs the outputs are the cache's own (no copy:
    at FLUX.1-dev 1024² a copy is about 56 MB a computed step)."""
    skipped: list[int] = field(default_factory=list)
    """The steps of the current (or last) request that reused the cached blocks, in order."""
    steps: int = 0
    """Steps of the current (or last) request."""
    _step: int = -1
    _branches: dict[int, _Branch] = field(default_factory=dict)
    _calls: int = 0
    _branch: int | None = None
    _compute: bool | None = None
    _current: _Branch | None = None
    _wrapped: list[tuple[nn.ModuleList, int, nn.Module]] = field(default_factory=list)

    # --- the denoising loop's side ------------------------------------------------------------------

    @contextmanager
    def step(self, index: int, total: int, *, skip: bool = True) -> Iterator[None]:
        """Within: the transformer calls of denoising step `index` of `total` (step 0 starts a request).
        skip=False: this request computes every step (every rank is given the same request)."""
        if index == 0:
            self._branches.clear()
            self.skipped = []
        self._step, self.steps, self._calls = index, total, 0
        self._compute = None if skip else True
        try:
            yield
        finally:
            if self._compute is False:
                self.skipped.append(index)
            self._step = -1

    def reset(self) -> None:
        """Forget the last request (a transformer that a request may not call: Wan 2.2 A14B's experts)."""
        self._branches.clear()
        self.skipped, self.steps = [], 0

    @property
    def computed(self) -> int:
        """Steps of the current (or last) request whose blocks all ran."""
        return self.steps - len(self.skipped)

    @contextmanager
    def branch(self, index: int) -> Iterator[None]:
        """Within: the calls are guidance branch `index` (0: conditional), for wrappers that run one
        branch per rank group (pipelines.cosmos3.parallel's forward_guided); otherwise a step's calls count 0, 1."""
        self._branch = index
        try:
            yield
        finally:
            self._branch = None

    # --- installing -----------------------------------------------------------------------------------

    def install(self, model: nn.Module, block_lists: Sequence[str], outputs: Sequence[Sequence[str]],
                stream: str) -> None:
        """Wrap every block of `model`'s ModuleLists `block_lists` (compiled blocks included).

        Args:
            outputs: per list, the block arguments its outputs replace, in return order
                (FLUX: ("encoder_hidden_states", "hidden_states")).
            stream: the argument of the first block whose residual is measured.
        """
        lists = [getattr(model, name) for name in block_lists]
        blocks = [(container, index) for container in lists for index in range(len(container))]
        if len(blocks) < 2:
            raise ValueError("a step cache needs a transformer of two blocks or more")
        if stream not in outputs[0]:
            raise ValueError(f"the measured stream {stream!r} is not an output of the first block ({outputs[0]})")
        for number, (container, index) in enumerate(blocks):
            block = container[index]
            role = "head" if number == 0 else "tail" if number == len(blocks) - 1 else "middle"
            names = tuple(outputs[lists.index(container)])
            self._wrapped.append((container, index, block))
            container[index] = _CachedBlock(block, self, role, names, stream)

    def remove(self) -> None:
        """Put the blocks back as they were before install."""
        for container, index, block in self._wrapped:
            container[index] = block
        self._wrapped = []

    # --- the blocks' side -----------------------------------------------------------------------------

    def _kept(self, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A block's outputs as the cache keeps them across steps (copied where a graph would overwrite them)."""
        return tuple(t.clone() for t in out) if self.copies else out

    def _begin_call(self) -> _Branch:
        """The branch state of a call that reaches the first block."""
        if self._step < 0:
            raise RuntimeError("a cached transformer was called outside StepCache.step()")
        branch = self._branch if self._branch is not None else self._calls
        self._calls += 1
        self._current = self._branches.setdefault(branch, _Branch())
        return self._current

    def _decide(self, residual: torch.Tensor, state: _Branch) -> bool:
        """Whether this step's remaining blocks run: one answer on every rank (see the module docstring)."""
        if self._compute is not None:  # a later call of this step follows the first
            return self._compute
        if self._step in (0, self.steps - 1) or state.reference is None:
            self._compute = True  # every rank knows the step: no exchange
            return True
        sums = torch.zeros(2, dtype=torch.float64, device=residual.device)
        if (self._branch or 0) == 0:
            rows = self.real_tokens()
            now, reference = residual, state.reference
            if rows is not None:
                now, reference = now.narrow(rows[0], 0, rows[1]), reference.narrow(rows[0], 0, rows[1])
            sums = self.metric(now, reference).to(sums)
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        change, scale = sums.tolist()
        self._compute = not (scale > 0 and change / scale < self.options.threshold)
        return self._compute


class _CachedBlock(nn.Module):
    """A block of a cached transformer: runs, is skipped or stands in for the rest, as the step decided."""

    def __init__(self, block: nn.Module, cache: StepCache, role: str, outputs: tuple[str, ...], stream: str) -> None:
        super().__init__()
        self.block = block
        self.role = role
        self.outputs = outputs
        self.stream = stream
        self.cache = cache
        plain = getattr(block, "_orig_mod", block)  # a compiled block's signature is its module's
        self._signature = inspect.signature(plain.forward)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.cache
        if self.role == "head":
            state = cache._begin_call()
            out = self._tuple(self.block(*args, **kwargs))
            residual = out[self.outputs.index(self.stream)] - self._inputs(args, kwargs)[self.stream]
            if cache._decide(residual, state):
                # copies: a CUDA graph per block (+blockgraph) overwrites its outputs at its next replay
                state.head, state.reference = cache._kept(out), residual
                return self._pack(out)
            return self._pack(tuple(now - then for now, then in zip(out, state.head)))  # the change, handed on
        state = cache._current
        if cache._compute:
            out = self._tuple(self.block(*args, **kwargs))
            if self.role == "tail":
                state.tail = cache._kept(out)  # as the head's outputs
            return self._pack(out)
        inputs = self._inputs(args, kwargs)
        passed = tuple(inputs[name] for name in self.outputs)
        if self.role == "tail":
            return self._pack(tuple(then + change for then, change in zip(state.tail, passed)))
        return self._pack(passed)

    def _inputs(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name (only where needed: binding costs host time on every call)."""
        return self._signature.bind(*args, **kwargs).arguments

    def _tuple(self, out: Any) -> tuple[torch.Tensor, ...]:
        return out if isinstance(out, tuple) else (out,)

    def _pack(self, out: tuple[torch.Tensor, ...]) -> Any:
        return out if len(self.outputs) > 1 else out[0]


def install_step_cache(transformer: Any, options: CacheOptions, *, block_lists: Sequence[str],
                       outputs: Sequence[Sequence[str]], stream: str, group: Any = None,
                       copies: bool | None = None) -> StepCache:
    """A step cache on a pipeline's transformer: a plain diffusers model, a ParallelTransformer, or an
    Engine of either (install after the engine is prepared: its compiled blocks are then wrapped, not
    traced). `group`: every rank of the job (None for one process). `copies` (StepCache.copies): None
    follows the engine (a CUDA graph per block, +blockgraph). Other arguments as StepCache.install."""
    module = getattr(transformer, "module", transformer)  # an Engine runs its `module`
    parallel = module if isinstance(module, ParallelTransformer) else None
    if copies is None:
        copies = bool(getattr(getattr(transformer, "options", None), "block_graphs", False))
    cache = StepCache(options=options, group=group, copies=copies)
    if parallel is not None:
        cache.real_tokens = lambda: parallel.real_tokens
        parallel.step_cache = cache
    cache.install(parallel.model if parallel is not None else module, block_lists, outputs, stream)
    return cache
