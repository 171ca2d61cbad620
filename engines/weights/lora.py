"""LoRA adapters on a rank's transformer: all the run's LoRAs loaded at once, chosen and weighted per request.

Files (`--lora NAME=PATH[:SCALE]`): any format diffusers' loader of the model reads (diffusers/PEFT, kohya, BFL,
XLabs for FLUX.1), converted to diffusers/PEFT keys by diffusers' own `<Family>LoraLoaderMixin.lora_state_dict`
(loader_name: named after the transformer's class). `read_lora` checks a file against the transformer's config alone
(the module built on the meta device: names and shapes, no weights) and refuses it naming the first key that does not
fit.

Application (`attach_loras`, after tensor-parallel splitting and FP8 quantization): every targeted nn.Linear gets
  down  A: (R x in)   the LoRAs' A matrices stacked along the rank, each zero-padded to r_max rows
  up    B: (out x R)  their B matrices side by side, each times its alpha / r, zero-padded to r_max columns
  scales s: (R,)      one tensor shared by every adapted layer: LoRA i's request scale on its r_max slots
with R = (number of LoRAs) x r_max (3 r_max where FP8 fused q/k/v: each piece its own slots), and computes
base(x) + B (s * (A x)) = base(x) + sum_i s_i B_i A_i x.
Every layer's shapes depend on the LoRAs loaded, never on a request: choosing LoRAs and scales writes `s` in place
(LoraSet.select), so compiled engines see the same graph inputs and CUDA graphs replay unchanged; the engine cache
keys their artifacts by the adapted layers and slots (lora_layout), not by the LoRAs' weights. A layer that
only some LoRAs target keeps zeros in the others' slots (no effect); a request that names none zeroes `s`, which
leaves every output exactly the base layer's.

Tensor parallelism: a column-parallel base (output rows split) gets B's rows as the base's (A whole); a
row-parallel base (RowParallelLinear, input columns split) gets A's columns as the base's (B whole), and its LoRA
term is added to the rank's partial product before the layer's one all-reduce: summed once over the group, like the
base. FP8 (--fp8): the LoRA path runs in the run's dtype (bf16 on GPUs) beside the FP8 GEMM, unfused, from the
layer's unquantized input (an Fp8Linear takes its term inside, as a RowParallelLinear does). FP8 fuses FLUX's
q/k/v projections (to_qkv, to_added_qkv): a LoRA of to_q / to_k / to_v lands on the fused layer's rows of that
projection. Context parallelism needs nothing: linears act per token.
`detach_loras` takes the terms off again (benchmarks.step merges them into the weights).

`export_kohya` writes a diffusers/PEFT FLUX.1 LoRA in kohya's format (tests and training check the conversion).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engines.import_noise import quiet_torchao_import
from engines.levers.fp8 import Fp8Linear, FusedAway
from engines.options import LoraError, LoraFile
from engines.parallel.tensor_parallel import RowParallelLinear, WeightSplit, take

__all__ = ["LoraDelta", "LoraError", "LoraFile", "LoraLinear", "LoraSet", "LoraWeights", "attach_loras",
           "check_lora_files", "detach_loras", "export_kohya", "has_lora", "lora_layout", "read_lora", "takes_loras"]


def loader_name(transformer_class: str) -> str:
    """The diffusers LoRA loader whose lora_state_dict converts the files of a transformer class, by diffusers' own
    naming (diffusers.loaders.lora_pipeline names each loader after its model): FluxTransformer2DModel ->
    FluxLoraLoaderMixin, WanTransformer3DModel -> WanLoraLoaderMixin."""
    return re.sub(r"Transformer[23]DModel$", "", transformer_class) + "LoraLoaderMixin"


def _lora_pipeline() -> Any:
    """diffusers' module of LoRA loaders (diffusers.loaders.lora_pipeline), imported without torchao's noise."""
    quiet_torchao_import()
    import diffusers.loaders.lora_pipeline as lora_pipeline

    return lora_pipeline


def takes_loras(transformer_class: str) -> bool:
    """Whether diffusers has a LoRA loader (loader_name) for `transformer_class`: a model without one takes no LoRA."""
    return hasattr(_lora_pipeline(), loader_name(transformer_class))


@dataclass(frozen=True, kw_only=True)
class LoraWeights:
    """One LoRA file in diffusers/PEFT module names: module -> (A [r, in], B [out, r] times alpha / r)."""

    name: str
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]


def meta_transformer(cls: type[nn.Module], config: dict[str, Any]) -> nn.Module:
    """`cls` built from `config` on the meta device: its module names and shapes, no memory, no weights."""
    with torch.device("meta"):
        return cls.from_config(config)


def _state_dict(path: Path, transformer_class: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict | None]:
    """diffusers' conversion of `path` to diffusers/PEFT keys: state dict, network alphas, PEFT config metadata."""
    loader = getattr(_lora_pipeline(), loader_name(transformer_class))
    accepts = inspect.signature(loader.lora_state_dict).parameters
    kwargs = {"return_lora_metadata": True}
    if "return_alphas" in accepts:
        kwargs["return_alphas"] = True
    out = loader.lora_state_dict(str(path), **kwargs)
    if "return_alphas" in kwargs:
        state, alphas, metadata = out
    else:
        (state, metadata), alphas = out, {}
    alphas = dict(alphas or {})
    for key in [key for key in state if key.endswith(".alpha")]:
        alphas[key] = state.pop(key)
    return state, alphas, metadata


