"""Replica groups through the app: `launch --nproc 4 serve --replicas 2` (two ulysses-2 groups of gloo CPU
ranks), a 12-line batch on two groups interrupted and resumed, and two hosts simulated on this machine by two
`launch --nnodes 2` commands on one rendezvous. The serve module's last test kills a rank and ends the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gradio_client import Client
from PIL import Image

from tests.helpers import REPO, free_port
from tests.test_app_serve import START_SECONDS, AppProcess, descendants, running

GROUPS = ("group 1 of 2 (ranks 0-1)", "group 2 of 2 (ranks 2-3)")
DEAD_SECONDS = 5.0
"""A lost rank or host ends every process of the run within this."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    app = AppProcess("launch", "--nproc", "4", "serve", "--model", "tiny-flux", "--replicas", "2", "--port",
                     str(port), "--out", str(tmp_path_factory.mktemp("results")), "--max-request-seconds", "0")
    try:
        app.wait_for("serving on", START_SECONDS)
        app.url = f"http://127.0.0.1:{port}/"
        yield app
    finally:
        app.stop()


def _image(url: str, prompt: str, seed: int, steps: int) -> tuple:
    return Client(url, verbose=False).predict(prompt, seed, False, steps, 3.5, 64, 64, api_name="/generate_image")


def test_two_requests_run_side_by_side_on_the_two_groups_as_one_process_would(server):
    from pipelines.factory import load_pipeline
    from pipelines.registry import resolve_model
    from pipelines.requests import make_request, read_limits

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda seed: _image(server.url, "a red circle", seed, 24), (1, 2))
    (start_a, end_a), (start_b, end_b) = first[2]["ran_from"], second[2]["ran_from"]
    assert start_a < end_b and start_b < end_a, (first[2]["ran_from"], second[2]["ran_from"])
    assert {first[2]["group"], second[2]["group"]} == set(GROUPS)
    assert first[2]["plan"] == "ulysses-2, all-to-all gloo"
    assert "4 ranks in 2 groups of 2" in first[3]
    spec, folder = resolve_model("tiny-flux", None)
    pipeline = load_pipeline(spec, folder)
    for result, seed in ((first, 1), (second, 2)):
        request = make_request(spec, read_limits(spec, folder), prompt="a red circle", seed=seed, steps=24,
                               width=64, height=64)
        expected = np.asarray(pipeline.generate(request)).astype(np.int16)
        served = np.asarray(Image.open(result[1]).convert("RGB")).astype(np.int16)
        assert np.abs(served - expected).max() <= 1  # two ranks sum attention in another order than one


def test_the_status_line_names_the_busy_groups(server):
    client = Client(server.url, verbose=False)
    # long requests (400 steps: over half a minute on 2 cores), so that a loaded machine's slow /status answers
    # still see both groups busy and one waiting; cancelled once seen
    jobs = [Client(server.url, verbose=False).submit("busy", seed, False, 400, 3.5, 64, 64,
                                                     api_name="/generate_image") for seed in (3, 4, 5)]
    deadline = time.monotonic() + 60
    while True:
        status = client.predict(api_name="/status")
        if all(f"on {group}" in status for group in GROUPS) and "1 waiting" in status:
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    for job in jobs:
        job.cancel()
    while "idle" not in client.predict(api_name="/status"):  # the groups stop within two steps
        assert time.monotonic() < deadline + 30
        time.sleep(0.2)


def test_a_killed_rank_of_the_second_group_ends_every_process(server):
    client = Client(server.url, verbose=False)
    jobs = [Client(server.url, verbose=False).submit(prompt, 9, False, 400, 3.5, 64, 64, api_name="/generate_image")
            for prompt in ("a long one", "another")]
    deadline = time.monotonic() + 60
    while not all(f"on {group}" in client.predict(api_name="/status") for group in GROUPS):  # both groups busy
        assert time.monotonic() < deadline
        time.sleep(0.2)
    ranks = server.rank_pids()
    started = time.monotonic()
    os.kill(ranks[3], signal.SIGKILL)
    server.process.wait(timeout=30)
    while any(running(pid) for pid in ranks.values()):
        assert time.monotonic() - started < 30
        time.sleep(0.05)
    elapsed = time.monotonic() - started
    output = server.final_output()
    print(f"every process gone {elapsed:.2f} s after rank 3 was killed")
    assert elapsed < DEAD_SECONDS, output
    assert "rank 3 is gone" in output, output
    for job in jobs:
        assert job.done()


