"""engines.distributed's cuBLAS setting: no workspace on GPUs, unless the user chose one."""

from __future__ import annotations

import os

import pytest

from engines.distributed import CUBLAS_WITHOUT_WORKSPACE, init_parallel, use_cublas_without_workspace


def test_cublas_without_workspace_when_unset() -> None:
    environ = {"PATH": "/usr/bin"}
    assert use_cublas_without_workspace(environ)
    assert environ == {"PATH": "/usr/bin", "CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


@pytest.mark.parametrize("name", sorted(CUBLAS_WITHOUT_WORKSPACE))
def test_users_cublas_setting_is_kept(name: str) -> None:
    environ = {name: "1024"}  # the user's own choice of either variable leaves both as they are
    assert not use_cublas_without_workspace(environ)
    assert environ == {name: "1024"}


def test_cpu_run_leaves_cublas_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", *CUBLAS_WITHOUT_WORKSPACE):
        monkeypatch.delenv(name, raising=False)
    ctx = init_parallel("cpu")
    assert not ctx.is_distributed
    assert not any(name in os.environ for name in CUBLAS_WITHOUT_WORKSPACE)
