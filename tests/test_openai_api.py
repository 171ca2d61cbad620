"""The OpenAI-compatible API (app.server.openai_api), driven by the official `openai` package.

Most tests share one `launch --nproc 2 serve --no-ui --api-key-file ... --max-queue 2` server (2 gloo CPU
ranks, tiny-flux and tiny-cosmos, small sizes and few steps): the API alone, without Gradio (app.server.api_server),
with a webhook receiver on 127.0.0.1 (`--webhook-url`) and its log in JSON (`--log-format json`); its start is
watched from GET /ready.
The API beside the UI, on Gradio's server, is driven by tests/test_app_serve.py. The image edits, the upload
limit, the API that is off beside UI logins, the key lockout, /status, /health and /ready as the queue and the
ranks change, unknown paths and methods, unreadable bodies, the metrics of a job's end and the webhooks' retries
run in-process: the routes on Starlette's test client, with a stand-in for the ranks (a FLUX.2 model's limits, no
weights).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from pipelines.media import read_mp4_settings, read_png_settings, read_video
from tests.helpers import REPO, free_port
from tests.test_app_serve import START_SECONDS, AppProcess
from tests.test_tiny_quality import PROMPTS
from training.judge import judge_image

KEY = "test-key-0123456789abcdef"
MAX_QUEUE = 2

# The SDK warns that OpenAI's own video service is ending; this server's video API is not.
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


WEBHOOK_SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()


class WebhookReceiver:
    """An HTTP server on 127.0.0.1 that keeps each POST it takes (body, headers, tries) and answers the first
    `refuse` tries of every event with 500 (so that the sender must try again), each after `delay` seconds;
    `times` has each event's tries' times."""

    def __init__(self, refuse: int = 1, delay: float = 0.0) -> None:
        import http.server

        received = self.received = []
        times = self.times = {}
        tries: dict[str, int] = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                event_id = self.headers["webhook-id"]
                times.setdefault(event_id, []).append(time.monotonic())
                time.sleep(delay)
                tries[event_id] = tries.get(event_id, 0) + 1
                if tries[event_id] > refuse:
                    received.append((body, {name.lower(): value for name, value in self.headers.items()},
                                     tries[event_id]))
                self.send_response(500 if tries[event_id] <= refuse else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/hooks"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    keys, secret = root / "keys.txt", root / "webhook-secret.txt"
    keys.write_text(f"# one key a line\n{KEY}\n")
    secret.write_text(f"{WEBHOOK_SECRET}\n")
    receiver = WebhookReceiver()
    port = free_port()
    # Python names every module each process imports (on stderr), so that a test can see that none was Gradio.
    app = AppProcess("launch", "--nproc", "2", "serve", "--no-ui", "--port", str(port), "--out", str(root / "out"),
                     "--api-key-file", str(keys), "--max-queue", str(MAX_QUEUE), "--webhook-url", receiver.url,
                     "--webhook-secret-file", str(secret), "--log-format", "json", env={"PYTHONPROFILEIMPORTTIME": "1"})
    try:
        app.url = f"http://127.0.0.1:{port}/"
        app.ready_seen = []  # GET /ready's answers until the server said it serves (its start-up calibration ended)
        deadline = time.monotonic() + START_SECONDS
        while not any("serving on" in line for line in list(app.lines)):
            assert app.process.poll() is None and time.monotonic() < deadline, app.output
            try:
                response = httpx.get(f"{app.url}ready", timeout=5)
                app.ready_seen.append((response.status_code, response.json()["status"]))
            except httpx.TransportError:  # not listening yet
                pass
            time.sleep(0.05)
        app.out = root / "out"
        app.webhooks = receiver
        yield app
    finally:
        app.stop()
        receiver.http.shutdown()


def api(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}v1", api_key=key, max_retries=0, timeout=120)


def decoded(item) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json))).convert("RGB"))


def test_models_lists_the_served_models_with_their_media(server):
    assert {(model.id, model.media) for model in api(server).models.list().data} == {
        ("tiny-flux", "image"), ("tiny-cosmos", "video")}


def test_the_api_alone_answers_health_and_status_and_404_elsewhere(server):
    line = server.wait_for("serving on", 1)
    assert f"serving on {server.url}v1 (the OpenAI-compatible API alone, no UI;" in line, line
    assert httpx.get(f"{server.url}health").json() == {"status": "ok"}
    for path in ("", "gradio_api/info", "login"):  # pages and routes of the UI's server
        response = httpx.get(f"{server.url}{path}")
        assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_url", path
    assert httpx.get(f"{server.url}status").status_code == 401  # what runs is for the key holders
    status = httpx.get(f"{server.url}status", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert status["status"] == "ok" and status["ranks"] == 2 and status["max_queue"] == MAX_QUEUE
    assert status["models"] == [{"id": "tiny-flux", "media": "image"}, {"id": "tiny-cosmos", "media": "video"}]
    assert "2 ranks" in status["server"] and "plan ulysses-2" in status["server"]


def test_no_process_of_the_api_alone_imports_gradio(server):
    imported = [line.rpartition("|")[2].strip() for line in server.lines if line.startswith("import time:")]
    assert "app.server.api_server" in imported and "uvicorn" in imported  # rank 0's imports are among those seen
    assert not [name for name in imported if name.split(".")[0] in ("gradio", "gradio_client")]


def test_image_draws_the_asked_colour_and_brings_its_settings(server):
    prompt, colour, _ = PROMPTS[0]  # judged as tests/test_tiny_quality.py judges it: default size and steps, seed 0
    result = api(server).images.generate(model="tiny-flux", prompt=prompt, extra_body={"seed": 0})
    item = result.data[0]
    assert judge_image(decoded(item)).colour == colour
    assert item.settings["seed"] == 0 and item.settings["model"] == "tiny-flux" and result.size == "256x256"
    written = max(server.out.glob("image-*seed0.png"), key=lambda path: path.stat().st_mtime)
    assert read_png_settings(written)["prompt"] == prompt


def test_n_images_take_consecutive_seeds_and_come_as_urls(server):
    result = api(server).images.generate(prompt="a small blue star", n=2, size="64x48", response_format="url",
                                         extra_body={"seed": 5, "steps": 3, "guidance": 3.0})
    assert [item.settings["seed"] for item in result.data] == [5, 6]
    images = []
    for item in result.data:
        response = httpx.get(item.url)  # a signed URL: no key needed
        assert response.status_code == 200 and response.headers["content-type"] == "image/png"
        images.append(Image.open(io.BytesIO(response.content)))
        assert images[-1].size == (64, 48) and read_png_settings(io.BytesIO(response.content))["seed"] in (5, 6)
    assert not np.array_equal(np.asarray(images[0]), np.asarray(images[1]))
    assert httpx.get(result.data[0].url.split("?")[0] + "?sig=0").status_code == 404


def test_bad_requests_name_their_field(server):
    client = api(server)
    with pytest.raises(openai.BadRequestError, match="height 65 is not a multiple of 16") as error:
        client.images.generate(prompt="a red circle", size="64x65")
    assert error.value.param == "size" and error.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="steps must be between") as error:
        client.images.generate(prompt="a red circle", size="64x64", extra_body={"steps": 0})
    assert error.value.param == "steps"
    with pytest.raises(openai.BadRequestError) as error:
        client.images.generate(prompt="a red circle", extra_body={"colour": "red"})
    assert error.value.param == "colour" and error.value.code == "unknown_parameter"
    with pytest.raises(openai.BadRequestError, match="takes no input image") as error:
        client.images.edit(image=("start.png", b"not used", "image/png"), prompt="a red circle")
    assert error.value.param == "image"
    with pytest.raises(openai.BadRequestError) as error:
        client.videos.create(prompt="a red square", extra_body={"frames": 4})
    assert error.value.param == "frames"
    with pytest.raises(openai.BadRequestError, match="not served here") as error:
        client.images.generate(prompt="a red circle", model="dall-e-3")
    assert error.value.param == "model"


def test_a_decompression_bomb_as_a_video_input_is_refused_before_any_rank_decodes_it(server):
    bomb = io.BytesIO()
    Image.new("1", (7000, 7000), 1).save(bomb, format="PNG")  # 49 megapixels (147 MB as RGB) in a 19 kB file
    with pytest.raises(openai.BadRequestError, match=r"input image bomb.png is 7000x7000 \(49 megapixels\) from a "
                                                     r"file of 19 kB: \d+ times its size once decoded, a "
                                                     r"decompression bomb") as error:
        api(server).videos.create(prompt="a red square", size="64x64", extra_body={"frames": 5, "steps": 1},
                                  input_reference=("bomb.png", bomb.getvalue(), "image/png"))
    assert error.value.param == "input_reference"


def test_a_wrong_key_is_refused(server):
    with pytest.raises(openai.AuthenticationError, match="valid API key"):
        api(server, "not-the-key").models.list()
    response = httpx.get(f"{server.url}v1/models")  # no key at all
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_n_beyond_the_queue_is_refused_on_n_and_the_server_goes_on(server):
    with pytest.raises(openai.BadRequestError, match=r"n=5 is more images than this server queues for one client "
                                                     r"\(2: --max-queue 2") as error:
        api(server).images.generate(prompt="many", n=MAX_QUEUE + 3, size="64x64", extra_body={"steps": 30})
    assert error.value.param == "n"
    started = time.monotonic()  # nothing of the refused request was queued
    api(server).images.generate(prompt="a red circle", size="64x64", extra_body={"steps": 2})
    assert time.monotonic() - started < 10


def test_video_job_runs_reports_progress_and_downloads_as_mp4(server, tmp_path):
    client = api(server)
    video = client.videos.create(prompt="a red square moving right on a white background", model="tiny-cosmos",
                                 size="64x64", extra_body={"frames": 5, "steps": 3, "seed": 4})
    assert video.status in ("queued", "in_progress") and video.object == "video" and video.size == "64x64"
    seen = {video.status}
    while video.status in ("queued", "in_progress"):
        time.sleep(0.1)
        video = client.videos.retrieve(video.id)
        seen.add(video.status)
    assert video.status == "completed" and video.progress == 100 and video.completed_at, video
    assert video.settings["frames"] == 5 and video.settings["seed"] == 4
    mp4 = tmp_path / "video.mp4"
    client.videos.download_content(video.id).write_to_file(mp4)
    frames, fps = read_video(mp4)
    assert len(frames) == 5 and frames[0].shape == (64, 64, 3) and fps == pytest.approx(8)
    assert read_mp4_settings(mp4)["seed"] == 4
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_seconds_map_to_frames_and_the_sdk_polls_to_the_end(server):
    client = api(server)
    video = client.videos.create_and_poll(prompt="a blue circle", size="64x64", seconds="1", extra_body={"steps": 1})
    assert video.status == "completed"
    assert video.settings["frames"] == 9 and video.seconds == "1"  # 1 s at tiny-cosmos' 8 fps: 8 intervals
    client.videos.delete(video.id)


def test_deleting_a_running_video_frees_the_server_within_two_steps(server):
    client = api(server)
    video = client.videos.create(prompt="a long one", size="64x64", extra_body={"frames": 5, "steps": 300})
    deadline = time.monotonic() + 60
    while client.videos.retrieve(video.id).progress < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    running = httpx.get(f"{server.url}status", headers={"Authorization": f"Bearer {KEY}"}).json()["running"]
    assert [(job["model"], job["size"], job["frames"], job["steps"]) for job in running] == [
        ("tiny-cosmos", "64x64", 5, 300)] and running[0]["step"] >= 1, running
    assert client.videos.delete(video.id).deleted
    line = server.wait_for("deleted by the client", 30)
    asked, stopped = map(int, re.search(r"asked after step (\d+), stopped at step (\d+)", line).groups())
    assert stopped - asked <= 2, line
    started = time.monotonic()
    client.images.generate(prompt="next", size="64x64", extra_body={"steps": 2})
    assert time.monotonic() - started < 10


def test_ready_said_503_while_the_server_warmed_up_then_says_200(server):
    seen = server.ready_seen
    assert seen and seen[0] == (503, "warming_up") and set(seen) <= {(503, "warming_up"), (200, "ready")}, seen
    response = httpx.get(f"{server.url}ready")
    assert response.status_code == 200 and response.json() == {"status": "ready"}


def test_video_ends_reach_the_webhook_signed_as_openai_signs_them(server):
    """video.completed and video.failed, each retried once (the receiver refuses every first try), verified by the
    SDK's webhooks.unwrap; the request id the client sent comes back, and the JSON log names it."""
    client = api(server)
    raw = client.videos.with_raw_response.create(prompt="a red square moving right on a white background",
                                                 size="64x64", extra_body={"frames": 5, "steps": 1},
                                                 extra_headers={"X-Request-Id": "hook-test-1"})
    assert raw.headers["x-request-id"] == "hook-test-1"
    done = client.videos.poll(raw.parse().id)
    assert done.status == "completed"
    doomed = client.videos.create(prompt="a long one", size="64x64", extra_body={"frames": 5, "steps": 300})
    client.videos.delete(doomed.id)  # its job fails: stopped at its next step, or dropped at its turn

    verifier = openai.OpenAI(api_key="unused", webhook_secret=WEBHOOK_SECRET)
    events: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while not {done.id, doomed.id} <= set(events):  # the module's earlier videos have theirs too
        assert time.monotonic() < deadline, events
        time.sleep(0.05)
        for body, headers, tries in list(server.webhooks.received):
            event = verifier.webhooks.unwrap(body, headers)
            assert tries == 2 and headers["webhook-id"] == event.id and event.object == "event"
            events[event.data.id] = event.type
    assert (events[done.id], events[doomed.id]) == ("video.completed", "video.failed")
    body, headers, _ = server.webhooks.received[0]
    with pytest.raises(openai.InvalidWebhookSignatureError):
        openai.OpenAI(api_key="unused", webhook_secret="whsec_" + base64.b64encode(b"another" * 5).decode()
                      ).webhooks.unwrap(body, headers)

    logged = [json.loads(line) for line in server.lines if line.startswith("{")]
    mine = [line for line in logged if line.get("request_id") == "hook-test-1"]
    assert {"path": "/v1/videos", "method": "POST", "status": 200} in [
        {key: line.get(key) for key in ("path", "method", "status")} for line in mine], mine
    assert any(line.get("video_id") == done.id and line["message"].endswith("completed") for line in mine), mine
    made = httpx.get(f"{server.url}v1/models", headers={"Authorization": f"Bearer {KEY}"}).headers["x-request-id"]
    assert re.fullmatch(r"req_[0-9a-f]{32}", made)  # none given: one made


