"""app.torchrun: torchrun's exit status and failure report, from a process that ends at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, free_port

RANK_SCRIPT = """
import os, signal, sys
if os.environ["RANK"] == "1" and sys.argv[1] == "fail":
    os.kill(os.getpid(), signal.SIGKILL)
print("rank", os.environ["RANK"], "done", flush=True)
"""


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app.torchrun", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("outcome", ["pass", "fail"])
def test_exit_status_and_failure_report(tmp_path, outcome):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    done = _torchrun("--nproc-per-node=2", "--nnodes=1", "--max-restarts=0", "--master-addr=127.0.0.1",
                     f"--master-port={free_port()}", str(script), outcome)
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
