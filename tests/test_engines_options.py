"""engines.options: the run options, checked once, and the environment only entry points set."""

from __future__ import annotations

import importlib
import os
import subprocess
from pathlib import Path

import pytest

from engines.options import CUBLAS_WITHOUT_WORKSPACE, RunOptions, run_environment, set_environment
from tests.helpers import PYTHON, REPO


def test_cublas_without_workspace_and_inductor_cache_when_unset() -> None:
    environ = {"PATH": "/usr/bin"}
    applied = set_environment(run_environment(Path("/cache"), local_ranks=1), environ)
    threads = str(min(32, len(os.sched_getaffinity(0))))
    assert environ == {"PATH": "/usr/bin", "CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0",
                       "TORCHINDUCTOR_CACHE_DIR": "/cache/inductor", "TORCH_WARM_POOL": "0",
                       "TORCHINDUCTOR_COMPILE_THREADS": threads}
    assert applied == {k: v for k, v in environ.items() if k != "PATH"}


def test_compile_workers_share_the_cores_between_a_hosts_ranks() -> None:
    cores = len(os.sched_getaffinity(0))
    assert run_environment(Path("/c"), local_ranks=cores)["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert run_environment(Path("/c"), local_ranks=4 * cores)["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    environ = {"TORCHINDUCTOR_COMPILE_THREADS": "7", "TORCH_WARM_POOL": "1"}  # the user's choice stays
    set_environment(run_environment(Path("/c"), local_ranks=1), environ)
    assert environ["TORCHINDUCTOR_COMPILE_THREADS"] == "7" and environ["TORCH_WARM_POOL"] == "1"


@pytest.mark.parametrize("name", sorted(CUBLAS_WITHOUT_WORKSPACE))
def test_users_cublas_setting_is_kept(name: str) -> None:
    environ = {name: "1024"}  # the user's own choice of either variable leaves both as they are
    set_environment(dict(CUBLAS_WITHOUT_WORKSPACE), environ)
    assert environ == {name: "1024"}


def test_users_inductor_cache_is_kept() -> None:
    environ = {"TORCHINDUCTOR_CACHE_DIR": "/mine"}
    set_environment(run_environment(Path("/cache")), environ)
    assert environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine"


def test_an_inherited_default_inductor_cache_is_replaced() -> None:
    """Inductor's default folder, as a parent process that imported torch passes it on, is not a choice:
    the kernels go beside the engine cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    environ = {"TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}
    set_environment(run_environment(Path("/cache")), environ)
    assert environ["TORCHINDUCTOR_CACHE_DIR"] == "/cache/inductor"


def test_library_functions_leave_the_environment_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from engines.levers.compile import prepare_engine
    from engines.options import EngineOptions
    from engines.parallel.distributed import init_parallel
    from tests.helpers import tiny_flux

    # importing torch._dynamo fills in inductor's default cache folder: torch's doing, not ours
    importlib.import_module("torch._dynamo")

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", *CUBLAS_WITHOUT_WORKSPACE):
        monkeypatch.delenv(name, raising=False)
    before = dict(os.environ)
    assert not init_parallel("cpu").is_distributed
    prepare_engine(tiny_flux(), EngineOptions.parse("inductor-blocks"), repeated_blocks=("transformer_blocks",),
                   cache_dir=tmp_path)
    assert dict(os.environ) == before


def test_the_cli_sets_the_run_environment_before_it_runs_a_model(tmp_path: Path) -> None:
    """The entry point sets the variables (the user's own are kept): seen by a bad request, which ends
    before any model is loaded but after the environment is set."""
    env = {k: v for k, v in os.environ.items() if k not in (*CUBLAS_WITHOUT_WORKSPACE, "TORCHINDUCTOR_CACHE_DIR")}
    code = ("import os, sys\nfrom app.commands.cli import _run\n_run(sys.argv[1:])\n"
            "print(os.environ['CUBLAS_WORKSPACE_CONFIG'], os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    result = subprocess.run([PYTHON, "-c", code, "generate", "--model", "tiny-flux", "--prompt", "x", "--steps", "0",
                             "--engine-cache", str(tmp_path), "--out", str(tmp_path / "x.png")],
                            cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    assert "steps must be between" in result.stderr
    assert result.stdout.split() == [":0:0", str(tmp_path / "inductor")]


def test_run_options_are_checked_once() -> None:
    with pytest.raises(ValueError, match="unknown strategy"):
        RunOptions(strategy="spiral")
    with pytest.raises(ValueError, match="unknown all-to-all transport"):
        RunOptions(all_to_all="carrier-pigeon")
    with pytest.raises(ValueError, match="not an engine"):
        RunOptions(backend="inductor-sideways")
    assert RunOptions().engine("cpu").label == "eager"
    assert RunOptions(backend="inductor+cudagraph").engine("cpu").cuda_graph
    # GPUs replay CUDA graphs, bf16 or FP8: one a call, or one a block with the step cache deciding between them
    for fp8 in (False, True):
        assert RunOptions(fp8=fp8).engine("cuda").label == "inductor-blocks+cudagraph"
        assert RunOptions(fp8=fp8, cache="fbcache").engine("cuda").label == "inductor-blocks+blockgraph"
        assert RunOptions(fp8=fp8, cache="fbcache").engine("cpu").label == "eager"
    with pytest.raises(ValueError, match="--tp must be a positive integer"):
        RunOptions(tp=0)
    assert RunOptions(tp=2, fp8=True).fp8  # each rank quantizes its shards (engines/levers/fp8.py)
    with pytest.raises(ValueError, match="unknown --split-vae"):
        RunOptions(split_vae="sometimes")


def test_split_vae_auto_splits_video_models_only() -> None:
    """auto: the Wan decode measured faster split, FLUX's 1024² decode did not (engines.options.splits_vae)."""
    assert [RunOptions().splits_vae(media) for media in ("image", "video")] == [False, True]
    assert [RunOptions(split_vae="on").splits_vae(media) for media in ("image", "video")] == [True, True]
    assert [RunOptions(split_vae="off").splits_vae(media) for media in ("image", "video")] == [False, False]


def test_help_needs_no_torch() -> None:
    code = "import sys\nfrom app.commands.cli import build_parser\nbuild_parser()\nprint('torch' in sys.modules)"
    result = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


BYTECODE_PROBE = """
import subprocess, sys
from engines.options import bytecode_outside_sources
print(bytecode_outside_sources())
import colorsys  # a module nothing imported before: its bytecode is written now
child = "import sys; print(sys.pycache_prefix, sys.dont_write_bytecode)"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
"""


@pytest.mark.parametrize("setting", ["no bytecode", "a prefix of the user's", "bytecode allowed"])
def test_bytecode_is_kept_outside_the_sources_where_it_may_not_be_written_beside_them(tmp_path: Path,
                                                                                      setting: str) -> None:
    """PYTHONDONTWRITEBYTECODE=1 (container images set it): the bytecode goes to the app's cache folder, for this
    process and the processes it starts; a prefix the user chose, or bytecode allowed, changes nothing."""
    env = {**os.environ, "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if setting != "bytecode allowed":
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    if setting == "a prefix of the user's":
        env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "mine")
    proc = subprocess.run([PYTHON, "-c", BYTECODE_PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    returned, child = proc.stdout.strip().splitlines()
    folder = tmp_path / ".cache" / "ulysses-studio" / "bytecode"
    if setting == "no bytecode":
        assert returned == str(folder) and child == f"{folder} False"
        assert list(folder.rglob("colorsys*.pyc"))  # written there, not beside the sources
    else:
        assert returned == "None" and not folder.exists()
        prefix = str(tmp_path / "mine") if setting == "a prefix of the user's" else "None"
        assert child == f"{prefix} {setting != 'bytecode allowed'}"


def test_a_step_cache_threshold_that_is_a_number_but_not_above_0_is_refused_as_such() -> None:
    """`--cache fbcache:-0.1` is a number: the message says the threshold must be above 0, not that it must be one."""
    from engines.options import CacheOptions

    for text in ("fbcache:-0.1", "fbcache:-1", "fbcache:0e0", "fbcache:nan"):
        with pytest.raises(ValueError, match="above 0"):
            CacheOptions.parse(text)
    for text in ("fbcache:lots", "fbcache:0.1.2"):
        with pytest.raises(ValueError, match="must be a number"):
            CacheOptions.parse(text)