def _pattern_value(patterns: dict[str, Any], module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matching the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)
    return float(default)


def read_lora(file: LoraFile, transformer: nn.Module) -> LoraWeights:
    """`file`'s transformer LoRA in diffusers/PEFT module names, checked against `transformer` (on the meta device
    is enough): LoraError naming the first key whose module the transformer lacks or whose shape differs."""
    kind = type(transformer).__name__
    if not takes_loras(kind):
        raise LoraError(f"LoRA {file.name}: diffusers has no LoRA loader for {kind} (no {loader_name(kind)}), so "
                        "this model takes no LoRA")
    if not file.path.is_file():
        raise LoraError(f"LoRA {file.name}: file {file.path} does not exist")
    try:
        state, alphas, metadata = _state_dict(file.path, kind)
    except Exception as error:  # diffusers' converters raise anything on a foreign file
        raise LoraError(f"LoRA {file.name}: {file.path.name} is not a LoRA diffusers reads for {kind}: "
                        f"{error}") from None
    modules = dict(transformer.named_modules())
    prefix = "transformer."
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        where = f"LoRA {file.name} ({file.path.name}) does not fit this {kind}: key {key}"
        if not key.startswith(prefix):
            raise LoraError(f"{where} is not the transformer's (only transformer LoRAs are taken)")
        module, part, kind_of = key[len(prefix):].rpartition(".lora_")
        if not part or kind_of not in ("A.weight", "B.weight"):
            raise LoraError(f"{where}: only lora_A / lora_B weights are taken (no DoRA, no LoRA bias)")
        layer = modules.get(module)
        if not isinstance(layer, nn.Linear):
            raise LoraError(f"{where}: the transformer has no linear layer {module}")
        want = (tensor.shape[0], layer.in_features) if kind_of == "A.weight" else (layer.out_features, tensor.shape[1])
        if tensor.dim() != 2 or tuple(tensor.shape) != want:
            raise LoraError(f"{where}: shape {tuple(tensor.shape)}, the layer {module} takes {want}")
        pairs.setdefault(module, {})[kind_of[0]] = tensor
    layers = {}
    config = metadata if isinstance(metadata, dict) else {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != pair["B"].shape[1]:
            raise LoraError(f"LoRA {file.name} ({file.path.name}) does not fit: key "
                            f"{prefix}{module}.lora_{'B' if 'A' in pair else 'A'}.weight is missing or of another rank")
        down, up = pair["A"].float(), pair["B"].float()
        rank = down.shape[0]
        if config.get("use_dora"):
            raise LoraError(f"LoRA {file.name}: DoRA is not supported")
        if config:  # diffusers' save_lora_weights: PEFT's config (r, lora_alpha, patterns)
            rank = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", rank))
            alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", rank))
        else:  # kohya-style network alphas (diffusers keeps them per module), else alpha = r: scale 1
            alpha = float(alphas.get(f"{prefix}{module}.alpha", rank))
        layers[module] = (down, up * (alpha / rank))
    if not layers:
        raise LoraError(f"LoRA {file.name} ({file.path.name}) holds no transformer LoRA weights")
    return LoraWeights(name=file.name, layers=layers)


def check_lora_files(files: Iterable[LoraFile], transformer_class: type[nn.Module], config: dict[str, Any]
                     ) -> list[LoraWeights]:
    """Every file read and checked against a transformer of `config` (built on the meta device); names unique."""
    files = _named_apart(files)
    if not files:
        return []
    transformer = meta_transformer(transformer_class, config)
    return [read_lora(file, transformer) for file in files]


def fitting_lora_files(files: Iterable[LoraFile], transformer_class: type[nn.Module], config: dict[str, Any]
                       ) -> tuple[list[LoraWeights], dict[str, str]]:
    """The files of `files` that fit a transformer of `config`, read (check_lora_files), and why each other does
    not (name -> message): a server of several models gives each model the LoRAs it takes."""
    files = _named_apart(files)
    if not files:
        return [], {}
    transformer = meta_transformer(transformer_class, config)
    fits, refused = [], {}
    for file in files:
        try:
            fits.append(read_lora(file, transformer))
        except LoraError as error:
            refused[file.name] = str(error)
    return fits, refused


def _named_apart(files: Iterable[LoraFile]) -> list[LoraFile]:
    """`files` as a list; LoraError unless their names differ."""
    files = list(files)
    names = [file.name for file in files]
    if len(set(names)) != len(names):
        raise LoraError(f"LoRA names must differ: {', '.join(names)}")
    return files


class LoraDelta(nn.Module):
    """One layer's LoRA term B (s * (A x)) over all the run's LoRAs (see the module docstring)."""

    def __init__(self, down: torch.Tensor, up: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        # non-persistent: not part of the model's state dict (its checkpoint stays diffusers')
        self.register_buffer("down", down, persistent=False)
        self.register_buffer("up", up, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = F.linear(x.to(self.down.dtype), self.down) * self.scales
        return F.linear(low, self.up).to(x.dtype)

    def extra_repr(self) -> str:
        return f"slots={self.down.shape[0]}, in={self.down.shape[1]}, out={self.up.shape[0]}"


class LoraLinear(nn.Linear):
    """An nn.Linear (or a column-parallel shard of one) plus its LoRA term; the base's weight and bias are the
    same tensors (torchao's FP8 ones included). Row-parallel and Fp8Linear layers take theirs inside (their `lora`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora(x)

    @classmethod
    def of(cls, base: nn.Linear, lora: LoraDelta) -> LoraLinear:
        layer = cls(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        layer.weight, layer.bias = base.weight, base.bias
        layer.lora = lora
        layer.train(base.training)
        return layer


def has_lora(layer: nn.Module) -> bool:
    """Whether `layer` carries a LoRA term (then code that uses its weight directly must call it instead)."""
    return getattr(layer, "lora", None) is not None


def lora_layout(model: nn.Module) -> dict[str, int]:
    """Each layer of `model` that carries a LoRA term and its rank slots (LoRAs loaded x r_max): what a compiled graph
    of the model depends on (engines.levers.cache's key), never the LoRAs' weights or scales, which change in place."""
    return {name: int(module.lora.down.shape[0]) for name, module in model.named_modules() if has_lora(module)}


@dataclass(eq=False)
class LoraSet:
    """The LoRAs a transformer carries and their scales (one tensor every adapted layer reads)."""

    names: tuple[str, ...]
    slots: int
    """Rank slots per LoRA in every adapted layer: r_max (3 r_max where FP8 fused q/k/v into one layer)."""
    scales: torch.Tensor
    layers: int = 0
    """How many linear layers carry the LoRA term."""

    def select(self, chosen: Iterable[tuple[str, float]]) -> None:
        """Use the LoRAs `chosen` ((name, scale) pairs) for the next calls, every other at 0: written in place."""
        values = [0.0] * len(self.names)
        for name, scale in chosen:
            if name not in self.names:
                raise LoraError(f"no LoRA {name!r} is loaded; loaded: {', '.join(self.names) or 'none'}")
            values[self.names.index(name)] = float(scale)
        vector = torch.tensor(values, dtype=self.scales.dtype).repeat_interleave(self.slots)
        self.scales.copy_(vector.to(self.scales.device))


def _target(modules: dict[str, nn.Module], name: str) -> tuple[str, int, int]:
    """The layer that computes `name`'s output here, and which of how many equal slices of its output is `name`'s:
    (name, 0, 1), or a fused projection's slice (FP8's fused q/k/v: engines.levers.fp8.FusedAway)."""
    module = modules.get(name)
    if isinstance(module, FusedAway):
        parent = name.rpartition(".")[0]
        return f"{parent}.{module.fused}" if parent else module.fused, module.part, module.parts
    if module is not None:
        return name, 0, 1
    raise LoraError(f"this transformer has no layer {name}")


def attach_loras(model: nn.Module, loras: list[LoraWeights], *, dtype: torch.dtype, split: WeightSplit | None = None,
                 tp: int = 1, rank: int = 0) -> LoraSet:
    """Give every layer of `model` that a LoRA targets its LoRA term (module docstring), in place; all scales 0.

    Args:
        model: the diffusers transformer, split for `tp` (this rank's shards) and/or FP8-quantized already.
        dtype: of the LoRA matrices and their arithmetic (the run's: bf16 on GPUs, float32 on CPUs).
        split: the model's tensor-parallel split (its family's WeightSplit for `tp`); None without tp.
    """
    device = next(model.parameters()).device
    modules = dict(model.named_modules())
    targets: dict[str, list[tuple[int, int, int, torch.Tensor, torch.Tensor]]] = {}
    for index, lora in enumerate(loras):
        for name, (down, up) in lora.layers.items():
            layer, part, count = _target(modules, name)
            targets.setdefault(layer, []).append((index, part, count, down, up))
    # a LoRA's slots in a layer: its pieces' ranks side by side (a fused layer takes one a projection in it), the same
    # in every layer
    taken = {}
    for name, parts in targets.items():
        for index, _, _, down, _ in parts:
            taken[name, index] = taken.get((name, index), 0) + down.shape[0]
    slots = max(taken.values())
    total = slots * len(loras)
    scales = torch.zeros(total, dtype=dtype, device=device)
    for name, parts in targets.items():
        base = modules[name]
        linear = split.linears.get(name) if split is not None and tp > 1 else None
        width = tp // linear.replicas if linear is not None else 1
        out_size = base.out_features * (width if linear is not None and linear.style == "column" else 1)
        in_size = base.in_features * (width if linear is not None and linear.style == "row" else 1)
        down_all = torch.zeros(total, in_size)
        up_all = torch.zeros(out_size, total)
        filled = [0] * len(loras)
        for index, part, count, down, up in parts:
            rows = slice(part * out_size // count, (part + 1) * out_size // count)
            start = index * slots + filled[index]
            filled[index] += down.shape[0]
            down_all[start:start + down.shape[0]] = down
            up_all[rows, start:start + down.shape[0]] = up
        if linear is not None and linear.style == "column":
            up_all = take(up_all, 0, linear.ranges(out_size, tp, rank))
        elif linear is not None:
            down_all = take(down_all, 1, linear.ranges(in_size, tp, rank))
        delta = LoraDelta(down_all.to(device, dtype), up_all.to(device, dtype), scales)
        if isinstance(base, (RowParallelLinear, Fp8Linear)):
            base.lora = delta
        else:
            model.set_submodule(name, LoraLinear.of(base, delta))
    return LoraSet(names=tuple(lora.name for lora in loras), slots=slots, scales=scales, layers=len(targets))


def detach_loras(model: nn.Module) -> dict[str, LoraDelta]:
    """Undo attach_loras in place: every adapted layer back to its base (the same weight and bias tensors);
    returns the LoRA terms taken off, by layer name (benchmarks.step merges them into the weights)."""
    taken = {}
    for name, module in list(model.named_modules()):
        if not has_lora(module):
            continue
        taken[name] = module.lora
        if isinstance(module, (RowParallelLinear, Fp8Linear)):
            module.lora = None
            continue
        base = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        base.weight, base.bias = module.weight, module.bias
        base.train(module.training)
        model.set_submodule(name, base)
    return taken


def export_kohya(state: dict[str, torch.Tensor], path: Path, *, alpha: float | None = None) -> Path:
    """A FLUX.1 transformer LoRA in diffusers/PEFT keys (`transformer.<module>.lora_A/B.weight`) written as kohya's
    format (`lora_unet_<block>_<layer>.lora_down/up.weight` + `.alpha`) in BFL's module names, which diffusers'
    FluxLoraLoaderMixin reads back to the same weights. `alpha`: written per module (None: its rank, scale 1);
    kohya scales by alpha / rank, so B is divided by that to keep the LoRA's effect."""
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        module, _, part = key.removeprefix("transformer.").rpartition(".lora_")
        groups.setdefault(module, {})[part[0]] = tensor
    fused: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, pair in groups.items():
        kohya, piece = _kohya_name(module)
        if piece is None:
            _put(out, kohya, pair["A"], pair["B"], alpha)
        else:
            fused.setdefault(kohya, {})[piece] = (pair["A"], pair["B"])
    for kohya, pieces in fused.items():
        # BFL's fused layers (double blocks' qkv, single blocks' linear1) take one LoRA each: the pieces' A
        # stacked and their B block-diagonal, which diffusers' converter splits back exactly (its "sparse" case)
        count = 4 if kohya.endswith("linear1") else 3
        if sorted(pieces) != list(range(count)) or len({down.shape[0] for down, _ in pieces.values()}) != 1:
            raise LoraError(f"kohya's {kohya} is one fused layer: the LoRA must target all {count} of its "
                            "projections with one rank")
        downs, ups = zip(*(pieces[index] for index in range(count)), strict=True)
        _put(out, kohya, torch.cat(downs), torch.block_diag(*ups), alpha)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in out.items()}, str(path))
    return path


def _put(out: dict[str, torch.Tensor], kohya: str, down: torch.Tensor, up: torch.Tensor, alpha: float | None) -> None:
    rank = down.shape[0]
    value = float(rank if alpha is None else alpha)
    out[f"{kohya}.lora_down.weight"] = down
    out[f"{kohya}.lora_up.weight"] = up * (rank / value)
    out[f"{kohya}.alpha"] = torch.tensor(value)


_DOUBLE = {
    "attn.to_q": ("img_attn_qkv", 0), "attn.to_k": ("img_attn_qkv", 1), "attn.to_v": ("img_attn_qkv", 2),
    "attn.add_q_proj": ("txt_attn_qkv", 0), "attn.add_k_proj": ("txt_attn_qkv", 1),
    "attn.add_v_proj": ("txt_attn_qkv", 2),
    "attn.to_out.0": ("img_attn_proj", None), "attn.to_add_out": ("txt_attn_proj", None),
    "ff.net.0.proj": ("img_mlp_0", None), "ff.net.2": ("img_mlp_2", None),
    "ff_context.net.0.proj": ("txt_mlp_0", None), "ff_context.net.2": ("txt_mlp_2", None),
    "norm1.linear": ("img_mod_lin", None), "norm1_context.linear": ("txt_mod_lin", None),
}
_SINGLE = {
    "attn.to_q": ("linear1", 0), "attn.to_k": ("linear1", 1), "attn.to_v": ("linear1", 2), "proj_mlp": ("linear1", 3),
    "proj_out": ("linear2", None), "norm.linear": ("modulation_lin", None),
}


def _kohya_name(module: str) -> tuple[str, int | None]:
    """kohya's name of a diffusers FLUX.1 block layer and its piece of a fused BFL layer (None: not fused)."""
    match = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", module)
    table = None if match is None else (_DOUBLE if match[1] == "transformer_blocks" else _SINGLE)
    if table is None or match[3] not in table:
        raise LoraError(f"no kohya name for {module} (export_kohya takes FLUX.1 block layers)")
    layer, piece = table[match[3]]
    block = "double_blocks" if match[1] == "transformer_blocks" else "single_blocks"
    return f"lora_unet_{block}_{match[2]}_{layer}", piece
