"""The launch's memory plan (app/commands/memory_plan.py, pipelines/memory.py): the smallest tp degree whose weights
fit the GPUs, given as `launch --gpu-memory` here (no GPU); a model that fits no degree is refused before
any rank starts, with the memory it would need. Counted on the meta device: no weights are read."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import PYTHON, REPO

MIB = 1024**2


def test_the_smallest_tp_that_fits_real_architectures() -> None:
    from app.commands.memory_plan import MemoryPlanError, choose_tp
    from pipelines.memory import GIB
    from pipelines.registry import get_spec

    super_ = [(get_spec("cosmos3-super"), None)]
    assert choose_tp(super_, nproc=8, gpu_bytes=80 * GIB).tp == 2  # 119 GiB whole, 61 + 1.3 at tp 2
    assert choose_tp(super_, nproc=8, gpu_bytes=40 * GIB).tp == 4
    assert choose_tp(super_, nproc=8, gpu_bytes=80 * GIB, requested=8).tp == 8
    with pytest.raises(MemoryPlanError, match=r"at --tp 8 rank 0 needs 18.8 GiB"):
        choose_tp(super_, nproc=8, gpu_bytes=10 * GIB)
    with pytest.raises(MemoryPlanError, match=r"at --tp 1 rank 0 needs 120.5 GiB"):
        choose_tp(super_, nproc=8, gpu_bytes=80 * GIB, requested=1)
    # FLUX.2-dev's 24B text encoder stays in rank 0's host memory: the transformer alone fits 80 GB at tp 1
    assert choose_tp([(get_spec("flux2-dev"), None)], nproc=2, gpu_bytes=80 * GIB).tp == 1
    with pytest.raises(MemoryPlanError, match="tp degree 3 does not divide"):
        choose_tp(super_, nproc=6, gpu_bytes=80 * GIB, requested=3)


def test_fp8_weights_count_a_byte_an_element_and_a_scale_a_row() -> None:
    """--fp8 keeps the blocks' linears resident as FP8 (1 byte an element, a float32 scale per output row of the
    rank's share) and the rest of the transformer in bfloat16."""
    import torch
    from diffusers import FluxTransformer2DModel

    from engines.levers.fp8 import fp8_linear_names
    from pipelines.memory import GIB, transformer_bytes, transformer_parameters
    from pipelines.registry import family_of, get_spec

    spec = get_spec("flux-dev")
    family, config = family_of(spec), dict(spec.architecture.transformer)
    assert transformer_bytes(family, config, 1) == 2 * transformer_parameters(family, config, 1)
    bf16, fp8 = (transformer_bytes(family, config, 1, fp8=fp8) for fp8 in (False, True))
    assert (round(bf16 / GIB, 2), round(fp8 / GIB, 2)) == (22.17, 14.16)  # 11.9B parameters, 8.6B in FP8
    with torch.device("meta"):
        model = FluxTransformer2DModel(**config)
    quantized = [model.get_submodule(name).weight for name in fp8_linear_names(model, family.repeated_blocks)]
    assert bf16 - fp8 == sum(w.numel() - 4 * w.shape[0] for w in quantized)  # 2 -> 1 byte, plus the scales


def test_launch_picks_tp_for_fp8_weights() -> None:
    """On 80 GB GPUs: Cosmos 3 Super (119 GiB in bfloat16) needs tp 2, its FP8 weights (61 GiB) fit one GPU;
    FLUX.2-dev's transformer fits one GPU either way (60.2 / 30.9 GiB on rank 0). On 32 GB: FLUX.2-dev needs
    tp 4 in bfloat16 (30.9 GiB at tp 2 is more than 85%), tp 2 in FP8 (16.3 GiB)."""
    from app.commands.memory_plan import choose_tp
    from pipelines.memory import GIB
    from pipelines.registry import get_spec

    super_, flux2 = [(get_spec("cosmos3-super"), None)], [(get_spec("flux2-dev"), None)]
    bf16, fp8 = (choose_tp(super_, nproc=8, gpu_bytes=80 * GIB, fp8=fp8) for fp8 in (False, True))
    assert (bf16.tp, fp8.tp) == (2, 1)
    assert fp8.describe() == ("--tp 1: 62.4 GiB of weights (FP8 block linears) on the fullest rank, within 85% of "
                              "80.0 GiB per GPU")
    assert [choose_tp(flux2, nproc=8, gpu_bytes=80 * GIB, fp8=fp8).rank_bytes // 2**20 for fp8 in (False, True)] == [
        61_621, 31_684]
    assert [choose_tp(flux2, nproc=8, gpu_bytes=32 * GIB, fp8=fp8).tp for fp8 in (False, True)] == [4, 2]


