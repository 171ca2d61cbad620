"""`bench` refuses what this machine cannot run before any rank starts (benchmarks/preflight.py): one line on stderr,
exit status 2, in about the time its checks take (no rank, no weights)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

# Imported before the timed calls, which then time the checks alone.
import benchmarks.generation
import benchmarks.step  # noqa: F401 - imported early for the reason above
from benchmarks.cli import main
from benchmarks.preflight import available_memory, weights_bytes

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA refuses")


def refused(capsys: pytest.CaptureFixture[str], out: Path, *args: str) -> tuple[int, str, float]:
    """`bench --out OUT ARGS...` in this process: its exit status, its stderr and its seconds."""
    start = time.monotonic()
    status = main(["--out", str(out), *args])
    seconds = time.monotonic() - start
    return status, capsys.readouterr().err, seconds


@pytest.mark.parametrize("refusal, args", [
    ("inductor-blocks+cudagraph needs CUDA", ["--backends", "eager,inductor-blocks+cudagraph"]),
    ("tensorrt needs CUDA", ["--backends", "tensorrt"]),
    ("--all-to-all copy-engine needs CUDA", ["--all-to-all", "nccl,copy-engine"]),
])
def test_a_cuda_only_option_without_cuda(capsys, tmp_path: Path, refusal: str, args: list[str]) -> None:
    """The README's example on a CPU machine: refused at once, whatever the model's size."""
    status, stderr, seconds = refused(capsys, tmp_path / "bench", "--ranks", "2", "--", "--model", "flux-dev", *args)
    assert status == 2 and stderr == f"error: {refusal}, and this machine has no CUDA\n", stderr
    assert seconds < 2 and not (tmp_path / "bench").exists()  # no rank started, nothing written


def test_tiny_ranks_run_on_cpus_whatever_the_machine(capsys, tmp_path: Path) -> None:
    status, stderr, _ = refused(capsys, tmp_path / "bench", "--ranks", "2", "--tiny", "--",
                                "--backends", "inductor+cudagraph")
    assert status == 2 and "inductor+cudagraph needs CUDA" in stderr, stderr


@pytest.mark.parametrize("end_to_end, dtype", [(False, "bfloat16"), (True, "float32")])
def test_ranks_whose_weights_exceed_the_memory(capsys, tmp_path: Path, end_to_end: bool, dtype: str) -> None:
    """Enough ranks of FLUX.1-dev that their random weights (bf16 for one forward, float32 for whole generations on
    CPUs, with the text encoders and VAE) exceed this machine's memory: the estimate and what is available."""
    one_rank = weights_bytes("flux-dev", ranks=1, dtype=getattr(torch, dtype), end_to_end=end_to_end)
    ranks = max(2, math.ceil(available_memory() / one_rank) + 1)
    need = weights_bytes("flux-dev", ranks=ranks, dtype=getattr(torch, dtype), end_to_end=end_to_end)
    e2e = ["--end-to-end"] if end_to_end else []
    status, stderr, seconds = refused(capsys, tmp_path / "bench", "--ranks", str(ranks), *e2e, "--",
                                      "--model", "flux-dev")
    assert status == 2 and stderr.count("\n") == 1, stderr
    assert (f"error: flux-dev on {ranks} ranks on CPUs needs at least {need / 1e9:.1f} GB of random {dtype} weights, "
            "more than the ") in stderr and " GB of memory available here" in stderr, stderr
    assert seconds < 2 and not (tmp_path / "bench").exists()
    assert need > 1.9 * 12e9 * ranks  # FLUX.1-dev's 12B parameters at 2 bytes or more, on every rank


def test_the_benchmark_s_own_checks_come_first(tmp_path: Path) -> None:
    """A bad benchmark option is argparse's usage error (status 2) here, not in every rank."""
    with pytest.raises(SystemExit) as stopped:
        main(["--out", str(tmp_path / "bench"), "--ranks", "3", "--tiny", "--", "--tp", "2"])
    assert stopped.value.code == 2 and not (tmp_path / "bench").exists()
