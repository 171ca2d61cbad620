"""FP8 (e4m3) matrix multiplies for a transformer's repeated blocks (`--fp8`), with torchao's recipe and numbers.

The recipe is torchao's per-row dynamic FP8 (Float8DynamicActivationFloat8WeightConfig with PerRow): the weight is
quantized once, each call's activation is quantized on the fly, and the product runs as one scaled FP8 GEMM
(torch._scaled_mm) with the output in the activation's dtype. Scales are per row: per output channel of the weight,
per token of the activation. Per-row weights are taken from bfloat16, as torchao takes them, so a float32 model's
chosen layers (CPU runs) are cast to bfloat16 first, which keeps more than e4m3 does; their activations and outputs
stay float32.

How it runs (`quantize_fp8`'s `linear`): the app's is "scaled-mm": each chosen layer becomes an Fp8Linear, its
float8 weight and float32 per-row scale plain tensors, whose forward quantizes the activation per token and calls
torch._scaled_mm itself with torchao's arguments (engines/levers/fp8_matmul.py, which RowParallelLinear calls too):
torchao's bytes and products, bit for bit (tests/test_fp8_linear.py), but torch.compile traces plain ops. "torchao"
keeps torchao's own form, its Float8Tensor subclass as the weight, for comparison: compiled, the subclass is what
makes a cold build slow (a FLUX.1-dev 1024² step on 2x H200 from an empty cache: 26 s with Fp8Linear, bf16 23 s, the
subclass over 300 s; docs/benchmarks.md), and eager, the host unwraps it at every call. This is the one place the
FP8 arithmetic is written here rather than taken from torchao: compiled engines are what this project competes on,
and the library's form compiles too slowly for them.

Which layers: the nn.Linear layers inside the family's repeated blocks (attention projections, MLPs,
FLUX's fused single-stream projections), which hold nearly all of a step's FLOPs. These stay in the
run's dtype, as every FP8 recipe for DiTs keeps them (xDiT, cache-dit, torchao's own diffusers
examples): the embedders (patch, text, timestep and guidance), the final norm and output projection
(outside the blocks) and every modulation layer (AdaLN: any layer under a module named `norm*`, and
the FLUX.2 / Cosmos 3 shared modulation outside the blocks), whose small errors scale every activation;
and layers whose sizes FP8 GEMMs cannot take (not multiples of 16).

Projections that read the same input are fused first (`fuse_shared_input_projections`, diffusers'
fuse_projections): each FP8 linear quantizes its own activation. Eager, that is one per-row maximum and one
float8 copy per projection; compiled, inductor puts them in one kernel that finds the maximum once, but it
still scales, casts and writes one float8 copy per projection (tests/test_fp8.py counts the casts), each
read by its own GEMM. Fused, an input is quantized once and multiplied in one GEMM: FLUX.1's attentions (q/k/v
of each stream) and FLUX.2's double-stream ones. FLUX.2's single-stream projection comes fused; Cosmos'
and Cosmos 3's attentions keep theirs apart (diffusers' Cosmos processor calls them one by one, Cosmos 3's
attention declares them unfusable). The result is the same: a per-row weight scale is one output
channel's, so concatenating weights before quantizing changes no scale.

The context-parallel processors call FP8 projections as modules (an Fp8Linear; torchao's form also through F.linear
on their weights, which Float8Tensor dispatches). Each token's activation scale covers its whole row, as in one
process, so the context-parallel code never splits an FP8 projection by input columns (FLUX.1's overlapped single
blocks run proj_out whole under FP8).

With tensor parallelism (--tp) the model is split first (loaded split, engines/weights/sharded_loading.py) and each rank
quantizes its shards, with the scales one process uses, so the GEMMs' FP8 inputs are one process's, bit for bit:
- a column-parallel shard keeps whole output rows: its per-row weight scales are one process's as they come,
  and its activation is the whole, replicated one;
- a row-parallel shard keeps its input columns of every row (RowParallelLinear): its weight scales come from each
  row's absolute maximum over all the shards (one all-reduce of the per-row maxima over the run's group when the
  model is quantized: `quantize_fp8(..., group=)`), and each call's activation scales from each token's maximum
  over all the tp ranks' columns (one all-reduce of one number a token: scaled_mm_linear's `group_name`), which the
  layer quantizes itself before its partial GEMM. The layer stays a RowParallelLinear: its weight becomes float8 with a
  `weight_scale` beside it. The partial products are then summed as without FP8.
Quantizing whole and splitting the FP8 tensor would give the same bytes, but the ranks load only their shards.
A split model's projections stay unfused: the families' splits name them (and FLUX.2's refuses fused ones), so
under tp each q/k/v projection quantizes its input apart, the same values at the cost of the extra casts.

is_fp8 and fp8_layers see both forms. A LoRA term (engines.weights.lora) rides on an Fp8Linear (its `lora`), beside the
FP8 GEMM in the run's dtype, as on a RowParallelLinear.

torchao refuses to quantize unless a GPU with FP8 GEMMs (CUDA compute capability 8.9+, MI300, XPU) is present;
torch 2.13's _scaled_mm also runs float8 on CPUs, so for CPU models that check is skipped and the CPU tests run the
same code path as the GPUs.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from engines.import_noise import quiet_torchao_import  # its users import it from here too
from engines.levers.fp8_matmul import ACTIVATION_AMAX_FLOOR, quantize_rows, scaled_mm_linear
from engines.parallel.tensor_parallel import RowParallelLinear

FP8_MULTIPLE = 16
"""FP8 GEMMs (torch._scaled_mm) need both dimensions of the weight to be multiples of this."""


def fp8_linear_names(model: nn.Module, repeated_blocks: Iterable[str]) -> list[str]:
    """The qualified names of the nn.Linear layers `quantize_fp8` converts: in the repeated blocks, not
    under a norm (modulation), sizes FP8 GEMMs take."""
    prefixes = tuple(f"{name}." for name in repeated_blocks)
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not name.startswith(prefixes):
            continue
        if any(part.startswith("norm") for part in name.split(".")):
            continue
        if module.in_features % FP8_MULTIPLE or module.out_features % FP8_MULTIPLE:
            continue
        names.append(name)
    return names


def fuse_shared_input_projections(model: nn.Module, repeated_blocks: Iterable[str]) -> int:
    """Fuse the q/k/v projections of every attention in the repeated blocks that supports it (diffusers'
    fuse_projections: to_qkv, and to_added_qkv for the text stream; a cross-attention's to_kv and to_added_kv,
    its query projection kept, Wan's) and put a weightless FusedAway where each projection it replaces was: nothing
    calls those once fused, and they would hold a second copy of the weights (so this is not undone); returns how
    many attentions were fused."""
    from diffusers.models.attention import AttentionModuleMixin

    prefixes = tuple(f"{name}." for name in repeated_blocks)
    attentions = [module for name, module in model.named_modules()
                  if name.startswith(prefixes) and isinstance(module, AttentionModuleMixin)
                  and module._supports_qkv_fusion and not module.fused_projections]
    for attn in attentions:
        attn.fuse_projections()
        for fused, parts in FUSED_PROJECTIONS.items():
            if getattr(attn, fused, None) is not None:
                for part, name in enumerate(parts):
                    if isinstance(getattr(attn, name, None), nn.Linear):
                        setattr(attn, name, FusedAway(fused, part, len(parts)))
    return len(attentions)


FUSED_PROJECTIONS = {"to_qkv": ("to_q", "to_k", "to_v"), "to_kv": ("to_k", "to_v"),
                     "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
                     "to_added_kv": ("add_k_proj", "add_v_proj")}
"""A fused projection of diffusers' fuse_projections -> the separate ones it replaces, in its output's order."""


class FusedAway(nn.Module):
    """Where a projection was before fuse_shared_input_projections folded it into `fused` (the `part`-th of its
    `parts` equal slices of the output). It holds no weight and is never called, but it is not None: diffusers'
    Wan processor tells an image-to-video attention by `attn.add_k_proj is not None`, and a LoRA for the projection
    finds its slice of the fused layer through it (engines.weights.lora)."""

    def __init__(self, fused: str, part: int, parts: int) -> None:
        super().__init__()
        self.fused, self.part, self.parts = fused, part, parts

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"this projection is fused into {self.fused}: call that instead")

    def extra_repr(self) -> str:
        return f"{self.fused}, part {self.part} of {self.parts}"


FP8_LINEARS = ("scaled-mm", "torchao")
"""quantize_fp8's `linear` choices: Fp8Linear modules (plain float8 weights and scales, torch._scaled_mm called
directly; the app's), or torchao's Float8Tensor weights (the same numbers, a tensor subclass to trace)."""


def quantize_fp8(model: nn.Module, repeated_blocks: Iterable[str], *, fuse: bool = True,
                 group: dist.ProcessGroup | None = None, linear: str = "scaled-mm") -> int:
    """Convert `model`'s block linears (fp8_linear_names) to FP8 in place, after fusing the projections
    that share an input (fuse_shared_input_projections) unless `fuse` is False or the model is split by tensor
    parallelism; returns how many.

    Args:
        group: for a model split by tensor parallelism, a process group whose ranks together hold every shard
            (the run's group; collective over it): its row-parallel layers get each row's scale over the whole
            row (see the module docstring). Not needed for a model that is not split.
        linear: "scaled-mm" (each chosen layer replaced by an Fp8Linear, a row-parallel one given a float8 weight and
            its scale) or "torchao" (Float8Tensor weights): the same float8 weights, scales and products.
    """
    if linear not in FP8_LINEARS:
        raise ValueError(f"linear={linear!r}: one of {FP8_LINEARS}")
    if linear == "scaled-mm":
        return _quantize_scaled_mm(model, repeated_blocks, fuse=fuse, group=group)
    quiet_torchao_import()
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    if any(isinstance(module, RowParallelLinear) for module in model.modules()):
        raise ValueError('quantize_fp8(..., linear="torchao") is kept for comparison on models not split by tensor '
                         'parallelism; a split model takes the default form (its row-parallel layers quantize their '
                         'inputs over whole rows: scaled_mm_linear with group_name)')
    if fuse:
        fuse_shared_input_projections(model, repeated_blocks)
    chosen = set(fp8_linear_names(model, repeated_blocks))
    if not chosen:
        return 0
    for name in chosen:
        model.get_submodule(name).to(torch.bfloat16)
    # A row of zeros (Cosmos zeroes its padded prompt tokens; sequence shards are zero-padded) has amax 0: without
    # a floor its scale is 0 and the row quantizes to 0/0 = NaN. With one it quantizes to zeros, exactly.
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), activation_value_lb=ACTIVATION_AMAX_FLOOR)
    with _cpu_allowed(next(model.parameters()).device):
        quantize_(model, config, filter_fn=lambda module, name: name in chosen)
    return len(chosen)


def _whole_row_maxima(layers: list[nn.Linear], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Each row-parallel layer's rows' absolute maxima over the whole rows (all the shards' columns), float32 [out]:
    one all-reduce (max) of all the layers' maxima over `group`."""
    if group is None:
        raise ValueError("this model is split by tensor parallelism: quantizing it to FP8 needs its process group "
                         "(quantize_fp8(..., group=)), over which each row's scale is taken from the whole row")
    # float32 holds every bfloat16 value exactly, and gloo reduces float32 on any build
    maxima = torch.cat([layer.weight.detach().abs().amax(dim=1) for layer in layers]).float()
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    return list(maxima.split([layer.out_features for layer in layers]))


def _scale_of(row_max: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    """torchao's per-row float8 scale (its own function, dtype and `floor`) of rows whose absolute maximum is
    `row_max` (shape [..., 1]): found from two columns that hold it (one column would be reduced whole)."""
    from torchao.quantization.quant_primitives import _choose_scale_float8

    rows = torch.cat([row_max, row_max], dim=-1)
    return _choose_scale_float8(rows, block_size=[1] * (rows.dim() - 1) + [2], hp_value_lb=floor)


def is_fp8(weight: torch.Tensor) -> bool:
    """Whether `weight` is an FP8 weight made by quantize_fp8 (a Float8Tensor, or an Fp8Linear's float8 one)."""
    if weight.dtype == torch.float8_e4m3fn:
        return True
    if "torchao" not in sys.modules:
        return False
    from torchao.quantization import Float8Tensor

    return isinstance(weight, Float8Tensor)


def fp8_form(model: nn.Module) -> str | None:
    """Which of FP8_LINEARS made `model`'s FP8 weights (None for a model run in its own dtype): engines.levers.cache
    keys compiled artifacts by it, since the two forms trace to different graphs."""
    for weight in model.parameters():
        if weight.dtype == torch.float8_e4m3fn:
            return "scaled-mm"
        if is_fp8(weight):  # a Float8Tensor reports its high-precision dtype
            return "torchao"
    return None


def fp8_layers(model: nn.Module) -> int:
    """How many of `model`'s weights are FP8 (0 for a model run in its own dtype)."""
    return sum(is_fp8(p) for p in model.parameters())  # is_fp8 imports nothing: torchao's import costs seconds


class _cpu_allowed:
    """Within: torchao's hardware check passes for CPU models (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = device.type == "cpu"

    def __enter__(self) -> None:
        if self.cpu:
            import torchao.quantization.quant_api as quant_api

            self._check = quant_api._check_hardware_support
            quant_api._check_hardware_support = lambda granularity: None

    def __exit__(self, *exc: object) -> None:
        if self.cpu:
            import torchao.quantization.quant_api as quant_api

            quant_api._check_hardware_support = self._check


class Fp8Linear(nn.Module):
    """An nn.Linear in FP8 as plain tensors (quantize_fp8): `weight`, float8_e4m3fn [out, in] (a frozen parameter,
    so fp8_layers counts it), `weight_scale`, its float32 per-row scale [out, 1] (a buffer), and the bias in its
    high-precision dtype. Forward: scaled_mm_linear, the numbers of torchao's per-row Float8Tensor linear
    (tests/test_fp8_linear.py), but a compiler traces plain ops, no tensor subclass; plus its LoRA term where
    engines.weights.lora attached one (`lora`), from the unquantized input."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.lora: nn.Module | None = None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear`'s weight quantized per output row as torchao quantizes a bfloat16 weight (no floor), from
        bfloat16 (a float32 layer is cast first, as quantize_fp8 does); its bias in bfloat16."""
        weight, scale = quantize_rows(linear.weight.detach().to(torch.bfloat16))
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        return cls(weight, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = scaled_mm_linear(x, self.weight, self.weight_scale, self.bias)
        return out if self.lora is None else out + self.lora(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _quantize_scaled_mm(model: nn.Module, repeated_blocks: Iterable[str], *, fuse: bool,
                        group: dist.ProcessGroup | None) -> int:
    """quantize_fp8(..., linear="scaled-mm"): the chosen layers (after fusing, as the torchao form, unless the model is
    split) replaced by Fp8Linear modules, except row-parallel shards, which keep their module and get a float8 weight
    with the whole rows' scales (`weight_scale`; module docstring); returns how many."""
    split = any(isinstance(module, RowParallelLinear) for module in model.modules())
    if fuse and not split:  # a split model keeps them apart: its family's split names them (module docstring)
        fuse_shared_input_projections(model, repeated_blocks)
    chosen = {name: model.get_submodule(name) for name in fp8_linear_names(model, repeated_blocks)}
    rows = [layer for layer in chosen.values() if isinstance(layer, RowParallelLinear)]
    for layer in rows:
        layer.to(torch.bfloat16)  # the weight is quantized from bfloat16, as torchao takes it; the bias stays so
    for layer, row_max in zip(rows, _whole_row_maxima(rows, group) if rows else [], strict=True):
        weight, scale = quantize_rows(layer.weight.detach(), row_max=row_max.to(torch.bfloat16)[:, None])
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.register_buffer("weight_scale", scale)
    for name, layer in chosen.items():
        if not isinstance(layer, RowParallelLinear):
            model.set_submodule(name, Fp8Linear.from_linear(layer))
    return len(chosen)
