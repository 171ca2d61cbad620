"""app.torchrun: torchrun's exit status and failure report, from a process that ends at once, and no log
folder left behind however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from app.launch import _kill_job
from app.torchrun import LOGS_PREFIX, remove_ended_logs
from tests.helpers import REPO, free_port

RANK_SCRIPT = """
import os, signal, sys, time
if os.environ["RANK"] == "1" and sys.argv[1] == "fail":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1] == "wait":
    print("rank", os.environ["RANK"], "waiting", flush=True)
    time.sleep(60)
print("rank", os.environ["RANK"], "done", flush=True)
"""


def _torchrun_args(script: Path, outcome: str) -> list[str]:
    return [sys.executable, "-m", "app.torchrun", "--nproc-per-node=2", "--nnodes=1", "--max-restarts=0",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script), outcome]


def _private_tmp(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A temporary folder of the test's own (no other process writes there) and the environment naming it."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    return folder, {**os.environ, "TMPDIR": str(folder)}


def _torchrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.torchrun", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)


def _log_folders(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith(("torchelastic_", LOGS_PREFIX)))


@pytest.mark.parametrize("outcome", ["pass", "fail"])
def test_exit_status_and_failure_report(tmp_path, outcome):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    tmp, env = _private_tmp(tmp_path)
    done = subprocess.run(_torchrun_args(script, outcome), cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env)
    assert _log_folders(tmp) == []  # torchrun's log folder (the ranks' error files) went with it
    if outcome == "pass":
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("done") == 2, done.stdout
    else:
        assert done.returncode == 1, done.stderr
        # torchrun's table names the rank that failed first and how; no Python traceback around it
        assert "Root Cause (first observed failure)" in done.stderr and "Signal 9 (SIGKILL)" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr


def test_a_bad_command_line_gets_argparse_status():
    done = _torchrun("--no-such-option", "script.py")
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-option" in done.stderr, done.stderr


def _start_waiting_ranks(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """torchrun in a session of its own (as the launcher starts it), once both its ranks run."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    tmp, env = _private_tmp(tmp_path)
    torchrun = subprocess.Popen(_torchrun_args(script, "wait"), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    waiting = [torchrun.stdout.readline() for _ in range(2)]
    assert all("waiting" in line for line in waiting), waiting
    assert len(_log_folders(tmp)) == 1  # while it runs, torchrun has its log folder
    return torchrun, tmp


def test_an_interrupted_torchrun_leaves_no_log_folder(tmp_path):
    torchrun, tmp = _start_waiting_ranks(tmp_path)
    os.killpg(torchrun.pid, signal.SIGINT)  # Ctrl-C in a terminal: torchrun's process group
    assert torchrun.wait(timeout=60) != 0
    assert _log_folders(tmp) == []


def test_the_launcher_removes_the_log_folder_of_a_torchrun_killed_outright(tmp_path, monkeypatch):
    torchrun, tmp = _start_waiting_ranks(tmp_path)
    _kill_job(torchrun.pid)  # the launcher's second Ctrl-C, or ranks that outlived a dead one
    torchrun.wait(timeout=30)
    assert len(_log_folders(tmp)) == 1  # SIGKILL: nothing in torchrun ran to remove it
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # the launcher's temporary folder, as TMPDIR made it
    remove_ended_logs()
    assert _log_folders(tmp) == []