def test_metrics_say_what_ran_in_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families

    assert httpx.get(f"{server.url}metrics").status_code == 401  # behind the key, as /status is
    response = httpx.get(f"{server.url}metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = [sample for family in text_string_to_metric_families(response.text) for sample in family.samples]

    def value(name: str, **labels: str) -> float:
        return sum(sample.value for sample in samples
                   if sample.name == f"ulysses_studio:{name}" and labels.items() <= sample.labels.items())

    status = httpx.get(f"{server.url}status", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert value("num_requests_running") == len(status["running"]) == 0
    assert value("num_requests_waiting") == len(status["waiting"]) == 0
    assert value("groups") == 1 and value("busy_groups") == 0
    for model in ("tiny-flux", "tiny-cosmos"):
        finished = value("request_success_total", model_name=model)
        assert finished >= 2 and value("e2e_request_latency_seconds_count", model_name=model) >= finished
        assert value("request_queue_time_seconds_count", model_name=model) >= finished
        for stage in ("encode", "decode", "write"):
            assert value("stage_seconds_count", model_name=model, stage=stage) >= 1, (model, stage)
        assert value("stage_seconds_count", model_name=model, stage="step") >= finished
    assert value("request_failure_total", model_name="tiny-cosmos") >= 1  # the deleted videos
    memory = {sample.labels["rank"]: sample.value for sample in samples
              if sample.name == "ulysses_studio:rank_memory_bytes" and sample.labels["device"] == "cpu"}
    assert set(memory) == {"0", "1"} and all(used > 100e6 for used in memory.values()), memory


def test_ctrl_c_stops_the_api_alone_cleanly(server):
    """The module's last test of the server: it stops it."""
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=30) == 130
    output = server.final_output()
    assert "stopped" in output and "Traceback" not in output, output[-3000:]


def test_no_ui_refuses_a_command_line_that_needs_the_ui_before_starting_ranks(tmp_path):
    from app.commands.cli import build_parser
    from app.server.serve import ServeError, serve_plan

    result = subprocess.run([sys.executable, "-m", "app", "launch", "--nproc", "2", "serve", "--no-ui", "--share"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == (
        "error: --share opens a public link to the web UI, and --no-ui serves none: leave one of them out")
    logins, keys = tmp_path / "logins.txt", tmp_path / "keys.txt"
    logins.write_text("user:password\n")
    keys.write_text(f"{KEY}\n")
    with pytest.raises(ServeError, match=r"^--auth-file asks for a login to the web UI, and --no-ui serves none: "
                                         r"ask for API keys instead \(--api-key-file FILE\)$"):
        serve_plan(build_parser().parse_args(["serve", "--no-ui", "--auth-file", str(logins)]))
    with pytest.raises(ServeError, match="leave it out: the API asks for the keys of --api-key-file"):
        serve_plan(build_parser().parse_args(["serve", "--no-ui", "--auth-file", str(logins), "--api-key-file",
                                              str(keys)]))
    assert serve_plan(build_parser().parse_args(["serve", "--no-ui", "--api-key-file", str(keys)])).api_keys == [KEY]


# In-process: the routes on Starlette's test client, a stand-in for the ranks.


def flux2_server(tmp_path: Path, quotas=None, max_seconds: float | None = None):
    """A FLUX.2 model's limits (a reference image allowed; no weights), tiny-cosmos' for videos, and a Server of 24
    places (20 an owner), its job store in `tmp_path`; with `max_seconds`, a time limit, each model's cost model fed
    one measurement: a step 1 s, a decode 0.1 s."""
    from app.outputs import ResultsFolder
    from app.ranks.runtime import ServedModel
    from app.server.budget import RequestBudget
    from app.server.job_store import JobStore
    from app.server.jobs import JobQueue
    from app.server.submit import Quotas, Server
    from app.server.uploads import Uploads
    from pipelines.registry import get_spec
    from pipelines.requests import MediaLimits, make_request
    from pipelines.work import Work

    (tmp_path / "uploads").mkdir()
    (tmp_path / "out").mkdir()
    model = ServedModel(spec=get_spec("flux2-dev"), folder=tmp_path,
                        limits=MediaLimits(size_multiple=16, max_height=4096, max_width=4096, reference_image=True))
    video = ServedModel(spec=get_spec("tiny-cosmos"), folder=tmp_path,
                        limits=MediaLimits(size_multiple=16, max_height=1024, max_width=1024, frame_multiple=4,
                                           max_frames=121))
    budget = RequestBudget(max_seconds, {"image": lambda request: Work(1.0, 1.0),
                                         "video": lambda request: Work(1.0, 1.0)})
    if max_seconds is not None:
        for served in (model, video):
            budget.record(served.key, make_request(served.spec, served.limits, prompt="x", width=32, height=32),
                          1.0, 0.1)
    server = Server(jobs=JobQueue(24, per_owner=20), budget=budget, results=ResultsFolder(tmp_path / "out"),
                    uploads=Uploads(tmp_path / "uploads"), store=JobStore(tmp_path / "out" / "jobs.sqlite3"),
                    quotas=quotas or Quotas())
    return model, video, server


@pytest.fixture
def local(tmp_path):
    """An API for a FLUX.2 model (a reference image allowed) and tiny-cosmos, whose jobs a thread finishes as the
    ranks would (none while `hold` is set), under a time limit of 100 s (a step is estimated at 1 s)."""
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from app.ranks.lockstep import Generation
    from app.server.access import LoginFailures
    from app.server.openai_api import api_access, api_routes

    model, video, server = flux2_server(tmp_path, max_seconds=100.0)
    runtime = type("Runtime", (), {"models": {"image": model, "video": video}})()
    seen: list = []
    stop, hold = threading.Event(), threading.Event()

    def ranks() -> None:
        while not stop.is_set():
            job = None if hold.is_set() else server.jobs.take(timeout=0.05)
            if job is None:
                time.sleep(0.01)
                continue
            seen.append((job.request, Path(job.request.condition).is_file() if job.request.condition else None))
            job.start()
            job.step(1, 1)
            request = job.request
            if request.frames > 1:
                result = np.full((request.frames, request.height, request.width, 3), 128, np.uint8)
            else:
                result = Image.new("RGB", (request.width, request.height), (200, 30, 30))
            job.finish(Generation(result=result, model=job.model, request=request, seconds=0.1, step_seconds=0.1))

    thread = threading.Thread(target=ranks, daemon=True)
    thread.start()

    def http(keys=None, logins=False, max_upload_bytes=10_000_000, failures=None, admins=None, headers=None):
        failures = failures or LoginFailures()
        access = api_access(keys, logins, failures, admins)
        app = Starlette(routes=api_routes(runtime, server, access, max_upload_bytes))
        return TestClient(app, base_url="http://testserver", headers=headers)

    def client(keys=None, logins=False, max_upload_bytes=10_000_000, key=KEY, failures=None, admins=None):
        return openai.OpenAI(base_url="http://testserver/v1", api_key=key, max_retries=0,
                             http_client=http(keys, logins, max_upload_bytes, failures, admins))

    reference = tmp_path / "reference.png"
    Image.new("RGB", (112, 80), (30, 30, 200)).save(reference)
    yield SimpleNamespace(client=client, http=http, seen=seen, server=server, reference=reference, tmp=tmp_path,
                          hold=hold)
    stop.set()
    thread.join()


def test_an_edit_brings_its_reference_image_to_the_request(local):
    result = local.client().images.edit(image=local.reference.open("rb"), prompt="make it red", size="64x48",
                                        extra_body={"seed": 3, "steps": 2})
    request, present = local.seen[-1]
    assert present and Path(request.condition).name == "reference.png"  # the upload, there while it ran
    assert (request.prompt, request.width, request.height, request.seed, request.steps) == ("make it red", 64, 48, 3, 2)
    assert result.data[0].settings["condition"] == "reference.png" and result.data[0].settings["model"] == "flux2-dev"
    assert decoded(result.data[0]).shape == (48, 64, 3)
    assert not any(local.server.uploads.folder.iterdir())  # the upload is gone once used
    with pytest.raises(openai.BadRequestError, match="does not inpaint") as error:
        local.client().images.edit(image=local.reference.open("rb"), mask=local.reference.open("rb"), prompt="x")
    assert error.value.param == "mask"


def test_an_upload_over_the_limit_is_refused_with_413(local):
    big = io.BytesIO(b"\0" * 1_200_000)
    with pytest.raises(openai.APIStatusError, match="--max-upload-mb") as error:
        local.client(max_upload_bytes=100_000).images.edit(image=("big.png", big, "image/png"), prompt="x")
    assert error.value.status_code == 413
    assert not any(local.server.uploads.folder.iterdir())


def test_the_api_is_off_beside_ui_logins_without_keys(local):
    with pytest.raises(openai.PermissionDeniedError, match="--api-key-file"):
        local.client(logins=True).models.list()
    assert local.client(keys=None, logins=False).models.list().data[0].id == "flux2-dev"  # no login at all: open


def png_header(width: int, height: int) -> bytes:
    """A PNG file's start that claims `width` x `height` (header-only readers open it; its pixels are absent)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_an_input_over_the_megapixel_limit_is_refused_naming_its_field_and_the_limit(local):
    for width, height, said in ((8000, 8000, "is 8000x8000 (64 megapixels)"), (20000, 20000, "is over 179 megapixels")):
        with pytest.raises(openai.BadRequestError) as error:
            local.client().images.edit(image=("big.png", png_header(width, height), "image/png"), prompt="x")
        message = error.value.body["message"]
        assert error.value.param == "image" and message == f"input image big.png {said}; the limit is 50 megapixels"
    assert not any(local.server.uploads.folder.iterdir())


def test_api_paths_and_methods_answer_in_openai_shape(local):
    http = local.http()
    response = http.options("/v1/models")  # a CORS-less preflight, or a client asking what a path takes
    assert response.status_code == 204 and response.headers["allow"] == "GET, HEAD, OPTIONS"
    response = http.put("/v1/models")
    assert response.status_code == 405 and response.headers["allow"] == "GET, HEAD, OPTIONS"
    assert response.json()["error"] == {"message": "/v1/models takes GET, HEAD, OPTIONS, not PUT",
                                        "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}
    response = http.get("/v1/no/such/thing?x=1", headers={"host": "[::1]"})  # a host whose URL ends in "]"
    assert response.status_code == 404 and response.json()["error"]["message"] == (
        "no endpoint GET /v1/no/such/thing here (docs/openai-api.md lists them)")


def test_bodies_that_cannot_be_read_say_why(local):
    http = local.http()
    cut = (b'--XX\r\nContent-Disposition: form-data; name="prompt"\r\n\r\na red circle\r\n--XX\r\n'
           b'Content-Disposition: form-data; name="size"\r\n\r\n64x64')  # no closing --XX--
    response = http.post("/v1/images/generations", content=cut,
                         headers={"content-type": "multipart/form-data; boundary=XX"})
    assert response.status_code == 400 and response.json()["error"]["message"] == (
        "the multipart form ends before its closing boundary (the body was cut short)")
    whole = cut + b"\r\n--XX--\r\n"
    assert http.post("/v1/images/generations", content=whole, headers={
        "content-type": "multipart/form-data; boundary=XX"}).status_code == 200  # the same form, whole
    response = http.post("/v1/images/generations", content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"] == (
        "the body's JSON is nested too deeply (a request's fields are one object of plain values)")


def test_failed_keys_lock_the_address_out_as_failed_logins_do(local):
    from app.server.access import FREE_FAILURES, LoginFailures

    failures = LoginFailures()
    for _ in range(FREE_FAILURES):
        with pytest.raises(openai.AuthenticationError):
            local.client(keys=[KEY], key="wrong-key-0123456789", failures=failures).models.list()
    with pytest.raises(openai.RateLimitError, match="too many failed logins"):
        local.client(keys=[KEY], failures=failures).models.list()  # the right key too, while locked out
    assert failures.lockout("testclient") > 0


def test_status_names_what_runs_and_waits_and_health_turns_503_as_the_server_ends(tmp_path):
    from starlette.testclient import TestClient

    from app.server.access import LoginFailures
    from app.server.api_server import Probes, api_app, serving_health, serving_readiness
    from app.server.metrics import ServerMetrics
    from app.server.openai_api import api_access
    from pipelines.requests import make_request

    model, _, server = flux2_server(tmp_path)
    dead: list[int] = []
    runtime = SimpleNamespace(models={"image": model}, service=SimpleNamespace(dead_ranks=lambda wait: list(dead)),
                              world_size=2, backend="gloo, cpu", describe=lambda *times: "flux2-dev on 2 ranks")
    stop, warm = threading.Event(), threading.Event()
    health = serving_health(runtime, server.jobs, stop)
    probes = Probes(health=health, ready=serving_readiness(health, warm), metrics=ServerMetrics({}))
    app = api_app(runtime, server, api_access([KEY], False, LoginFailures()), 10_000_000, probes)
    http = TestClient(app, base_url="http://testserver", headers={"Authorization": f"Bearer {KEY}"})
    request = make_request(model.spec, model.limits, prompt="a red circle", width=64, height=48, steps=8, seed=1)
    server.jobs.submit("image", request, estimate=2.5)
    server.jobs.submit("image", make_request(model.spec, model.limits, prompt="next", width=32, height=32, steps=4))
    server.jobs.take(timeout=0).start("ranks 0-1", "ulysses-2", 2)
    server.jobs.running()[0].step(3, 8)

    status = http.get("/status").json()
    assert status["server"] == "flux2-dev on 2 ranks" and status["status"] == "ok"
    (running,), (waiting,) = status["running"], status["waiting"]
    assert {key: running[key] for key in ("model", "size", "frames", "steps", "step", "estimate_seconds", "group")} == {
        "model": "flux2-dev", "size": "64x48", "frames": 1, "steps": 8, "step": 3, "estimate_seconds": 2.5,
        "group": "ranks 0-1"} and running["seconds"] >= 0
    assert waiting == {"model": "flux2-dev", "size": "32x32", "frames": 1, "steps": 4, "estimate_seconds": None}
    assert http.get("/health", headers={"Authorization": ""}).json() == {"status": "ok"}  # no key needed
    response = http.get("/ready", headers={"Authorization": ""})
    assert response.status_code == 503 and response.json()["status"] == "warming_up"
    warm.set()  # the start-up calibration has ended
    assert http.get("/ready", headers={"Authorization": ""}).json() == {"status": "ready"}
    response = http.post("/status")
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"
    assert response.headers["allow"] == "GET, HEAD, OPTIONS"

    stop.set()  # Ctrl-C or SIGTERM: the queue closes next
    response = http.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "shutting_down"
    response = http.get("/ready")
    assert response.status_code == 503 and response.json()["status"] == "draining"
    dead.append(1)
    response = http.get("/health")
    assert response.status_code == 503 and response.json() == {
        "status": "lost", "message": "the server lost rank 1 and is ending"}
    assert http.get("/status").json()["status"] == "lost"


def test_metrics_count_a_job_s_stages_cache_hits_and_ranks_as_it_ends(tmp_path):
    """The queue tells the metrics of every job's end (app.server.jobs.JobQueue's on_end): a finished one's stages,
    step-cache hits and ranks' memory, a cancelled one as a failure; the write is counted as the file is written."""
    from prometheus_client.parser import text_string_to_metric_families

    from app.ranks.lockstep import Generation
    from app.server.jobs import JobQueue
    from app.server.metrics import ServerMetrics
    from app.stage_times import StageSeconds
    from pipelines.requests import make_request

    model, _, _ = flux2_server(tmp_path)
    metrics = ServerMetrics({"image": "flux2-dev"})
    jobs = JobQueue(4, on_end=metrics.job_ended)
    metrics.watch(jobs, lambda: 2)
    request = make_request(model.spec, model.limits, prompt="a red circle", width=64, height=48, steps=8, seed=1)
    kept, dropped = jobs.submit("image", request), jobs.submit("image", request)
    dropped.cancel("the client went away")
    jobs.take(timeout=0).start("ranks 0-1", "ulysses-2", 2)
    kept.finish(Generation(result=None, model="image", request=request, seconds=1.0, step_seconds=0.1,
                           computed_steps=3, rank_memory={0: ("cuda", 5_000), 1: ("cuda", 6_000)},
                           stages=StageSeconds(encode=0.2, steps=(0.1,) * 8, decode=0.3)))
    assert jobs.take(timeout=0) is None  # the cancelled one is failed as its turn comes
    metrics.written("flux2-dev", 0.05)

    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(metrics.text().decode()) for sample in family.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(f"ulysses_studio:{name}", tuple(sorted(labels.items())))]

    flux = {"model_name": "flux2-dev"}
    assert value("request_success_total", **flux) == 1 and value("request_failure_total", **flux) == 1
    assert value("e2e_request_latency_seconds_count", **flux) == 2
    assert value("request_queue_time_seconds_count", **flux) == 1
    assert [value("stage_seconds_count", **flux, stage=stage) for stage in ("encode", "step", "decode", "write")] == [
        1, 8, 1, 1]
    assert value("stage_seconds_sum", **flux, stage="step") == pytest.approx(0.8)
    assert value("step_cache_hits_total", **flux) == 5 and value("step_cache_steps_total", **flux) == 8
    assert value("rank_memory_bytes", rank="1", device="cuda") == 6_000
    assert value("groups") == 2 and value("busy_groups") == 0 and value("num_requests_waiting") == 0


def test_a_job_is_followed_from_another_thread_and_cancelled_as_its_client_goes_or_cancels(tmp_path):
    """Job.follow yields the events a ranks' thread adds, in order, to its last (Finished); a follower whose client
    is gone cancels its job, and one that is cancelled cancels its job too."""
    from app.ranks.lockstep import Generation
    from app.server.jobs import Failed, Finished, JobQueue, Started, Step
    from pipelines.requests import make_request

    model, _, _ = flux2_server(tmp_path)
    request = make_request(model.spec, model.limits, prompt="a red circle", width=64, height=48, steps=2, seed=1)
    jobs = JobQueue(4)

    def ranks() -> None:
        job = jobs.take(timeout=5)
        job.start()
        for done in (1, 2):
            time.sleep(0.05)
            job.step(done, 2)
        job.finish(Generation(result=None, model="image", request=request, seconds=0.1, step_seconds=0.05))

    async def follow_one() -> list:
        job = jobs.submit("image", request)
        threading.Thread(target=ranks, daemon=True).start()
        return [event async for event in job.follow()]

    events = asyncio.run(asyncio.wait_for(follow_one(), 10))
    assert [type(event) for event in events] == [Started, Step, Step, Finished]
    assert [(event.done, event.total) for event in events[1:3]] == [(1, 2), (2, 2)]

    async def gone() -> bool:
        return True

    async def client_leaves() -> tuple:
        job = jobs.submit("image", request)
        follower = asyncio.create_task(_events_of(job, gone, every=0.01))
        while job.cancelled is None:
            await asyncio.sleep(0.01)
        jobs.take(timeout=0)  # its turn: a cancelled job is failed with its reason
        return job.cancelled, await follower

    cancelled, events = asyncio.run(asyncio.wait_for(client_leaves(), 10))
    assert cancelled == "the client went away" and events == [Failed("the client went away")]

    async def follower_cancelled() -> str | None:
        job = jobs.submit("image", request)
        follower = asyncio.create_task(_events_of(job))
        await asyncio.sleep(0.05)
        follower.cancel()
        with pytest.raises(asyncio.CancelledError):
            await follower
        return job.cancelled

    assert asyncio.run(follower_cancelled()) == "cancelled by the client"


async def _events_of(job, gone=None, every: float = 0.5) -> list:
    return [event async for event in job.follow(gone, every)]


def test_webhooks_are_sent_without_waiting_and_retried_with_growing_delays():
    from app.server.webhooks import Webhooks

    receiver = WebhookReceiver(refuse=2, delay=0.1)  # a slow receiver that refuses every event's first two tries
    webhooks = Webhooks(receiver.url, WEBHOOK_SECRET, attempts=3, first_retry_seconds=0.1)
    webhooks.start()
    try:
        started = time.monotonic()
        sent = [webhooks.send("video.completed", {"id": f"video_{index}"}) for index in range(3)]
        assert time.monotonic() - started < 0.05  # queued: the caller (the queue, a client's request) never waits
        deadline = time.monotonic() + 20
        while len(receiver.received) < 3:
            assert time.monotonic() < deadline, receiver.times
            time.sleep(0.02)
    finally:
        webhooks.close()
        receiver.http.shutdown()
    verifier = openai.OpenAI(api_key="unused", webhook_secret=WEBHOOK_SECRET)
    assert sorted(verifier.webhooks.unwrap(body, headers).id for body, headers, _ in receiver.received) == sorted(sent)
    for event_id in sent:
        first, second, third = receiver.times[event_id]
        assert second - first >= 0.1 + 0.1 and third - second >= 0.1 + 0.2  # its answer's delay, then 0.1 s, 0.2 s
OTHER, ADMIN = "other-key-0123456789abcdef", "admin-key-0123456789abcdef"


def finished(client: openai.OpenAI, video_id: str):
    deadline = time.monotonic() + 30
    video = client.videos.retrieve(video_id)
    while video.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, video
        time.sleep(0.02)
        video = client.videos.retrieve(video_id)
    return video


def test_each_key_sees_its_own_jobs_and_files_alone_an_admin_all(local):
    keys = dict(keys=[KEY, OTHER, ADMIN], admins=[ADMIN])
    mine, other, admin = (local.client(key=key, **keys) for key in (KEY, OTHER, ADMIN))
    video = finished(mine, mine.videos.create(prompt="mine", model="tiny-cosmos", size="64x64",
                                              extra_body={"frames": 5, "steps": 2}).id)
    assert video.status == "completed" and video.expires_at is None  # no --keep-results age: kept
    for call in (other.videos.retrieve, other.videos.download_content, other.videos.delete):
        with pytest.raises(openai.NotFoundError, match="not yours"):
            call(video.id)
    assert [listed.id for listed in other.videos.list()] == []
    assert [listed.id for listed in mine.videos.list()] == [video.id]
    assert [listed.id for listed in admin.videos.list()] == [video.id]
    assert admin.videos.retrieve(video.id).status == "completed"
    assert mine.videos.download_content(video.id).read()[4:8] == b"ftyp"  # an MP4
    assert local.server.store.get(video.id).owner != local.server.store.get(video.id).owner.replace("key:", "")

    url = mine.images.generate(prompt="shared", size="32x32", response_format="url").data[0].url
    anyone = local.http()  # no key: the signature is the key
    assert anyone.get(url).status_code == 200
    assert anyone.get(url.replace("sig=", "sig=0")).status_code == 404
    expires = int(re.search(r"expires=(\d+)", url)[1])
    assert time.time() + 3500 < expires <= time.time() + 3600  # an hour by default
    from app.server.openai_api import FileLinks

    name = url.rpartition("/")[2].partition("?")[0]
    old = FileLinks(local.server.store.secret(), 60).url(anyone, local.server.results.folder / name,
                                                          now=time.time() - 61)
    answer = anyone.get(old.replace("http://testserver", ""))
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "url_expired", answer.text
    assert mine.videos.delete(video.id).deleted and not any(local.server.results.folder.glob("*.mp4"))


def test_the_video_list_pages_after_an_id_in_either_order(local):
    client = local.client(keys=[KEY])
    made = [client.videos.create(prompt=f"clip {n}", size="64x64", extra_body={"frames": 5, "steps": 1}).id
            for n in range(3)]
    first = client.videos.list(limit=2)
    assert [video.id for video in first.data] == made[:0:-1] and first.has_more
    assert [video.id for video in client.videos.list(limit=2)] == made[::-1]  # the SDK pages on by itself
    assert [video.id for video in client.videos.list(order="asc", after=made[0]).data] == made[1:]
    with pytest.raises(openai.BadRequestError) as error:
        client.videos.list(limit=500)
    assert error.value.param == "limit"


def test_n_is_refused_beyond_the_queue_and_the_time_limit_and_a_full_queue_says_when_to_retry(local):
    client = local.client(keys=[KEY, OTHER])
    # a step is estimated at 1 s and a decode at 0.1 s: 4 images of 30 steps take 120 s, over the 100-s limit
    with pytest.raises(openai.BadRequestError, match=r"n=4 images would take about 2 min together") as error:
        client.images.generate(prompt="long ones", n=4, size="32x32", extra_body={"steps": 30})
    assert error.value.param == "n" and not local.seen
    assert len(client.images.generate(prompt="three", n=3, size="32x32", extra_body={"steps": 30}).data) == 3

    local.hold.set()  # the ranks take nothing (once a take begun before ends): the queue fills
    time.sleep(0.2)
    for _ in range(20):
        client.videos.create(prompt="wait", size="64x64", extra_body={"frames": 5, "steps": 1})
    with pytest.raises(openai.RateLimitError, match="you have 20 requests waiting") as error:
        client.videos.create(prompt="one more", size="64x64", extra_body={"frames": 5, "steps": 1})
    other = local.client(keys=[KEY, OTHER], key=OTHER)
    for _ in range(4):
        other.videos.create(prompt="mine", size="64x64", extra_body={"frames": 5, "steps": 1})
    with pytest.raises(openai.RateLimitError, match="its queue is full") as error:
        other.videos.create(prompt="full", size="64x64", extra_body={"frames": 5, "steps": 1})
    assert error.value.response.headers["retry-after"] == "10"  # nothing runs, so no estimate: the default
    assert error.value.response.headers["x-should-retry"] == "true"


def test_owners_take_turns_one_owners_20_jobs_hold_back_no_other_owners_one(local):
    many, one = local.client(keys=[KEY, OTHER]), local.client(keys=[KEY, OTHER], key=OTHER)
    local.hold.set()
    time.sleep(0.2)
    queued = [many.videos.create(prompt=f"many {n}", size="64x64", extra_body={"frames": 5, "steps": 1}).id
              for n in range(20)]
    single = one.videos.create(prompt="one", size="64x64", extra_body={"frames": 5, "steps": 1}).id
    local.hold.clear()
    started = {video_id: local.server.store.get(finished(client, video_id).id).started_at
               for client, ids in ((many, queued), (one, [single])) for video_id in ids}
    order = sorted(started, key=started.get)
    assert order.index(single) == 1, order  # after the job that ran first, before the many's second


def test_a_restart_keeps_completed_jobs_runs_queued_ones_and_fails_the_running_one(tmp_path):
    """One small server (one process, the API alone, no time limit: no calibration) killed with kill -9 while a job
    runs and another waits, then started again on the same results folder: its job store."""
    from app.server.job_store import INTERRUPTED

    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY}\n{OTHER}\n")

    def start() -> AppProcess:
        port = free_port()
        app = AppProcess("serve", "--no-ui", "--port", str(port), "--out", str(tmp_path / "out"), "--api-key-file",
                         str(keys), "--max-request-seconds", "0")
        app.url = f"http://127.0.0.1:{port}/"
        app.wait_for("serving on", START_SECONDS)
        return app

    first = start()
    try:
        client = api(first)
        done = client.videos.create_and_poll(prompt="kept", size="64x64", extra_body={"frames": 5, "steps": 2,
                                                                                      "seed": 3})
        url = client.images.generate(prompt="shared", size="64x64", response_format="url",
                                     extra_body={"steps": 1}).data[0].url
        running = client.videos.create(prompt="cut short", size="64x64", extra_body={"frames": 5, "steps": 500})
        queued = client.videos.create(prompt="waits", size="64x64", extra_body={"frames": 5, "steps": 2, "seed": 8})
        deadline = time.monotonic() + 60
        while client.videos.retrieve(running.id).progress < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        first.stop()  # kill -9, the whole process group
    second = start()
    try:
        client = api(second)
        kept = client.videos.retrieve(done.id)
        assert kept.status == "completed" and kept.settings["seed"] == 3
        client.videos.download_content(done.id).write_to_file(tmp_path / "kept.mp4")
        assert read_mp4_settings(tmp_path / "kept.mp4")["seed"] == 3
        cut = client.videos.retrieve(running.id)
        assert cut.status == "failed" and cut.error.message == INTERRUPTED and cut.error.code == "interrupted"
        assert finished(client, queued.id).status == "completed"
        client.videos.download_content(queued.id).write_to_file(tmp_path / "queued.mp4")
        assert read_mp4_settings(tmp_path / "queued.mp4")["seed"] == 8
        assert httpx.get(url.replace(first.url, second.url)).status_code == 200  # a signed URL outlives a restart
        with pytest.raises(openai.NotFoundError):
            api(second, OTHER).videos.retrieve(done.id)
        assert [video.id for video in client.videos.list(order="asc")] == [done.id, running.id, queued.id]
    finally:
        second.process.send_signal(signal.SIGINT)
        assert second.process.wait(timeout=30) == 0 and "Traceback" not in second.final_output()
