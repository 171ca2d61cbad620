"""Context parallelism for any diffusers transformer with a declared split plan (diffusers' `_cp_plan`).

A transformer class that diffusers can run context-parallel says where its tokens are split and gathered
(`_cp_plan`; WanTransformer3DModel's, for one):

    {"rope":     {0: ContextParallelInput(split_dim=1, expected_dims=4, split_output=True), 1: ...},
     "blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
     "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
     "":         {"timestep": ContextParallelInput(split_dim=1, expected_dims=2)}}

and its attention processors pass `parallel_config` to diffusers' `dispatch_attention_fn` exactly where the
keys are the split tokens (self-attention; a cross-attention to the replicated text passes None). This module
applies such a plan from outside, with this project's pieces instead of diffusers' templated attention:

- every split pads the tensor to a multiple of the sequence degree (engines.parallel.sharding.ShardLayout), so any
  token count runs on any number of ranks (diffusers' own split needs an even division), and the exit
  gathers and cuts the padding;
- the attention is engines.parallel.attention.split_attention(mesh): Ulysses, ring, all-gather K/V or Ulysses x ring,
  on either transport, with the padded keys left out; the processors' own projections, norms and rotary
  embedding run unchanged;
- the batch is split over CFG groups (a guidance-batched call, Wan); a model whose guidance branches are
  separate calls (its record's guidance_calls) runs one branch per CFG group through forward_guided
  (engines.parallel.wrapper); tensor parallelism, compiled engines, CUDA graphs, FP8 and the step cache apply to the
  model as to Cosmos 3's own adapter.

How the attention is reached. diffusers' processors call `dispatch_attention_fn(..., parallel_config=
self._parallel_config)`. Each processor here gets a copy whose `_parallel_config` is a SequenceSplit, and the
name `dispatch_attention_fn` in the processor's module is wrapped once by `_dispatch`: a call that carries a
SequenceSplit goes to our attention, every other call (another model, a cross-attention, a one-process run)
to diffusers' own function unchanged. restore() puts the original processors back.

Why hooks are attached per call. Splits on a module's inputs or outputs are torch module hooks. The step
cache and the per-block engines replace the blocks in their ModuleList by wrappers (engines.levers.step_cache,
engines.levers.compile); a split before the first block must happen before the step cache measures that block, so
each call attaches the hooks to whatever stands at the plan's path then (an attribute walk; re-registered
only when the occupant changed).

Which padded sequence an attention call sees is the family's to say when the processor concatenates
several split streams (a double-stream model joins text then image: segments=("encoder_hidden_states",
"hidden_states")); one split stream (Wan) is the default.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from torch import nn

from engines.parallel.attention import split_attention
from engines.parallel.mesh import ParallelMesh
from engines.parallel.modulation import SharedModulation
from engines.parallel.sharding import ShardLayout, check_batch, gather_batch, gather_tokens, shard_tokens, split_batch
from engines.parallel.tensor_parallel import COLUMN, ROW, LinearSplit, WeightSplit, local_heads, split_over_mesh
from engines.parallel.wrapper import ParallelTransformer

ROOT = ""
"""The plan's key for the model's own call."""


@dataclass
class _CallState:
    """What one forward call's splits found: each split stream's real length (by the name it was split
    under: an argument name, or "<module path>:<output index>")."""

    lengths: dict[str, int] = field(default_factory=dict)
    modulations: list[torch.Tensor] = field(default_factory=list)
    """Each consumer's modulation in this call (a SharedModulation's, computed at its source's output)."""


