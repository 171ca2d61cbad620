"""What many tests share: free ports, spawned gloo ranks, tiny transformers and their inputs.

free_port is the launcher's own (app.commands.torchrun): one way to find a free port.

    def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
        join_ranks(rank, world_size, port)        # torchrun's variables, one CPU thread
        ctx = init_parallel("cpu")
        ...

    spawn_ranks(_worker, 2, str(tmp_path))        # _worker(rank, 2, <free port>, str(tmp_path)) on 2 processes
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from app.commands.torchrun import free_port

__all__ = ["run_app", "COSMOS_TINY", "FLUX_TINY", "IMPORT_NOISE", "import_noise", "private_tmp", "torchrun_log_folders",
           "cosmos3_inputs", "tiny_cosmos3", "PYTHON", "REPO", "cosmos_inputs", "flux_inputs", "free_port",
           "join_ranks", "parallelize", "randomize", "spawn_ranks", "tiny_cosmos", "tiny_flux", "torchrun"]

REPO = Path(__file__).resolve().parent.parent

IMPORT_NOISE = ("_C_mxfp8", "_C_cutlass", "Failed to load", "KernelPreference", "is an Enum subclass",
                "Unable to import `torchao`")
"""What torchao's import (by diffusers and transformers, --fp8 or not) printed on every run: it reads like a
broken install and concerns no run of this app (engines.levers.fp8.quiet_torchao_import)."""


def import_noise(stderr: str) -> list[str]:
    """The IMPORT_NOISE pieces found in a run's `stderr`: none on a clean run."""
    return [noise for noise in IMPORT_NOISE if noise in stderr]


def private_tmp(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A temporary folder of the test's own (no other process writes there) and the environment naming it (TMPDIR),
    for the processes a test starts."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    return folder, {**os.environ, "TMPDIR": str(folder)}


def torchrun_log_folders(folder: Path) -> list[str]:
    """The torchrun log folders in `folder`: plain torchrun's torchelastic_*, app.commands.torchrun's while it runs."""
    from app.commands.torchrun import LOGS_PREFIX

    return sorted(path.name for path in folder.iterdir() if path.name.startswith(("torchelastic_", LOGS_PREFIX)))


def tiny_cosmos_frames_problem(frames: int) -> str:
    """The request error for a frame count tiny-cosmos cannot make, from its VAE's temporal compression."""
    import json

    vae = json.loads((REPO / "assets" / "tiny-cosmos" / "vae" / "config.json").read_text())
    transformer = json.loads((REPO / "assets" / "tiny-cosmos" / "transformer" / "config.json").read_text())
    factor = 2 ** sum(vae["temperal_downsample"])
    most = (transformer["max_size"][0] - 1) * factor + 1
    below = 1 + (frames - 1) // factor * factor
    return (f"frames {frames} is not 1 + a multiple of {factor}, which this model needs; use {below} or "
            f"{below + factor} (1 + a multiple of {factor}, from 1 to {most})")
PYTHON = sys.executable

# Tiny transformer configs: 6 heads (divisible by 2 and 3), token counts chosen by each test.
FLUX_TINY = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=6,
    joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)
COSMOS_TINY = dict(
    in_channels=4 + 1, out_channels=4, num_attention_heads=6, attention_head_dim=12, num_layers=2, mlp_ratio=2.0,
    text_embed_dim=16, adaln_lora_dim=8, max_size=(16, 32, 32), patch_size=(1, 2, 2), concat_padding_mask=True,
    extra_pos_embed_type=None, rope_scale=(1.0, 3.0, 3.0),
)