def test_per_rank_parameters_of_the_largest_models() -> None:
    from pipelines.memory import transformer_parameters
    from pipelines.registry import family_of, get_spec

    for name in ("cosmos3-super", "flux2-dev"):
        spec = get_spec(name)
        counts = {tp: transformer_parameters(family_of(spec), dict(spec.architecture.transformer), tp)
                  for tp in (1, 2, 4, 8)}
        # the blocks' linears split; embedders, modulation and norms (a few %) stay whole
        assert [round(counts[tp] / counts[1], 2) for tp in (2, 4, 8)] == [0.51, 0.27, 0.15], name


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "app", "launch", "--nproc", "2", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_launch_picks_tp_and_refuses_what_cannot_fit() -> None:
    """tiny-flux: 6.6 MiB of weights on rank 0 at tp 1, 5.1 MiB at tp 2 (its text encoders and VAE stay whole)."""
    from app.commands.cli import build_parser
    from app.commands.launch import plan_memory

    inner = build_parser().parse_args(["generate", "--model", "tiny-flux", "--prompt", "x", "--out", "/tmp/x.png"])
    checked = inner.check(inner)
    assert plan_memory(checked, None, 2, 1.0, cuda=False) == ["--tp", "1"]
    assert plan_memory(checked, None, 2, 7 * MIB / 1024**3, cuda=False) == ["--tp", "2"]
    assert plan_memory(checked, 2, 2, 1.0, cuda=False) == []  # given: checked, kept
    assert plan_memory(checked, None, 2, None, cuda=False) == []  # no GPU, no --gpu-memory: nothing to plan
    # --fp8: 5.1 MiB at tp 1 (its block linears in FP8), 4.3 MiB at tp 2
    assert plan_memory(checked, None, 2, 7 * MIB / 1024**3, cuda=False, fp8=True) == ["--tp", "1"]

    refused = _launch("--gpu-memory", "0.004", "generate", "--model", "tiny-flux", "--prompt", "x",
                      "--out", "/tmp/x.png")
    assert refused.returncode == 2
    assert "tiny-flux does not fit 2 GPUs of 4.1 MiB: at --tp 2 rank 0 needs 5.1 MiB" in refused.stderr
    assert "torch.distributed.run" not in refused.stderr  # refused before any rank started
    refused = _launch("--gpu-memory", "0.004", "generate", "--model", "tiny-flux", "--prompt", "x", "--fp8",
                      "--out", "/tmp/x.png")
    assert "at --tp 2 rank 0 needs 4.3 MiB of weights (FP8 block linears)" in refused.stderr


def test_only_text_encoders_larger_than_12b_stay_in_host_memory() -> None:
    from pipelines.memory import on_host

    assert on_host("text_encoder", 24_000_000_000)  # FLUX.2-dev's Mistral Small 3.1
    assert not on_host("text_encoder_2", 4_760_000_000)  # FLUX.1's T5-XXL encoder
    assert not on_host("vae", 24_000_000_000)


def test_the_memory_command_prints_per_rank_bytes_at_each_tp(capsys: pytest.CaptureFixture) -> None:
    from benchmarks.memory import main

    main(["--model", "cosmos3-super,flux2-dev", "--tp", "1,2,4,8"])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "119.2 GiB" in rows["cosmos3-super"] and "17.5 GiB" in rows["cosmos3-super"]
    assert "60.0 GiB" in rows["flux2-dev"] and "8.8 GiB" in rows["flux2-dev"]