class SequenceSplit:
    """A processor's `parallel_config` in a parallelized model: the attention over the split tokens."""

    def __init__(self, mesh: ParallelMesh, state: _CallState, segments: tuple[str, ...]) -> None:
        self.attention = split_attention(mesh)
        self.degree = mesh.plan.seq_degree
        self.state = state
        self.segments = segments

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, **_: Any) -> torch.Tensor:
        if attn_mask is not None or is_causal or dropout_p:
            raise ValueError("the split attention takes no mask, no causal mask and no dropout: this model's "
                             "attention needs one (give its family a plan that leaves masked tokens out)")
        if scale is not None and abs(scale - query.shape[-1] ** -0.5) > 1e-12:
            raise ValueError(f"the split attention uses the softmax scale 1/sqrt(head dim); this model asks {scale}")
        return self.attention(query, key, value, layout=self.layout())

    def layout(self) -> ShardLayout:
        """The shard layout of the sequence this attention attends, in the current call."""
        lengths = tuple(self.state.lengths[name] for name in self.segments if name in self.state.lengths)
        if not lengths:  # an optional stream (a reference image's tokens) may be absent, not all of them
            raise RuntimeError(f"none of the attention's segments {self.segments} was split before it: check the plan")
        return ShardLayout(lengths=lengths, degree=self.degree)


_DISPATCH = "dispatch_attention_fn"


def _install_dispatch(module_name: str) -> None:
    """Wrap the `dispatch_attention_fn` that `module_name`'s processors call (once; see the module docstring)."""
    module = sys.modules[module_name]
    original = getattr(module, _DISPATCH, None)
    if original is None:
        raise ValueError(f"{module_name}'s attention does not call diffusers' {_DISPATCH}: the generic context-"
                         "parallel path cannot reach it (its family needs an adapter of its own)")
    if getattr(original, "_splits_sequences", False):
        return

    def _dispatch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  *args: Any, parallel_config: Any = None, **kwargs: Any) -> torch.Tensor:
        if isinstance(parallel_config, SequenceSplit):
            return parallel_config(query, key, value, attn_mask, *args, **kwargs)
        return original(query, key, value, attn_mask, *args, parallel_config=parallel_config, **kwargs)

    _dispatch._splits_sequences = True  # type: ignore[attr-defined]
    _dispatch.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, _DISPATCH, _dispatch)


def _at(model: nn.Module, path: str) -> list[nn.Module]:
    """The modules at a plan path ("", "rope", "blocks.0", "transformer_blocks.*"), as they stand now."""
    modules = [model]
    for atom in path.split(".") if path else []:
        if atom == "*":
            modules = [child for module in modules for child in module]
        else:
            modules = [module[int(atom)] if atom.isdigit() else getattr(module, atom) for module in modules]
    return modules