def join_ranks(rank: int, world_size: int, port: int) -> None:
    """In a spawned rank: the environment torchrun would give it (all ranks on this host), one CPU thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)


# What every spawned rank imports, imported once: ranks are forked from a server process that holds these
# (multiprocessing's "forkserver"), so a rank starts in milliseconds where a fresh interpreter takes 6-8 s
# on the 2-core test machine to import torch, diffusers and transformers.
RANK_PRELOAD = ["tests.helpers", "diffusers", "transformers", "engines.parallel.parallelize", "engines.levers.compile",
                "pipelines.flux.pipeline", "pipelines.cosmos.pipeline", "app.ranks.runtime"]


def _rank_main(rank: int, environ: dict[str, str], worker: Callable[..., None], *args: Any) -> None:
    """A forked rank: the caller's environment as it is now (the server process holds the one it started
    with), then the worker."""
    os.environ.clear()
    os.environ.update(environ)
    worker(rank, *args)


def spawn_ranks(worker: Callable[..., None], world_size: int, *args: Any, tries: int = 3) -> None:
    """Run worker(rank, world_size, port, *args) on `world_size` processes; raise if any fails. A free port can
    be taken by a test running beside this one before rank 0 listens on it (seen in CI: EADDRINUSE in
    init_process_group, before any work): then the ranks start again on another port, up to `tries` times."""
    mp.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    for attempt in range(tries):
        try:
            mp.start_processes(_rank_main, args=(dict(os.environ), worker, world_size, free_port(), *args),
                               nprocs=world_size, join=True, start_method="forkserver")
            return
        except mp.ProcessRaisedException as error:
            if "EADDRINUSE" not in str(error) or attempt == tries - 1:
                raise


def run_app(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m app ARGS...` from the repository root, its output captured."""
    return subprocess.run([PYTHON, "-m", "app", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def torchrun(world_size: int, *args: str) -> list[str]:
    """The command line of torchrun on `world_size` local ranks and a free port: app.commands.torchrun's, which removes
    its log folder when it ends (plain torchrun leaves a torchelastic_* folder in the temporary folder per run)."""
    return [PYTHON, "-m", "app.commands.torchrun", "--nproc-per-node", str(world_size), "--master-addr",
            "127.0.0.1", "--master-port", str(free_port()), *args]


def tiny_flux() -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(**FLUX_TINY)


def tiny_cosmos() -> torch.nn.Module:
    from diffusers import CosmosTransformer3DModel

    # diffusers' own forward is the reference, so no padding-mask concat (it needs torchvision);
    # the learnable position embedding is on to test its sharding.
    return CosmosTransformer3DModel(**{**COSMOS_TINY, "concat_padding_mask": False,
                                       "extra_pos_embed_type": "learnable"})


def tiny_cosmos3(**overrides: Any) -> torch.nn.Module:
    from diffusers import Cosmos3OmniTransformer

    from pipelines.cosmos3.tiny import COSMOS3_TINY_TRANSFORMER

    return Cosmos3OmniTransformer(**{**COSMOS3_TINY_TRANSFORMER, **overrides})


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    """Random values in every parameter: diffusers zero-initialises some (pos-emb, gates), random values test more."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


def flux_inputs(image_tokens: tuple[int, int], text_tokens: int, batch: int = 2) -> dict:
    h, w = image_tokens
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return dict(
        hidden_states=torch.randn(batch, h * w, 16),
        encoder_hidden_states=torch.randn(batch, text_tokens, 32),
        pooled_projections=torch.randn(batch, 32),
        timestep=torch.rand(batch),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(text_tokens, 3),
        guidance=torch.full((batch,), 3.5),
        return_dict=False,
    )


def cosmos_inputs(grid: tuple[int, int, int], batch: int = 2) -> dict:
    t, h, w = grid
    return dict(
        hidden_states=torch.randn(batch, 4, t, 2 * h, 2 * w),
        timestep=torch.rand(batch, 1, t, 1, 1),
        encoder_hidden_states=torch.randn(batch, 7, 16),
        fps=24,
        condition_mask=torch.rand(batch, 1, t, 2 * h, 2 * w),
        attention_mask=torch.ones(batch, 7),
        return_dict=False,
    )


def parallelize(model: torch.nn.Module, ctx: Any, plan: Any = None, *, all_to_all: str = "nccl") -> Any:
    """parallelize_transformer with the adapter of the registered family whose transformer `model` is."""
    from engines.parallel.parallelize import parallelize_transformer
    from pipelines.family import load
    from pipelines.registry import FAMILIES

    family = next(f for f in FAMILIES.values() if isinstance(model, load(f.transformer)))
    return parallelize_transformer(model, ctx, plan, load(family.parallelize), all_to_all=all_to_all)


def cosmos3_inputs(model: torch.nn.Module, text_tokens: int, latent_grid: tuple[int, int, int], *,
                   image_condition: bool = False) -> dict:
    """Keyword arguments of one Cosmos3OmniTransformer call (pipelines.cosmos3.inputs.cosmos3_call):
    `text_tokens` random prompt tokens, then random latents of (frames, height, width); with image_condition
    the first latent frame is clean (image-to-video)."""
    from pipelines.cosmos3.inputs import cosmos3_call

    ids = torch.randint(model.config.vocab_size, (text_tokens,)).tolist()
    latents = torch.randn(1, model.config.latent_channel, *latent_grid)
    return cosmos3_call(model.config, ids, latents, image_condition=image_condition, timestep=700.0)
