"""What a bench command line cannot run on this machine, found before any rank starts (benchmarks.cli).

Without these checks a run that cannot work still starts its ranks and takes minutes to fail, and on CPUs it takes
the machine with it: every rank of a real architecture builds the whole random transformer in host memory
(FLUX.1-dev: 12B parameters, 24 GB in bfloat16), so two ranks on a 24 GiB machine grow until one is killed. Refused:
- options only CUDA runs, where the ranks would run on CPUs (no CUDA, or --tiny, whose ranks are CPU gloo ones):
  a +cudagraph engine, the tensorrt backend, --all-to-all copy-engine;
- ranks on CPUs whose random weights, at the dtype the benchmark builds them in, exceed the memory available now.
  The count is pipelines.memory's, on the meta device (no weights made): every rank's transformer (its share with
  --tp-only), and with --end-to-end rank 0's text encoders and VAE. Activations come on top, so it is a floor.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from engines.options import EngineOptions

GB = 1e9


def cuda_only(backends: list[str], transports: list[str]) -> list[str]:
    """The options among engine labels `backends` and all-to-all `transports` that only CUDA runs."""
    engines = [(label, EngineOptions.parse(label)) for label in backends]
    found = [label for label, options in engines if options.cuda_graph or options.backend == "tensorrt"]
    return found + [f"--all-to-all {transport}" for transport in transports if transport == "copy-engine"]


def weights_bytes(model: str, *, ranks: int, dtype: torch.dtype, tp: int = 1, end_to_end: bool = False) -> int:
    """Bytes of random weights the `ranks` ranks of a benchmark of checkpoint `model` hold together, at `dtype`:
    each its transformer (its share of a split over `tp` ranks), and with `end_to_end` rank 0 the text encoders
    and VAE as well."""
    from pipelines.memory import published_rank0_components, transformer_parameters
    from pipelines.registry import family_of, get_spec

    spec = get_spec(model)
    parameters = ranks * transformer_parameters(family_of(spec), dict(spec.architecture.transformer), tp)
    if end_to_end:
        parameters += sum(published_rank0_components(spec).values())
    return parameters * dtype.itemsize


def available_memory() -> int:
    """Bytes of memory available to new processes now: /proc/meminfo's MemAvailable, within the cgroup's
    limit where one is set (a container's)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    limit, used = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    if limit.is_file() and used.is_file() and limit.read_text().strip().isdigit():
        available = min(available, int(limit.read_text()) - int(used.read_text()))
    return available


def cannot_run(options: argparse.Namespace, *, ranks: int, end_to_end: bool, cuda: bool,
               available: int) -> str | None:
    """Why the benchmark `options` (its module's parse_args) cannot run on `ranks` ranks of a machine with CUDA or
    not and `available` bytes of memory; None when nothing stands in its way here."""
    on_cpus = options.tiny or not cuda
    # benchmarks.step takes a list of transports, benchmarks.generation one
    transports = options.all_to_all if isinstance(options.all_to_all, list) else [options.all_to_all]
    needs_cuda = cuda_only(options.backends, transports)
    if on_cpus and needs_cuda:
        where = "--tiny runs its ranks on CPUs" if cuda else "this machine has no CUDA"
        return f"{', '.join(needs_cuda)} needs CUDA, and {where}"
    if not on_cpus or options.tiny:
        return None
    if end_to_end:
        from pipelines.factory import default_dtype

        dtype, tp = default_dtype("cpu"), 1
    else:
        from benchmarks.step import weights_dtype

        dtype, tp = weights_dtype(options.tiny), options.tp if options.tp_only else 1
    for model in options.models:
        try:
            need = weights_bytes(model, ranks=ranks, dtype=dtype, tp=tp, end_to_end=end_to_end)
        except ValueError:  # a --tp that does not split this model: the benchmark's own error, said by its ranks
            continue
        if need > available:
            share = f" ({tp}-way split)" if tp > 1 else ""
            return (f"{model} on {ranks} rank{'s' if ranks > 1 else ''} on CPUs needs at least {need / GB:.1f} GB of "
                    f"random {str(dtype).removeprefix('torch.')} weights{share}, more than the "
                    f"{available / GB:.1f} GB of memory available here; use GPUs, fewer --ranks or --tiny")
    return None
