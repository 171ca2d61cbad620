"""A transformer loaded split over the tp ranks straight from its safetensors files: no rank reads, or
holds, a weight that it does not keep.

The model is built with its parameters on the meta device (accelerate's init_empty_weights: no memory;
buffers computed in __init__, such as Cosmos 3's rotary frequencies, stay real), its linears are split
at their local shapes (engines.parallel.tensor_parallel.split_weights on meta tensors), and each parameter is
then read from the checkpoint: a split one as this rank's slices, through safetensors' get_slice, which
reads only those bytes of the file; a replicated one whole. So a rank's peak memory is its own share
(plus one tensor in flight), on the host and on the device.

The family's adapter (parallelize_flux, ...) later finds the model split and only hands its
row-parallel layers the tp group.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engines.parallel.tensor_parallel import WeightSplit, split_weights

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"


class SafetensorsReader:
    """The tensors of a diffusers model folder's safetensors files (one file, or several named by an
    index), read whole or by slices; every read is recorded in `reads` as (name, shape read).

    safetensors maps a file into memory and hands out tensors on the mapping; what is read here is copied
    out, and one file is open at a time (read the tensors file by file: `names()` orders them so), so the
    pages of a file leave this process once the next is opened. A slice along the input columns still
    reads every page of its rows from the file (the rows are contiguous, the slice is not)."""

    def __init__(self, folder: Path) -> None:
        folder = Path(folder)
        if (folder / INDEX).is_file():
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            self.files = {name: folder / file for name, file in weight_map.items()}
        elif (folder / WEIGHTS).is_file():
            with safe_open(folder / WEIGHTS, framework="pt") as handle:
                self.files = {name: folder / WEIGHTS for name in handle.keys()}
        else:
            raise FileNotFoundError(f"{folder} has no {WEIGHTS} (nor {INDEX}): sharded loading reads safetensors only")
        self.reads: list[tuple[str, tuple[int, ...]]] = []
        self._open: tuple[Path, Any, ExitStack] | None = None

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the open file, if any."""
        if self._open is not None:
            self._open[2].close()
            self._open = None

    def names(self, wanted: list[str]) -> list[str]:
        """`wanted` ordered file by file (the files' order), so that each file is opened once."""
        order = {path: index for index, path in enumerate(dict.fromkeys(self.files.values()))}
        return sorted(wanted, key=lambda name: order.get(self.files.get(name), -1))

    def _handle(self, name: str) -> Any:
        if name not in self.files:
            raise KeyError(f"the checkpoint has no tensor {name!r}")
        path = self.files[name]
        if self._open is None or self._open[0] != path:
            self.close()
            stack = ExitStack()
            self._open = (path, stack.enter_context(safe_open(path, framework="pt")), stack)
        return self._open[1]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor `name` (reads no data)."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def whole(self, name: str) -> torch.Tensor:
        """Tensor `name`, all of it."""
        tensor = self._handle(name).get_tensor(name).clone()  # out of the mapping
        self.reads.append((name, tuple(tensor.shape)))
        return tensor

    def slices(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """The slices `ranges` ((start, length) along `dim`) of tensor `name`, concatenated; only they are read."""
        stored = self._handle(name).get_slice(name)
        pieces = []
        for start, length in ranges:
            index = (slice(None),) * dim + (slice(start, start + length),)
            pieces.append(stored[index])
            self.reads.append((name, tuple(pieces[-1].shape)))
        return torch.cat(pieces, dim=dim)


def load_split(
    model_class: type,
    folder: Path,
    weights: Callable[[nn.Module, int], WeightSplit],
    *,
    tp: int,
    rank: int,
    dtype: torch.dtype,
    device: torch.device | str,
    reader: SafetensorsReader | None = None,
) -> nn.Module:
    """Rank `rank`'s share (of `tp`) of the diffusers transformer in `folder`, split by `weights` (its
    family's split, e.g. pipelines.flux.parallel.flux_weights), on `device` in `dtype`, in eval mode.

    `reader`: the SafetensorsReader to read through (a test passes its own to see what was read);
    default one of `folder`, closed on return.
    """
    from accelerate import init_empty_weights

    folder = Path(folder)
    with init_empty_weights():
        model = model_class.from_config(model_class.load_config(folder))
    split = weights(model, tp)
    split_weights(model, split, tp=tp, rank=rank)
    with ExitStack() as stack:
        if reader is None:
            reader = stack.enter_context(SafetensorsReader(folder))
        state = {}
        shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
        for name in reader.names(list(shapes)):
            shape, local_shape = reader.shape(name), shapes[name]
            ranges = split.parameter_ranges(name, shape, tp, rank) if tp > 1 else None
            tensor = reader.whole(name) if ranges is None else reader.slices(name, *ranges)
            if tuple(tensor.shape) != local_shape:
                raise ValueError(f"{name}: read {tuple(tensor.shape)} from the checkpoint, the model keeps "
                                 f"{local_shape} on this rank")
            state[name] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
        reader.close()
        unused = set(reader.files) - set(state)
        if unused:
            raise ValueError(f"the checkpoint holds tensors this model has no place for: {sorted(unused)[:5]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # the buffers built in __init__
    return model.eval().requires_grad_(False)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s parameters (on any device, meta included)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
