"""app.commands.torchrun: torchrun's exit status and failure report, from a process that ends at once, and no log
folder left behind however it ends."""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from app.commands import torchrun
from app.commands.launch import LaunchError, _kill_job, check_hosts
from app.commands.torchrun import remove_ended_logs
from tests.helpers import REPO, free_port, private_tmp, torchrun_log_folders

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
    return [sys.executable, "-m", "app.commands.torchrun", "--nproc-per-node=2", "--nnodes=1", "--max-restarts=0",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script), outcome]


def _torchrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.commands.torchrun", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.parametrize("outcome", ["pass", "fail"])
def test_exit_status_and_failure_report(tmp_path, outcome):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    tmp, env = private_tmp(tmp_path)
    done = subprocess.run(_torchrun_args(script, outcome), cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env)
    assert torchrun_log_folders(tmp) == []  # torchrun's log folder (the ranks' error files) went with it
    if outcome == "pass":
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("done") == 2, done.stdout
    else:
        assert done.returncode == 1, done.stderr
        # torchrun's table names the rank that failed first and how; no Python traceback around it
        assert "Root Cause (first observed failure)" in done.stderr and "Signal 9 (SIGKILL)" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("hosts", [1, 2])
def test_a_rendezvous_port_taken_by_another_program(tmp_path, hosts):
    """On one host the ranks meet on another free port; on several, host 0 says that the user's port is taken."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _torchrun(f"--nproc-per-node={3 - hosts}", f"--nnodes={hosts}", "--node-rank=0", "--max-restarts=0",
                         "--master-addr=127.0.0.1", f"--master-port={port}", str(script), "pass")
    if hosts == 1:
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("done") == 2, done.stdout
    else:
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().splitlines()[-1] == (
            f"error: the rendezvous port {port} is taken on this host by another program: give --rdzv-endpoint a "
            "port that is free here"), done.stderr


def test_the_rendezvous_port_is_never_the_port_serve_listens_on(monkeypatch):
    """Both are chosen free before either is bound: a launch on one host takes its rendezvous port elsewhere (in
    torchrun's retry too), and one on several hosts refuses --rdzv-endpoint on serve's --port."""
    serve = free_port()
    first = iter([serve])
    monkeypatch.setattr(torchrun.random, "randrange", lambda low, high: next(first, random.randint(low, high - 1)))
    one_host = argparse.Namespace(nnodes=1, node_rank=0)
    assert check_hosts(one_host, argparse.Namespace(command="serve", port=serve), 2)[1] != serve
    first = iter([serve])
    assert torchrun.free_port() == serve  # what the launcher took before it avoided serve's port
    argv = ["--nproc-per-node=2", "-m", "app", "serve", "--model", "tiny-flux"]
    assert [torchrun._serve_port(argv + option) for option in (["--port", "8000"], ["--port=8001"], [])] == [
        8000, 8001, None]
    assert torchrun._serve_port(["--nproc-per-node=2", "-m", "app", "batch", "--port", "8000"]) is None
    two_hosts = argparse.Namespace(nnodes=2, node_rank=0, rdzv_endpoint=f"10.0.0.1:{serve}")
    with pytest.raises(LaunchError, match=f"port {serve} is the one serve listens on"):
        check_hosts(two_hosts, argparse.Namespace(command="serve", port=serve), 2)


def test_a_bad_command_line_gets_argparse_status():
    done = _torchrun("--no-such-option", "script.py")
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-option" in done.stderr, done.stderr


def _start_waiting_ranks(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """torchrun in a session of its own (as the launcher starts it), once both its ranks run."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    tmp, env = private_tmp(tmp_path)
    torchrun = subprocess.Popen(_torchrun_args(script, "wait"), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    waiting = [torchrun.stdout.readline() for _ in range(2)]
    assert all("waiting" in line for line in waiting), waiting
    assert len(torchrun_log_folders(tmp)) == 1  # while it runs, torchrun has its log folder
    return torchrun, tmp


def test_an_interrupted_torchrun_leaves_no_log_folder(tmp_path):
    torchrun, tmp = _start_waiting_ranks(tmp_path)
    os.killpg(torchrun.pid, signal.SIGINT)  # Ctrl-C in a terminal: torchrun's process group
    assert torchrun.wait(timeout=60) != 0
    assert torchrun_log_folders(tmp) == []


def test_the_launcher_removes_the_log_folder_of_a_torchrun_killed_outright(tmp_path, monkeypatch):
    torchrun, tmp = _start_waiting_ranks(tmp_path)
    _kill_job(torchrun.pid)  # the launcher's second Ctrl-C, or ranks that outlived a dead one
    torchrun.wait(timeout=30)
    assert len(torchrun_log_folders(tmp)) == 1  # SIGKILL: nothing in torchrun ran to remove it
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # the launcher's temporary folder, as TMPDIR made it
    remove_ended_logs()
    assert torchrun_log_folders(tmp) == []


def test_a_cached_generate_on_two_ranks_ends_within_3_s_of_its_image(tmp_path):
    """`launch --nproc 2 generate --cache`: the command ends within 3 s of the line that says its image is written
    (on GPUs it used to sit in the process group's teardown; here the whole path to the exit is timed)."""
    out = tmp_path / "x.png"
    process = subprocess.Popen([sys.executable, "-m", "app", "launch", "--nproc", "2", "generate",
                                "--model", "tiny-flux", "--prompt", "a big red circle", "--size", "64x64",
                                "--steps", "4", "--cache", "fbcache", "--out", str(out)],
                               cwd=REPO, stderr=subprocess.PIPE, text=True)
    wrote = None
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith("wrote "):
            wrote = time.monotonic()
    status = process.wait(timeout=60)
    ended = time.monotonic()
    assert status == 0, "".join(lines)
    assert wrote is not None and out.stat().st_size > 0, "".join(lines)
    assert ended - wrote <= 3.0, f"ended {ended - wrote:.1f} s after its image:\n{''.join(lines)}"