def test_launch_checks_a_given_tp_against_the_models_heads_without_a_gpu() -> None:
    from app.commands.cli import build_parser
    from app.commands.launch import LaunchError, plan_memory

    inner = build_parser().parse_args(["generate", "--model", "tiny-flux", "--prompt", "x", "--out", "/tmp/x.png"])
    with pytest.raises(LaunchError, match="--tp 3: tp degree 3 does not divide the model's 4 attention heads"):
        plan_memory(inner.check(inner), 3, 3, None, cuda=False)


def test_a_large_text_encoder_goes_on_the_gpu_only_with_room_to_spare() -> None:
    from pipelines.memory import GIB, fits_beside

    encoder = 45 * GIB  # FLUX.2-dev's Mistral in bf16
    assert not fits_beside(encoder, free_bytes=19 * GIB, total_bytes=79 * GIB)  # beside the whole transformer
    assert fits_beside(encoder, free_bytes=62 * GIB, total_bytes=79 * GIB)  # beside its tp 4 share


def test_two_experts_count_twice() -> None:
    """Wan 2.2 A14B keeps both experts resident: its transformer weights are twice Wan 2.1 14B's (same
    architecture), its text encoder and VAE the same."""
    from app.commands.memory_plan import rank_bytes
    from pipelines.memory import transformer_bytes
    from pipelines.registry import family_of, get_spec

    one, two = get_spec("wan2.1-t2v-14b"), get_spec("wan2.2-t2v-a14b")
    expert = transformer_bytes(family_of(two), dict(two.architecture.transformer), 1)
    assert rank_bytes([(two, None)], 1) - rank_bytes([(one, None)], 1) == expert
    assert round(expert / 1024**3, 1) == 26.6  # 14.3B parameters in bfloat16
    # tp cannot split Wan's attention: the plan runs it whole (it refused every degree, tp 1 included, before)
    from app.commands.memory_plan import choose_tp
    from pipelines.memory import GIB

    assert choose_tp([(two, None)], nproc=2, gpu_bytes=141 * GIB).tp == 1


def test_a_whole_transformer_is_sized_from_its_files_as_the_model_counts_it():
    """tp 1 without FP8: the folder's safetensors headers give the bytes that building the model would."""
    from app.commands.memory_plan import _stored_transformer_parameters
    from pipelines.memory import BF16_BYTES, folder_transformer_config, transformer_bytes
    from pipelines.registry import family_of, resolve_model

    for name in ("tiny-flux", "tiny-cosmos"):
        spec, folder = resolve_model(name, None)
        stored = _stored_transformer_parameters(folder) * BF16_BYTES
        assert stored == transformer_bytes(family_of(spec), folder_transformer_config(folder), 1), name


def test_the_launchers_checks_import_neither_torch_nor_diffusers():
    """Every second before torchrun starts is a second before the first image: the launcher's checks (the request,
    the memory plan at tp 1, the GPUs) run without torch's and diffusers' imports."""
    import subprocess

    from tests.helpers import PYTHON, REPO

    script = ("import sys\n"
              "import app.commands.launch as launch\n"
              "launch._run_torchrun = lambda command, env: (0, 0)\n"
              "from app.commands.cli import main\n"
              "status = main(['launch', '--nproc', '2', '--gpu-memory', '80', 'generate', '--model', 'tiny-flux',\n"
              "               '--prompt', 'x', '--size', '64x64', '--steps', '1', '--out', 'unused.png'])\n"
              "print(status, sorted(name for name in ('torch', 'diffusers', 'transformers') if name in sys.modules))\n")
    result = subprocess.run([PYTHON, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.split("\n")[-2] == "0 []", result.stdout + result.stderr
    assert "--tp 1: 6.6 MiB of weights" in result.stderr