def test_auto_runs_a_lone_request_on_every_rank_and_a_queue_on_smaller_groups(tmp_path):
    """`--replicas auto` on 4 ranks: layouts of one group of 4, two of 2 and four of 1 (ulysses inside each)."""
    from pipelines.factory import load_pipeline
    from pipelines.registry import resolve_model
    from pipelines.requests import make_request, read_limits

    port = free_port()
    app = AppProcess("launch", "--nproc", "4", "serve", "--model", "tiny-flux", "--replicas", "auto", "--port",
                     str(port), "--out", str(tmp_path), "--max-request-seconds", "0")
    try:
        app.wait_for("serving on", START_SECONDS)
        url = f"http://127.0.0.1:{port}/"
        lone = _image(url, "a blue square", 1, 8)
        assert lone[2]["group"] == "all 4 ranks" and lone[2]["plan"].startswith("ulysses-4"), lone[2]
        # A long request holds the 4 ranks while four more arrive; then the four run on four groups of one rank.
        client = Client(url, verbose=False)
        blocker = Client(url, verbose=False).submit("a green triangle", 2, False, 120, 3.5, 64, 64,
                                                    api_name="/generate_image")
        deadline = time.monotonic() + 60
        while "on all 4 ranks" not in client.predict(api_name="/status"):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with ThreadPoolExecutor(4) as pool:
            four = list(pool.map(lambda seed: _image(url, "a red circle", seed, 12), (3, 4, 5, 6)))
        assert blocker.result(timeout=120)[2]["group"] == "all 4 ranks"
        assert sorted(result[2]["group"] for result in four) == [f"group {i} of 4 (rank {i - 1})" for i in range(1, 5)]
        assert all(result[2]["plan"] == "none (1 rank)" for result in four)
        spans = [result[2]["ran_from"] for result in four]
        assert max(start for start, _ in spans) < min(end for _, end in spans)  # all four side by side
        again = _image(url, "a blue square", 1, 8)  # the queue drained: one group again
        assert again[2]["group"] == "all 4 ranks"
        spec, folder = resolve_model("tiny-flux", None)
        pipeline = load_pipeline(spec, folder)
        for result, seed, steps in [(lone, 1, 8), *((r, s, 12) for r, s in zip(four, (3, 4, 5, 6)))]:
            request = make_request(spec, read_limits(spec, folder), prompt=result[2]["prompt"], seed=seed,
                                   steps=steps, width=64, height=64)
            expected = np.asarray(pipeline.generate(request)).astype(np.int16)
            served = np.asarray(Image.open(result[1]).convert("RGB")).astype(np.int16)
            assert np.abs(served - expected).max() <= 1
    finally:
        app.stop()


def _batch(*args: str, out: Path, prompts: Path, launch: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "app", "launch", *launch, "batch", str(prompts), "--out", str(out),
                             "--size", "64x64", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _manifest(out: Path) -> list[dict]:
    path = out / "manifest.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_batch_on_two_groups_interrupted_and_resumed_writes_each_line_once(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"a red circle number {n}\n" for n in range(12)))
    out = tmp_path / "out"
    launch = ["--nproc", "4"]
    first = _batch("--replicas", "2", "--steps", "30", out=out, prompts=prompts, launch=launch)
    deadline = time.monotonic() + 180
    while len(_manifest(out)) < 4 and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    _, stderr = first.communicate(timeout=60)
    assert first.returncode == 130, stderr
    done_before = len(_manifest(out))
    assert 4 <= done_before < 12, stderr
    second = _batch("--replicas", "2", "--steps", "30", out=out, prompts=prompts, launch=launch)
    _, stderr = second.communicate(timeout=300)
    assert second.returncode == 0, stderr
    assert f"{12 - done_before} written, {done_before} already done" in stderr
    entries = _manifest(out)
    files = [entry["file"] for entry in entries]
    assert len(files) == 12 and len(set(files)) == 12  # 0 lost, 0 duplicated
    assert {path.name for path in out.iterdir()} == set(files) | {"manifest.jsonl"}
    assert {entry["group"] for entry in entries} == set(GROUPS)
    assert all(entry["plan"] == "ulysses-2, all-to-all gloo" and entry["ranks"] == 2 for entry in entries)


def _host(node: int, endpoint: str, *args: str) -> AppProcess:
    return AppProcess("launch", "--nproc", "2", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint",
                      endpoint, *args)


def test_two_hosts_serve_a_request_and_a_batch_and_a_lost_host_ends_the_other(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na green star\na yellow diamond\n")
    endpoint = f"127.0.0.1:{free_port()}"
    batch = ["batch", str(prompts), "--out", str(tmp_path / "out"), "--size", "64x64", "--steps", "4",
             "--replicas", "2"]
    hosts = [_host(node, endpoint, *batch) for node in (0, 1)]
    for host in hosts:
        assert host.process.wait(timeout=300) == 0, host.output
    entries = _manifest(tmp_path / "out")
    assert len(entries) == 4 and {entry["group"] for entry in entries} == set(GROUPS)

    port = free_port()
    endpoint = f"127.0.0.1:{free_port()}"
    serve = ["serve", "--model", "tiny-flux", "--replicas", "2", "--port", str(port), "--max-request-seconds", "0"]
    hosts = [_host(node, endpoint, *serve) for node in (0, 1)]
    try:
        hosts[0].wait_for("serving on", START_SECONDS)
        result = _image(f"http://127.0.0.1:{port}/", "a red circle", 1, 4)
        assert Path(result[1]).is_file() and "4 ranks in 2 groups of 2" in result[3]
        ranks = hosts[0].rank_pids()
        started = time.monotonic()
        for pid in [hosts[1].process.pid, *descendants(hosts[1].process.pid)]:  # the second host dies: every
            os.kill(pid, signal.SIGKILL)                                         # process of it at once
        hosts[0].process.wait(timeout=60)
        while any(running(pid) for pid in ranks.values()):
            assert time.monotonic() - started < 30
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        output = hosts[0].final_output()
        print(f"host 0 ended {elapsed:.2f} s after host 1 died:\n{output}")
        assert elapsed < DEAD_SECONDS, output
        assert "rank 2" in output and "is gone" in output, output
    finally:
        for host in hosts:
            host.stop()
