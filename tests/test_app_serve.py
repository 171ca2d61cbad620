"""`ulysses-studio launch --nproc 2 serve` driven through gradio_client: 2 gloo CPU ranks, tiny models.

One server serves the module's tests in file order; the last one stops it with Ctrl-C. The dead-rank
test starts its own server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from PIL import Image

from pipelines.media import read_png_settings, read_video
from tests.helpers import REPO, free_port

START_SECONDS = 180


class AppProcess:
    """`python -m app ARGS` in its own process group, its output collected line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True, env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()

    def _collect(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def final_output(self, timeout: float = 10) -> str:
        """Everything the process wrote, once it has exited and its output is read to the end."""
        self.process.wait(timeout=timeout)
        self._reader.join(timeout=timeout)
        return self.output

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} in the output:\n{self.output}")

    def rank_pids(self) -> dict[int, int]:
        """rank -> pid of the ranks below this process (read from /proc)."""
        ranks = {}
        for pid in descendants(self.process.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for entry in environ:
                if entry.startswith(b"RANK="):
                    ranks[int(entry[5:])] = pid
        return ranks

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            pids = [int(child) for child in children.read_text().split()]
        except OSError:
            continue
        for child in pids:
            found += [child, *descendants(child)]
    return found


LORA_SCALE = 0.8
"""The fixture's --lora style=...:0.8 (a random LoRA for tiny-flux, tests/test_lora.py's; tiny-cosmos takes none)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.test_lora import make_lora

    out = tmp_path_factory.mktemp("results")
    lora = make_lora(tmp_path_factory.mktemp("lora") / "style.safetensors", seed=0, rank=4)
    port = free_port()
    app = AppProcess("launch", "--nproc", "2", "serve", "--port", str(port), "--out", str(out),
                     "--lora", f"style={lora}:{LORA_SCALE}")
    try:
        app.wait_for("serving on", START_SECONDS)
        app.url = f"http://127.0.0.1:{port}/"
        app.out = out
        yield app
    finally:
        app.stop()


def image_args(prompt: str, seed: int, *, steps: int = 3, size: int = 64, random_seed: bool = False) -> tuple:
    return (prompt, seed, random_seed, steps, 3.5, size, size)


def test_image_equals_the_single_process_image(server):
    from pipelines.factory import load_pipeline
    from pipelines.registry import resolve_model
    from pipelines.requests import make_request, read_limits

    image_path, file_path, settings, status, _ = Client(server.url, verbose=False).predict(
        *image_args("a red circle", 7), api_name="/generate_image")
    assert settings["seed"] == 7 and settings["model"] == "tiny-flux"
    assert read_png_settings(file_path)["seed"] == 7
    assert "2 ranks" in status and "ms/step" in status
    # where the time went: encode, each step, decode, write; the server splits its video model's VAE
    assert "split VAE (video)" in status
    assert all(f"{stage} " in status for stage in ("encode", "3 steps", "decode", "write"))
    assert len(settings["stages"]["step_s"]) == 3 and settings["stages"]["write_s"] > 0

    spec, folder = resolve_model("tiny-flux", None)
    request = make_request(spec, read_limits(spec, folder), prompt="a red circle", seed=7, steps=3, width=64, height=64)
    expected = np.asarray(load_pipeline(spec, folder).generate(request)).astype(np.int16)
    # Two ranks sum attention in another order than one: float32 rounding may move a pixel by one level.
    served = np.asarray(Image.open(file_path).convert("RGB")).astype(np.int16)
    shown = np.asarray(Image.open(image_path).convert("RGB")).astype(np.int16)
    assert np.abs(served - expected).max() <= 1
    assert np.abs(shown - expected).max() <= 1


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_a_request_uses_a_lora_only_when_it_names_one_in_the_ui_and_the_api(server):
    """The server carries `style` on tiny-flux alone; the UI and the API use none unless a request names it."""
    import openai

    client = Client(server.url, verbose=False)
    endpoints = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    assert [p["parameter_name"] for p in endpoints["/generate_image"]["parameters"]][-2:] == ["lora", "lora_scale"]
    assert "lora" not in [p["parameter_name"] for p in endpoints["/generate_video"]["parameters"]]
    args = image_args("a red circle", 5)
    _, plain_file, plain, *_ = client.predict(*args, api_name="/generate_image")
    _, none_file, _, *_ = client.predict(*args, lora=[], api_name="/generate_image")
    _, styled_file, styled, *_ = client.predict(*args, lora=["style"], api_name="/generate_image")
    _, half_file, half, *_ = client.predict(*args, lora=["style"], lora_scale=0.4, api_name="/generate_image")
    assert "lora" not in plain and "lora" not in read_png_settings(plain_file)
    assert styled["lora"] == {"style": LORA_SCALE} and read_png_settings(styled_file)["lora"] == {"style": LORA_SCALE}
    assert half["lora"] == {"style": 0.4}
    pixels = {name: np.asarray(Image.open(path).convert("RGB")).astype(np.int16)
              for name, path in (("plain", plain_file), ("none", none_file), ("styled", styled_file),
                                 ("half", half_file))}
    assert np.array_equal(pixels["none"], pixels["plain"])
    assert np.abs(pixels["styled"] - pixels["plain"]).max() > 8
    assert not np.array_equal(pixels["half"], pixels["styled"])

    api = openai.OpenAI(base_url=f"{server.url}v1", api_key="none", max_retries=0, timeout=120)
    assert {model.id: model.loras for model in api.models.list().data} == {"tiny-flux": {"style": LORA_SCALE},
                                                                          "tiny-cosmos": {}}
    body = {"seed": 5, "steps": 3, "guidance": 3.5}

    def by_api(**extra) -> tuple[np.ndarray, dict]:
        import base64
        import io

        item = api.images.generate(prompt="a red circle", size="64x64", extra_body={**body, **extra}).data[0]
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json))).convert("RGB")
        return np.asarray(image).astype(np.int16), item.settings

    got, settings = by_api()
    assert np.array_equal(got, pixels["plain"]) and "lora" not in settings
    got, settings = by_api(lora={"style": LORA_SCALE})
    assert np.array_equal(got, pixels["styled"]) and settings["lora"] == {"style": LORA_SCALE}
    got, settings = by_api(lora="style:0.4")
    assert np.array_equal(got, pixels["half"]) and settings["lora"] == {"style": 0.4}
    with pytest.raises(openai.BadRequestError, match="LoRA 'nope' is not loaded in this run for tiny-flux; "
                                                     "tiny-flux has: style") as error:
        by_api(lora={"nope": 1.0})
    assert error.value.status_code == 400 and error.value.param == "lora"
    with pytest.raises(openai.BadRequestError, match="for tiny-cosmos; tiny-cosmos has: none") as error:
        api.videos.create(prompt="a red square", size="64x64", extra_body={"frames": 5, "lora": "style"})
    assert error.value.param == "lora"


def test_an_api_and_a_ui_request_sent_together_are_both_served_in_order(server):
    import openai

    def by_api():
        api = openai.OpenAI(base_url=f"{server.url}v1", api_key="none", max_retries=0, timeout=120)
        return api.images.generate(prompt="a big red circle", size="64x64", response_format="url",
                                   extra_body={"seed": 21, "steps": 25})

    def by_ui():
        time.sleep(0.5)  # after the API's
        return Client(server.url, verbose=False).predict(*image_args("a big blue circle", 22, steps=25),
                                                          api_name="/generate_image")

    with ThreadPoolExecutor(2) as pool:
        from_api, from_ui = pool.submit(by_api), pool.submit(by_ui)
        api_result, ui_result = from_api.result(timeout=120), from_ui.result(timeout=120)
    api_file = server.out / api_result.data[0].url.split("/")[-1].split("?")[0]
    ui_file = Path(ui_result[1])
    assert api_result.data[0].settings["seed"] == 21 and ui_result[2]["seed"] == 22
    assert api_file.stat().st_mtime_ns < ui_file.stat().st_mtime_ns  # served in arrival order


def test_video_comes_back_as_a_decodable_mp4(server, tmp_path):
    client = Client(server.url, verbose=False)
    video, mp4, settings, *_ = client.predict(
        "a blue square moving right", "blurry", None, 5, 8, 3, False, 2, 3.0, 64, 64, api_name="/generate_video")
    assert Path(mp4).suffix == ".mp4" and settings["frames"] == 5 and settings["seed"] == 3
    frames, fps = read_video(mp4)
    assert len(frames) == 5 and frames[0].shape == (64, 64, 3)
    assert fps == pytest.approx(8)

    start = tmp_path / "start.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(start)
    _, mp4, settings, *_ = client.predict(
        "the red square moves", "", handle_file(str(start)), 5, 8, 3, False, 2, 3.0, 64, 64,
        api_name="/generate_video")
    assert settings["condition"] is not None and len(read_video(mp4)[0]) == 5


def test_two_clients_at_once_get_their_own_results(server):
    def ask(seed: int):
        return Client(server.url, verbose=False).predict(*image_args("two users", seed, steps=4),
                                                          api_name="/generate_image")

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(ask, [11, 12])
    assert first[2]["seed"] == 11 and second[2]["seed"] == 12
    assert read_png_settings(first[1])["seed"] == 11 and read_png_settings(second[1])["seed"] == 12
    assert not np.array_equal(np.asarray(Image.open(first[1])), np.asarray(Image.open(second[1])))


def test_invalid_request_gets_an_error_and_the_next_valid_one_succeeds(server):
    client = Client(server.url, verbose=False)
    with pytest.raises(AppError, match="height 65 is not a multiple of 16"):
        client.predict(*image_args("bad size", 1, size=65), api_name="/generate_image")
    with pytest.raises(AppError, match="prompt is empty"):
        client.predict(*image_args("   ", 1), api_name="/generate_image")
    assert client.predict(*image_args("good size", 1), api_name="/generate_image")[2]["width"] == 64


def test_random_seed_is_chosen_and_reported(server):
    _, file_path, settings, *_ = Client(server.url, verbose=False).predict(
        *image_args("a random seed", 0, random_seed=True), api_name="/generate_image")
    assert isinstance(settings["seed"], int) and f"seed{settings['seed']}" in Path(file_path).name
    assert read_png_settings(file_path)["seed"] == settings["seed"]


def test_progress_is_reported_per_step(server):
    job = Client(server.url, verbose=False).submit(*image_args("progress", 5, steps=60), api_name="/generate_image")
    seen = set()
    while not job.done():
        for unit in job.status().progress_data or []:
            if unit.desc == "denoising" and unit.length == 60:
                seen.add(unit.index)
        time.sleep(0.02)
    job.result()
    assert seen, "no per-step progress was reported"


def test_status_line_names_model_ranks_plan_and_backend(server):
    status = Client(server.url, verbose=False).predict(api_name="/status")
    for part in ("tiny-flux (image)", "tiny-cosmos (video)", "2 ranks", "plan ulysses-2, all-to-all gloo",
                 "backend gloo, cpu"):
        assert part in status


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_metrics_count_the_running_and_waiting_requests_as_status_does(server):
    """10 API video jobs at once on the UI's server: GET /metrics (Prometheus text) and GET /status agree; the
    server's own routes answer beside Gradio's, X-Request-Id is echoed and logged, OPTIONS on an API path is
    answered."""
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    api = openai.OpenAI(base_url=f"{server.url}v1", api_key="none", max_retries=0, timeout=120)
    videos = [api.videos.create(prompt="a red square moving right", size="64x64", extra_headers={
        "X-Request-Id": f"ten-videos-{seed}"}, extra_body={"frames": 5, "steps": 200, "seed": seed})
        for seed in range(10)]
    try:
        for _ in range(20):  # read both between two requests' ends: the two /status around /metrics agree
            before = httpx.get(f"{server.url}status").json()
            metrics = httpx.get(f"{server.url}metrics", headers={"X-Request-Id": "metrics-1"})
            after = httpx.get(f"{server.url}status").json()
            counts = (len(before["running"]), len(before["waiting"]))
            if counts == (len(after["running"]), len(after["waiting"])):
                break
        assert metrics.headers["x-request-id"] == "metrics-1" and sum(counts) >= 9, counts
        values = {sample.name: sample.value for family in text_string_to_metric_families(metrics.text)
                  for sample in family.samples if not sample.labels}
        assert (values["ulysses_studio:num_requests_running"], values["ulysses_studio:num_requests_waiting"]) == counts
        assert values["ulysses_studio:busy_groups"] == counts[0] and values["ulysses_studio:groups"] == 1
    finally:
        for video in videos:
            api.videos.delete(video.id)
    assert httpx.get(f"{server.url}ready").json() == {"status": "ready"}
    assert " INFO [ten-videos-9] POST /v1/videos 200 " in server.wait_for("[ten-videos-9]", 5)  # the server's log
    response = httpx.options(f"{server.url}v1/models")
    assert response.status_code == 204 and response.headers["allow"] == "GET, HEAD, OPTIONS"


@pytest.mark.parametrize("sender", ["ctrl-c", "every-process"])
def test_ctrl_c_stops_every_rank_cleanly(sender):
    """Ctrl-C (the terminal's SIGINT to the launcher), or a stop sent to every process of the server at once (a
    service manager's SIGTERM to each, or pkill): the ranks then get the signal from the sender and again from
    torchrun and the launcher, copies of one request to stop cleanly."""
    port = free_port()
    app = AppProcess("launch", "--nproc", "2", "serve", "--model", "tiny-flux", "--port", str(port))
    try:
        app.wait_for("serving on", START_SECONDS)
        ranks = app.rank_pids()
        assert sorted(ranks) == [0, 1]
        started = time.monotonic()
        if sender == "ctrl-c":
            app.process.send_signal(signal.SIGINT)  # what the terminal sends the launcher on Ctrl-C
        else:
            for pid in [app.process.pid, *descendants(app.process.pid)]:  # launcher, torchrun, ranks
                os.kill(pid, signal.SIGTERM)
        assert app.process.wait(timeout=30) == 130
        assert time.monotonic() - started < 30
        output = app.final_output()
        assert "stopped" in output
        assert "Traceback" not in output, output
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks.values())
    finally:
        app.stop()


def test_a_second_ctrl_c_kills_the_launcher_torchrun_and_every_rank_at_once():
    port = free_port()
    app = AppProcess("launch", "--nproc", "2", "serve", "--model", "tiny-flux", "--port", str(port))
    try:
        app.wait_for("serving on", START_SECONDS)
        processes = [app.process.pid, *descendants(app.process.pid)]  # launcher, torchrun, ranks
        assert sorted(app.rank_pids()) == [0, 1]
        app.process.send_signal(signal.SIGINT)  # the ranks start their clean stop (seconds: rank 0 closes Gradio)
        time.sleep(0.2)
        app.process.send_signal(signal.SIGINT)
        second = time.monotonic()
        assert app.process.wait(timeout=30) == 130
        while any(running(pid) for pid in processes) and time.monotonic() - second < 30:
            time.sleep(0.02)
        gone = time.monotonic() - second
        output = app.final_output()
        assert gone < 1.5, f"processes still ran {gone:.1f} s after the second Ctrl-C\n{output}"
        assert "a second Ctrl-C killed torchrun and its ranks" in output, output
        assert "Traceback" not in output, output
    finally:
        app.stop()


def test_launch_checks_the_command_line_before_starting_ranks():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        result = subprocess.run([sys.executable, "-m", "app", "launch", "--nproc", "2", "serve", "--port",
                                 str(busy.getsockname()[1])], cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        busy.close()
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: cannot listen on 127.0.0.1:")
    assert "torch.distributed.run" not in result.stderr  # no rank was started

    result = subprocess.run([sys.executable, "-m", "app", "serve", "--auth", "nopassword"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == "error: --auth must look like USER:PASSWORD"


@pytest.mark.parametrize("args, message", [
    (["--max-upload-mb", "inf"], "--max-upload-mb"),
    (["--max-upload-mb-per-owner", "nan"], "--max-upload-mb-per-owner"),
    (["--max-results-mb-per-owner", "inf"], "--max-results-mb-per-owner"),
    (["--max-request-seconds", "nan"], "--max-request-seconds"),
    (["--signed-url-seconds", "nan"], "--signed-url-seconds"),
])
def test_limits_that_are_not_finite_numbers_are_refused_before_any_rank_starts(args, message):
    from app.commands.cli import build_parser
    from app.server.serve import ServeError, serve_plan

    with pytest.raises(ServeError, match=message):
        serve_plan(build_parser().parse_args(["serve", "--model", "tiny-flux", *args]))


@pytest.mark.parametrize("command", ["serve", "batch"])
def test_an_out_that_cannot_take_results_is_refused_before_any_rank_starts(tmp_path, command):
    """A file in --out's place or on its path, or a folder the user may not write (/proc/1: not even root may), is
    refused by the command's checks, before a rank starts or a model loads."""
    from app.commands.cli import build_parser
    from app.outputs import OutputError

    taken = tmp_path / "results"
    taken.write_text("not a folder")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    for out, message in ((taken, "is a file, not a folder"), (taken / "inside", "cannot be made: .* is a file"),
                         (Path("/proc/1/results"), "cannot be written: permission denied in /proc/1")):
        args = build_parser().parse_args([command, *([str(prompts)] if command == "batch" else []),
                                          "--model", "tiny-flux", "--out", str(out)])
        with pytest.raises(OutputError, match=message):
            args.check(args)


def test_the_port_probe_takes_an_ipv6_host_as_the_server_binds_it():
    """`--host ::1` (or `::`) is bound as uvicorn and the API server bind it: an IPv6 socket, not refused up front."""
    from app.server.serve import ServeError, check_port

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 here")
    check_port("::1", port)
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", port))
        taken.listen(1)
        with pytest.raises(ServeError, match=f"cannot listen on ::1:{port}"):
            check_port("::1", port)