class ParallelGeneric(ParallelTransformer):
    """A `_cp_plan` transformer across ranks; same call as the model, full output on every rank."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, replaced: list, plan: dict[str, Any], *,
                 state: _CallState, stream: str, per_sample: tuple[str, ...], shared: tuple[str, ...],
                 blocks: list[tuple[nn.ModuleList, int, nn.Module]] = (),
                 modulation: SharedModulation | None = None) -> None:
        super().__init__(model, mesh, replaced)
        self.plan = plan
        self.stream = stream
        self.per_sample = per_sample
        self.shared = shared
        self.modulation = modulation
        self._blocks = list(blocks)
        """(list, index, the block it held) of each block the family's replacement took the place of."""
        self._state = state
        self._signature = inspect.signature(model.forward)
        self._hooks: dict[tuple[str, int], tuple[nn.Module, list[Any]]] = {}
        """(path, index) -> (the module the hooks sit on, their handles)."""
        paths = [path for path, entry in plan.items() if path != ROOT and isinstance(entry, dict)]
        paths += [path for path, _ in modulation.consumers] if modulation is not None else []
        self._arguments = {path: tuple(inspect.signature(_at(model, path)[0].forward).parameters) for path in paths}
        """path -> the argument names of the module there, read now, before the engines and the step cache wrap
        the blocks in modules of their own (whose forward takes *args, **kwargs)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run one denoiser call; arguments and result as the model's forward."""
        mesh = self.mesh
        arguments = self._signature.bind(*args, **kwargs).arguments
        batched = mesh.plan.cfg > 1 and not self.one_branch  # a guidance-batched call: its batch over the CFG groups
        if batched:
            hidden = next(value for value in arguments.values() if isinstance(value, torch.Tensor))
            batch = hidden.shape[0]
            check_batch(batch, mesh)
            arguments = {name: value if name in self.shared else _split_batch(value, mesh, batch,
                                                                              name in self.per_sample)
                         for name, value in arguments.items()}
        self._state.lengths.clear()
        self.real_tokens = None
        if mesh.plan.seq_degree > 1:
            self._attach()
            for name, split in self.plan.get(ROOT, {}).items():
                if name in arguments and isinstance(arguments[name], torch.Tensor):
                    arguments[name] = self._split(name, arguments[name], split)
        out = self.model(**arguments)
        if not batched:
            return out
        if isinstance(out, tuple):
            return (gather_batch(out[0], mesh), *out[1:])
        out.sample = gather_batch(out.sample, mesh)
        return out

    # --- the splits -------------------------------------------------------------------------------------

    def _split(self, name: str, x: torch.Tensor, split: ContextParallelInput) -> torch.Tensor:
        if split.expected_dims is not None and x.ndim != split.expected_dims:
            return x  # as diffusers: a tensor of another rank is not split (a per-sample timestep, say)
        mesh = self.mesh
        length = x.shape[split.split_dim]
        self._state.lengths[name] = length
        layout = ShardLayout(lengths=(length,), degree=mesh.plan.seq_degree)
        if name == self.stream:
            self.real_tokens = (split.split_dim % x.ndim, layout.valid(0, mesh.seq_rank))
        return shard_tokens(x, layout, segment=0, shard=mesh.seq_rank, dim=split.split_dim)

    def _gather(self, x: torch.Tensor, gather: ContextParallelOutput) -> torch.Tensor:
        if gather.expected_dims is not None and x.ndim != gather.expected_dims:
            return x
        return gather_tokens(x, self.mesh, length=self._state.lengths[self.stream], dim=gather.gather_dim)

    def _attach(self) -> None:
        """Put the plan's hooks (and the shared modulation's) on the modules standing at its paths now (see the
        module docstring)."""
        for path, entry in self.plan.items():
            if path == ROOT:
                continue
            for index, module in enumerate(_at(self.model, path)):
                if self._vacant(path, index, module):
                    self._hooks[path, index] = (module, self._hook(path, module, entry))
        if self.modulation is None:
            return
        state, shared = self._state, self.modulation

        def compute(_module: nn.Module, _args: Any, temb: torch.Tensor) -> None:
            state.modulations = shared(temb)

        source = _at(self.model, shared.source)[0]
        if self._vacant("modulation", 0, source):
            self._hooks["modulation", 0] = (source, [source.register_forward_hook(compute)])
        consumer = 0
        for path, argument in shared.consumers:
            for index, module in enumerate(_at(self.model, path)):
                if self._vacant(f"modulation:{path}", index, module):
                    hand = partial(_hand_modulation, state, consumer, self._arguments[path], argument)
                    self._hooks[f"modulation:{path}", index] = (
                        module, [module.register_forward_pre_hook(hand, with_kwargs=True)])
                consumer += 1

    def _vacant(self, key: str, index: int, module: nn.Module) -> bool:
        """Whether (key, index) needs hooks on `module`: none yet, or they sit on a module no longer there (then
        removed)."""
        held = self._hooks.get((key, index))
        if held is not None and held[0] is module:
            return False
        for handle in held[1] if held else ():
            handle.remove()
        return True

    def _hook(self, path: str, module: nn.Module, entry: Any) -> list[Any]:
        if isinstance(entry, (ContextParallelOutput, list, tuple)):
            gathers = [entry] if isinstance(entry, ContextParallelOutput) else list(entry)

            def gather(_module: nn.Module, _args: Any, out: Any) -> Any:
                if isinstance(out, torch.Tensor):
                    return self._gather(out, gathers[0])
                return type(out)(self._gather(x, g) for x, g in zip(out, gathers))

            return [module.register_forward_hook(gather)]
        inputs = {name: split for name, split in entry.items() if not split.split_output}
        outputs = {index: split for index, split in entry.items() if split.split_output}
        handles = []
        if inputs:
            def split_inputs(_module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
                args = list(args)
                for position, name in enumerate(self._arguments[path]):
                    if name in inputs:
                        if position < len(args):
                            if isinstance(args[position], torch.Tensor):
                                args[position] = self._split(name, args[position], inputs[name])
                        elif isinstance(kwargs.get(name), torch.Tensor):
                            kwargs[name] = self._split(name, kwargs[name], inputs[name])
                return tuple(args), kwargs

            handles.append(module.register_forward_pre_hook(split_inputs, with_kwargs=True))
        if outputs:
            def split_outputs(_module: nn.Module, _args: Any, out: Any) -> Any:
                parts = list(out) if isinstance(out, (tuple, list)) else [out]
                for index, split in outputs.items():
                    parts[index] = self._split(f"{path}:{index}", parts[index], split)
                return type(out)(parts) if isinstance(out, (tuple, list)) else parts[0]

            handles.append(module.register_forward_hook(split_outputs))
        return handles

    def restore(self) -> nn.Module:
        for _, handles in self._hooks.values():
            for handle in handles:
                handle.remove()
        self._hooks = {}
        if self.modulation is not None:
            self.modulation.restore()
        for blocks, index, block in self._blocks:
            blocks[index] = block
        self._blocks = []
        return super().restore()


def _hand_modulation(state: _CallState, consumer: int, names: tuple[str, ...], name: str, _module: nn.Module,
                     args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """A consumer's call (args, kwargs) with its argument `name` (of the parameters `names`, in order) set to its
    modulation in this call (a forward pre-hook)."""
    value = state.modulations[consumer]
    position = names.index(name)
    if position < len(args):
        return (*args[:position], value, *args[position + 1:]), kwargs
    return args, {**kwargs, name: value}


def _split_batch(value: Any, mesh: ParallelMesh, batch: int, per_sample: bool) -> Any:
    """This CFG group's share of an argument: of a tensor (or a tuple of them) with the batch leading; of a
    per-sample list (`per_sample`), its entries."""
    if per_sample:
        if len(value) != batch:
            raise ValueError(f"expected one entry per sample ({batch}), got {len(value)}")
        size = batch // mesh.plan.cfg
        return value[mesh.cfg_rank * size:(mesh.cfg_rank + 1) * size]
    if isinstance(value, torch.Tensor):
        return split_batch(value, mesh, batch=batch)
    if isinstance(value, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in value):
        return type(value)(split_batch(x, mesh, batch=batch) if isinstance(x, torch.Tensor) else x for x in value)
    return value


def context_parallel_plan(model: nn.Module) -> dict[str, Any]:
    """The model class's diffusers `_cp_plan`, or ValueError naming the class."""
    plan = getattr(type(model), "_cp_plan", None)
    if not plan:
        raise ValueError(f"{type(model).__name__} declares no context-parallel plan (_cp_plan): give its family a "
                         "plan or an adapter of its own")
    return plan


Segments = Sequence[str] | dict[str, Sequence[str]]
"""The split streams an attention attends, in the order its processor concatenates them (names the plan splits
under); streams absent from a call (an optional reference image) are left out. One tuple for every attention, or
per attention module path prefix (the longest that matches; "" for the rest): FLUX.3's per-mode blocks attend one
stream each, its joint blocks all of them."""


def _segments_of(segments: Segments, name: str) -> tuple[str, ...]:
    if not isinstance(segments, dict):
        return tuple(segments)
    prefix = _prefix_of(segments, name)
    if prefix is None:
        raise ValueError(f"no attention segments declared for {name}")
    return tuple(segments[prefix])


def _prefix_of(by_prefix: dict[str, Any], name: str) -> str | None:
    """The longest key of `by_prefix` that is a module path prefix of `name`, "*" matching any one name ("" matches
    every name); None."""
    atoms = name.split(".")

    def atoms_of(prefix: str) -> list[str]:
        return prefix.split(".") if prefix else []

    matches = [prefix for prefix in by_prefix if len(atoms_of(prefix)) <= len(atoms)
               and all(part in ("*", atom) for part, atom in zip(atoms_of(prefix), atoms))]
    return max(matches, key=lambda prefix: len(atoms_of(prefix))) if matches else None


Layout = Callable[[], ShardLayout]
"""The shard layout of the sequence an attention attends, in the current call (SequenceSplit.layout)."""


class SplitProcessor:
    """The base of a family's attention processor on this path (generic_adapter's `processor`): the split attention
    and `layout()`, the shard layout of the sequence it attends in the current call."""

    def __init__(self, mesh: ParallelMesh, layout: Layout) -> None:
        self.attention = split_attention(mesh)
        self.layout = layout


def generic_adapter(*, plan: dict[str, Any] | None = None, segments: Segments = ("hidden_states",),
                    stream: str = "hidden_states", per_sample: Sequence[str] = (), shared: Sequence[str] = (),
                    weights: Callable[[nn.Module, int], WeightSplit] | None = None,
                    processor: dict[str, Callable[[ParallelMesh, Layout], Any]] | None = None,
                    blocks: dict[str, Callable[[nn.Module, ParallelMesh, Layout], nn.Module | None]] | None = None,
                    modulation: Callable[[nn.Module, ParallelMesh], SharedModulation | None] | None = None,
                    ) -> Callable[[nn.Module, ParallelMesh], ParallelGeneric]:
    """A family's parallelize function on the generic path: `plan` in diffusers' `_cp_plan` form (default the
    class's own); `segments`, what each attention attends (Segments); `stream`, the blocks' main stream (the
    one the output gather cuts back to its length, the step cache measures); `per_sample`, arguments that are
    lists of one entry per sample (split with the batch over CFG groups, as tensors are); `shared`, tensors
    that are the same for every sample and have no batch dimension (position ids), left whole; `weights`, the
    family's tensor-parallel split (default generic_weights, for transformers of diffusers' standard parts).

    A family's speed features, each applied only where the sequence is split:
    - `processor`: per attention module path prefix ("*" matches any one name; the longest that matches; "" for
      every attention whose processor takes a parallel_config), `make(mesh, layout)` -> the processor of those
      attentions (one per prefix and Segments entry), in place of diffusers' own with its attention call split
      (FLUX's orders its projections around the exchanges; Cosmos' processors take no parallel_config);
    - `blocks`: for a ModuleList's path, `make(block, mesh, layout)` -> the block that takes its place, or None to
      keep it (FLUX.1's single-stream blocks overlap their exchanges with their MLP);
    - `modulation(model, mesh)`: the model's AdaLN modulations shared out over the sequence ranks
      (engines.parallel.modulation), or None where the plan does not allow it.
    restore() undoes each."""

    def parallelize(model: nn.Module, mesh: ParallelMesh) -> ParallelGeneric:
        cp_plan = plan if plan is not None else context_parallel_plan(model)
        mesh.plan.check(num_heads=model.config.num_attention_heads)
        split_over_mesh(model, weights or generic_weights, mesh)
        state = _CallState()
        replaced, swapped, shared_modulation = [], [], None
        if mesh.plan.seq_degree > 1:
            splits: dict[tuple[str, ...], SequenceSplit] = {}
            processors: dict[tuple[str, tuple[str, ...]], Any] = {}

            def split_of(name: str) -> SequenceSplit:
                attends = _segments_of(segments, name)
                if attends not in splits:
                    splits[attends] = SequenceSplit(mesh, state, attends)
                return splits[attends]

            for name, module in model.named_modules():
                original = getattr(module, "processor", None)
                prefix = _prefix_of(processor or {}, name)
                # an attention whose processor takes a parallel_config, or one a family's processor names by a path
                # ("" names only the attentions that take a parallel_config)
                named = prefix is not None and prefix != ""
                if original is None or not (hasattr(original, "_parallel_config") or named):
                    continue
                split = split_of(name)
                if prefix is not None:
                    if (prefix, split.segments) not in processors:
                        processors[prefix, split.segments] = processor[prefix](mesh, split.layout)
                    mine = processors[prefix, split.segments]
                else:
                    _install_dispatch(type(original).__module__)
                    mine = copy.copy(original)
                    mine._parallel_config = split
                replaced.append((module, original))
                module.set_processor(mine)
            if not replaced:
                raise ValueError(f"{type(model).__name__}'s attention processors take no parallel_config: the "
                                 "generic context-parallel path cannot reach them")
            for path, make in (blocks or {}).items():
                held = model.get_submodule(path)
                for index, block in enumerate(held):
                    mine = make(block, mesh, split_of(f"{path}.{index}").layout)
                    if mine is not None:
                        swapped.append((held, index, block))
                        held[index] = mine
            if modulation is not None:
                shared_modulation = modulation(model, mesh)
                if shared_modulation is not None:
                    shared_modulation.install()
        return ParallelGeneric(model, mesh, replaced, cp_plan, state=state, stream=stream,
                               per_sample=tuple(per_sample), shared=tuple(shared), blocks=swapped,
                               modulation=shared_modulation)

    return parallelize


parallelize_generic = generic_adapter()
"""The generic path with the class's own plan and one split stream, "hidden_states" (Wan)."""

parallelize_joint = generic_adapter(segments=("encoder_hidden_states", "hidden_states"), per_sample=("img_shapes",))
"""The generic path for a double-stream transformer whose attention joins the text then the image tokens, both
split."""


def generic_weights(model: nn.Module, tp: int) -> WeightSplit:
    """The tensor-parallel split of a transformer built of diffusers' standard parts (engines.parallel.tensor_parallel):
    in every repeated block (a module inside a ModuleList), each attention's to_q/to_k/to_v and added
    add_q/k/v_proj column-parallel and to_out.0 / to_add_out row-parallel; each FeedForward's net.0.proj
    column-parallel and net.2 row-parallel; the attention modules' `heads` (and inner widths) set to the rank's
    count. An
    attention that normalizes q or k across all heads at once (Wan's "rms_norm_across_heads") would need an
    all-reduce inside its norm: refused."""
    from diffusers.models.attention import FeedForward

    linears: dict[str, LinearSplit] = {}
    head_counts: dict[str, dict[str, int]] = {}
    in_list = {f"{name}.{index}" for name, module in model.named_modules() if isinstance(module, nn.ModuleList)
               for index in range(len(module))}
    for name, module in model.named_modules():
        if not any(name == block or name.startswith(block + ".") for block in in_list):
            continue
        if all(isinstance(getattr(module, part, None), nn.Linear) for part in ("to_q", "to_k", "to_v")):
            heads = getattr(module, "heads", None)
            if not isinstance(heads, int):
                raise ValueError(f"{name}: an attention without a head count cannot be split over tp ranks")
            inner = module.to_q.out_features
            for norm in ("norm_q", "norm_k"):
                weight = getattr(getattr(module, norm, None), "weight", None)
                if weight is not None and weight.numel() == inner and heads > 1:
                    raise ValueError(f"tensor parallelism cannot split {type(model).__name__}: its attention "
                                     f"normalizes q and k across all heads ({name}.{norm}); run it without --tp")
            for part in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                if isinstance(getattr(module, part, None), nn.Linear):
                    linears[f"{name}.{part}"] = COLUMN
            linears[f"{name}.to_out.0"] = ROW
            if isinstance(getattr(module, "to_add_out", None), nn.Linear):
                linears[f"{name}.to_add_out"] = ROW
            # The rank's heads, and the widths derived from them: processors reshape by `heads` (Wan) or by
            # inner_dim // heads (double-stream ones), and both must give the whole head dimension.
            counts = {"heads": local_heads(heads, tp)}
            for width in ("inner_dim", "inner_kv_dim"):
                if isinstance(getattr(module, width, None), int):
                    counts[width] = getattr(module, width) // tp
            head_counts[name] = counts
        elif isinstance(module, FeedForward):
            linears[f"{name}.net.0.proj"] = COLUMN
            linears[f"{name}.net.2"] = ROW
    if not linears:
        raise ValueError(f"{type(model).__name__} has no standard attention or feed-forward blocks to split over tp")
    return WeightSplit(linears=linears, head_counts=head_counts)
