"""A rank killed (SIGKILL) at a random moment of a request: the client hears why, everything exits fast.

Each try starts `launch --nproc 2 serve --model tiny-flux`, submits a 256x256 request through
gradio_client, and kills rank 1 at a seeded random moment: while encoding, after a random
denoising step, or just after the last step (decoding, the last meeting of the ranks, the file
write). Required every time: the client's error names the lost rank, the terminal shows the app's
"error: the job ends" line, and the launcher, torchrun and both ranks are gone within 5 s of the kill.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from tests.helpers import free_port
from tests.test_app_serve import START_SECONDS, AppProcess, descendants, running

TRIES = 4
SEED = 20261124
EXIT_BOUND_SECONDS = 5.0
STEPS = 40
REQUEST = ("a big red star in the center on a white background", 1, False, STEPS, 3.5, 256, 256)
"""prompt, seed, random seed, steps, guidance, width, height: 2.5 to 5 s on 2 CPU ranks."""

_end_times: list[str] = []


def _kill_moment(attempt: int, job) -> str:
    """Wait for try `attempt`'s kill moment (seeded): try 0 while encoding, 1-2 after a random step,
    3 just after the last step (decoding, the last meeting, the file write); describes it."""
    rng = random.Random(SEED + attempt)
    if attempt < 1:
        delay = rng.uniform(0.0, 0.4)
        time.sleep(delay)
        return f"{delay:.2f} s after the submit (encoding)"
    step = rng.randint(1, STEPS - 1) if attempt < 3 else STEPS
    jitter = rng.uniform(0.0, 0.03)
    started = time.monotonic()
    while max((unit.index or 0 for unit in job.status().progress_data or []), default=0) < step:
        assert not job.done(), "the request ended before its kill moment"
        assert time.monotonic() - started < 60
        time.sleep(0.005)
    time.sleep(jitter)
    return f"{jitter * 1000:.0f} ms after step {step}/{STEPS}"


@pytest.mark.parametrize("attempt", range(TRIES))
def test_a_rank_killed_during_a_request_ends_everything_within_5_s(attempt, tmp_path):
    port = free_port()
    app = AppProcess("launch", "--nproc", "2", "serve", "--model", "tiny-flux", "--port", str(port),
                     "--out", str(tmp_path))  # kept after the server ends: an answered result is checked there
    try:
        app.wait_for("serving on", START_SECONDS)
        processes = [app.process.pid, *descendants(app.process.pid)]  # launcher, torchrun, ranks
        ranks = app.rank_pids()
        assert sorted(ranks) == [0, 1]
        # the result's path on the server, not a download: a kill just after the last step ends the server
        # (as it must) before the client could fetch the file it was answered
        client = Client(f"http://127.0.0.1:{port}/", verbose=False, download_files=False)
        job = client.submit(*REQUEST, api_name="/generate_image")
        moment = _kill_moment(attempt, job)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        while any(running(pid) for pid in processes) and time.monotonic() - killed < 60:
            time.sleep(0.02)
        ended = time.monotonic() - killed
        _end_times.append(f"try {attempt}: killed {moment}, all gone {ended:.2f} s later")
        print(_end_times[-1])

        output = app.final_output()
        assert ended < EXIT_BOUND_SECONDS, output
        assert app.process.returncode != 0
        assert "error: the job ended because a rank failed" in output, output  # the launcher's own line
        try:
            answer = job.result(timeout=10)
        except AppError as error:
            assert re.search(r"lost a rank.*rank 1 is gone", str(error)), error
            assert ("error: the job ends: rank 0: another rank died or closed its connection: rank 1 is gone"
                    in output), output
        else:
            # The client sees progress late on a busy machine: a kill meant for just after the last step
            # can land after the answer. Then the answer is whole (its file written), and everything still
            # ends fast.
            assert attempt >= 3, f"killed {moment}, yet the request was answered"
            written = answer[1]
            assert Path(written["path"] if isinstance(written, dict) else written.path).parent == tmp_path
            assert Path(written["path"] if isinstance(written, dict) else written.path).is_file(), answer
    finally:
        app.stop()
        if attempt == TRIES - 1:
            print("end times after the kill:\n" + "\n".join(_end_times))


STUCK_RANK = """
import sys, time
from app.ranks.stopping import stop_on_signals

with stop_on_signals(grace=0.5) as stop:
    stop.abandon = lambda: "rank 0: told the clients"
    print("ready", flush=True)
    while True:  # busy and deaf to the stop request, like a rank stuck in a collective
        time.sleep(0.05)
"""


def test_sigterm_ends_a_stuck_process_with_its_message():
    import subprocess
    import sys

    from tests.helpers import REPO

    process = subprocess.Popen([sys.executable, "-c", STUCK_RANK], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=10)
    assert process.returncode == 1
    assert 0.5 <= time.monotonic() - started < 3
    assert err.strip() == "error: the job ends: rank 0: told the clients"


SIGNALLED = """
import sys, time
from app.ranks.stopping import stop_on_signals

try:
    with stop_on_signals() as stop:
        print("ready", flush=True)
        while not stop.is_set():
            time.sleep(0.01)
        print("stopping", flush=True)
        time.sleep(30)  # a stop that takes long: only a later signal ends it
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_copies_of_a_signal_are_one_stop_and_a_later_one_interrupts():
    """A signal sent to a process tree reaches a rank more than once (its sender, then torchrun forwarding it;
    `pkill`, a service manager stopping every process): those copies are one request to stop cleanly. A signal
    DUPLICATE_SIGNAL_SECONDS later is a second Ctrl-C, which interrupts at once."""
    import subprocess
    import sys

    from app.ranks.stopping import DUPLICATE_SIGNAL_SECONDS
    from tests.helpers import REPO

    process = subprocess.Popen([sys.executable, "-c", SIGNALLED], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):  # one stop, three copies of it
            process.send_signal(sig)
        assert process.stdout.readline().strip() == "stopping"
        time.sleep(DUPLICATE_SIGNAL_SECONDS * 0.5)
        assert process.poll() is None  # the copies did not interrupt it
        time.sleep(DUPLICATE_SIGNAL_SECONDS)
        process.send_signal(signal.SIGINT)  # a second Ctrl-C
        assert process.stdout.readline().strip() == "interrupted"
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
        process.wait()


def test_the_lost_message_names_a_killed_rank_and_claims_no_sender_for_the_sigterm():
    import socket
    import subprocess
    from types import SimpleNamespace

    from app.ranks.lockstep import LockstepService

    alive = subprocess.Popen(["sleep", "30"])
    killed = subprocess.Popen(["sleep", "30"])
    killed.kill()
    killed.wait()
    host = socket.gethostname()
    try:
        def service(peers: dict) -> LockstepService:
            return LockstepService(SimpleNamespace(rank=0, global_rank=0), {}, stop=threading.Event(), rank_timeout=1.0,
                                   rank_processes={0: (host, os.getpid()), **peers})

        message = service({1: (host, alive.pid), 2: (host, killed.pid)}).lost_message()
        assert message == ("rank 0: another rank died or closed its connection: rank 2 is gone, its process killed "
                           "or crashed (this rank was waiting for it when SIGTERM came)")
        assert "torchrun" not in message
        assert service({1: (host, alive.pid)}).lost_message() == "rank 0: stopped by SIGTERM while busy"
    finally:
        alive.kill()
        alive.wait()
