"""The UI's contract through gradio_client, on one `ulysses-studio serve --cache fbcache:0.25 --attention-precision
int8` process (tiny models; the 2-step requests below are never cached and never quantized: first and last steps
always run in full).

The status line speaks plainly, counts client requests only (never the start-up calibration's), says a request
is waiting or running as soon as it is accepted and a video "decoding" after its last step. The seed used comes back
for the Seed box, an invalid request is one error naming every bad field, /generate_video's input file is optional
in the API description, and the step cache is a per-request choice whose computed steps the settings and the
status line show.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from tests.helpers import REPO, free_port
from tests.test_browser import wait_until_listening


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--port", str(port), "--out", str(tmp_path_factory.mktemp("results")),
         "--cache", "fbcache:0.25", "--attention-precision", "int8"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        wait_until_listening(port, server, timeout=120)
        yield f"http://127.0.0.1:{port}/"
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=30)


def test_the_status_line_says_no_request_yet_until_a_client_request_ends(url):
    """The first test of the module: the server's start-up calibration ran requests, which are no client's."""
    client = Client(url, verbose=False)
    before = client.predict(api_name="/status")
    plain, queue, details = before.split("  \n")
    assert plain.startswith("tiny-flux (image), tiny-cosmos (video) on 1 CPU process, full precision (float32)")
    assert "ms/step" not in before and queue == "idle"
    assert plain.endswith("full precision (float32) with int8 attention · no request yet"), plain
    assert details == ("<small>1 rank · plan none (1 rank) · backend cpu, float32 + int8 attention, eager, cache "
                       "fbcache:0.25</small>")
    client.predict("the first request", 1, False, 2, 3.5, 64, 64, api_name="/generate_image")
    after = client.predict(api_name="/status")
    assert "no request yet" not in after
    assert re.search(r"last request: encode [\d.]+ s · 2 steps [\d.]+ s \(\d+ ms/step\) · decode [\d.]+ s · write",
                     after), after


def test_the_status_line_says_a_request_waits_or_runs_once_it_is_accepted(url):
    """The handler's first output, sent as its request is queued, is the status line alone, which names it."""
    job = Client(url, verbose=False).submit("accepted", 2, False, 2, 3.5, 64, 64, api_name="/generate_image")
    job.result()
    first, last = job.outputs()
    assert [first[i] for i in (0, 1, 2, 4)] == [{"__type__": "update"}] * 4  # nothing else changes yet
    queue = first[3].split("  \n")[1]
    assert re.fullmatch(r"running tiny-flux 64x64, (step \d of 2|decoding), [\d.]+ s.*|1 waiting: tiny-flux 64x64, 2 "
                        r"steps.*", queue), queue
    assert last[2]["seed"] == 2 and last[3].split("  \n")[1] == "idle"


def test_a_video_says_decoding_after_its_last_step(url):
    """Its progress and the status line both say "decoding" while the VAE decodes (33 frames: a few seconds)."""
    client = Client(url, verbose=False)
    job = Client(url, verbose=False).submit("decode me", api_name="/generate_video", frames=33, steps=2, width=256,
                                            height=256, seed=5, random_seed=False, step_cache=False)
    progress, status = set(), ""
    while not job.done():
        progress.update(unit.desc for unit in job.status().progress_data or [])
        if "decoding" in progress and "decoding" not in status:
            status = client.predict(api_name="/status")
        time.sleep(0.02)
    assert job.result()[2]["frames"] == 33
    assert {"denoising", "decoding"} <= progress, progress
    assert re.search(r"running tiny-cosmos 256x256, 33 frames, decoding, [\d.]+ s", status), status


def test_the_seed_box_shows_the_random_seed_used(url):
    client = Client(url, verbose=False)
    *_, settings, _, seed_shown = client.predict("a random seed", 0, True, 2, 3.5, 64, 64, api_name="/generate_image")
    assert seed_shown == settings["seed"] and seed_shown != 0
    # Unticking "Random seed" with the seed shown repeats the result's settings.
    *_, again, _, _ = client.predict("a random seed", seed_shown, False, 2, 3.5, 64, 64, api_name="/generate_image")
    assert again["seed"] == settings["seed"]


def test_an_invalid_request_is_one_error_naming_every_bad_field(url):
    client = Client(url, verbose=False)
    with pytest.raises(AppError) as error:
        client.predict("two bad fields", 0, False, 0, 3.5, 100, 64, api_name="/generate_image")
    message = str(error.value)
    assert message.startswith("2 problems with this request")
    assert "width 100 is not a multiple of 16" in message and "steps must be between 1 and 500, got 0" in message


def test_a_field_that_is_no_whole_number_is_refused_naming_it(url):
    client = Client(url, verbose=False)
    for steps, shown in (("abc", "'abc'"), (2.5, "2.5")):
        with pytest.raises(AppError, match=f"steps must be a whole number .*got {shown}"):
            client.predict("not a number", 0, False, steps, 3.5, 64, 64, api_name="/generate_image")


def test_the_video_input_file_is_optional_in_the_api(url):
    api = Client(url, verbose=False).view_api(return_format="dict", print_info=False)
    parameters = {p["parameter_name"]: p for p in api["named_endpoints"]["/generate_video"]["parameters"]}
    assert parameters["condition"]["parameter_has_default"] and parameters["condition"]["parameter_default"] is None
    assert not parameters["prompt"]["parameter_has_default"]
    assert Client(url, verbose=False).predict(
        "no input file", api_name="/generate_video", frames=5, steps=1, width=64, height=64)[2]["condition"] is None


def test_the_low_noise_experts_guidance_reaches_the_request(url):
    """/generate_video takes guidance_2 (Wan 2.2 A14B's second expert), optional, last but the quantized attention's
    choice (a server with --attention-precision's, as this one); a one-transformer
    model (tiny-cosmos here) refuses it naming the field, and runs without it as before."""
    client = Client(url, verbose=False)
    parameters = {p["parameter_name"]: p for p in client.view_api(return_format="dict", print_info=False)[
        "named_endpoints"]["/generate_video"]["parameters"]}
    assert list(parameters)[-2:] == ["guidance_2", "quantized_attention"]
    assert parameters["guidance_2"]["parameter_default"] is None
    with pytest.raises(AppError, match="guidance_2 is the second expert's guidance of a two-expert model"):
        client.predict("two experts?", api_name="/generate_video", frames=5, steps=1, width=64, height=64,
                       guidance_2=4.0)
    assert "guidance_2" not in client.predict("one expert", api_name="/generate_video", frames=5, steps=1,
                                              width=64, height=64)[2]


def test_the_step_cache_is_a_choice_of_each_request(url):
    from pipelines.media import read_png_settings

    client = Client(url, verbose=False)
    prompt = ("a big red star in the center on a white background", 3, False, 8, 3.5, 64, 64)
    _, cached_file, cached, cached_status, _ = client.predict(*prompt, api_name="/generate_image")
    assert cached["step_cache"] and 2 <= cached["computed_steps"] < 8, cached
    assert f"{cached['computed_steps']} of 8 steps computed" in cached_status
    assert read_png_settings(cached_file)["computed_steps"] == cached["computed_steps"]
    _, _, exact, exact_status, _ = client.predict(*prompt, step_cache=False, api_name="/generate_image")
    assert not exact["step_cache"] and exact["computed_steps"] == 8 and "8 of 8 steps computed" in exact_status
    parameters = {p["parameter_name"]: p for p in client.view_api(return_format="dict", print_info=False)[
        "named_endpoints"]["/generate_video"]["parameters"]}
    assert parameters["step_cache"]["parameter_default"] is True


def test_quantized_attention_is_a_choice_of_each_request(url):
    """With --attention-precision int8 the tabs offer full precision per request (last, default on): a request that
    turns it off says so in its settings and draws other pixels than one that keeps it (steps 2 to 7 of 8)."""
    import numpy as np
    import PIL.Image

    client = Client(url, verbose=False)
    api = client.view_api(return_format="dict", print_info=False)["named_endpoints"]
    for name in ("/generate_image", "/generate_video"):
        parameters = api[name]["parameters"]
        assert parameters[-1]["parameter_name"] == "quantized_attention" and parameters[-1]["parameter_default"]
    prompt = ("a small blue circle on the left on a white background", 4, False, 8, 3.5, 64, 64)
    _, quantized_file, quantized, *_ = client.predict(*prompt, step_cache=False, api_name="/generate_image")
    _, full_file, full, *_ = client.predict(*prompt, step_cache=False, quantized_attention=False,
                                            api_name="/generate_image")
    assert "quantized_attention" not in quantized and full["quantized_attention"] is False
    assert not np.array_equal(np.asarray(PIL.Image.open(quantized_file)), np.asarray(PIL.Image.open(full_file)))


def test_a_gallery_is_its_owners_the_user_with_logins_else_the_browser(tmp_path):
    from types import SimpleNamespace

    from app.outputs import RecentResults
    from app.server.ui import Owners

    owners = Owners(most=3)
    ann_here, ann_there = (SimpleNamespace(username="ann", session_hash=h) for h in ("tab1", "tab2"))
    assert owners.of(ann_here) == owners.of(ann_there) == "user:ann"  # one user, any browser
    page, reloaded, other = (SimpleNamespace(username=None, session_hash=h) for h in ("tab3", "tab4", "tab5"))
    browser = owners.identify(None, page)  # a browser's first page: a new id, which the page keeps
    assert owners.identify(browser, reloaded) == browser  # the reload names it: the same owner
    assert owners.of(page) == owners.of(reloaded) == f"browser:{browser}"
    assert owners.identify(None, other) != browser and owners.of(other) != owners.of(page)  # another browser
    assert owners.identify("not an id", other) != "not an id"  # what no page was given is no owner
    api_client = SimpleNamespace(username=None, session_hash="api")  # never loaded a page: its session
    assert owners.of(api_client) == "session:api"
    owners.identify(None, SimpleNamespace(username=None, session_hash="tab6"))  # beyond `most`: the oldest go
    assert owners.of(page) == "session:tab3" and owners.of(reloaded) == f"browser:{browser}"

    recent = RecentResults()
    image = tmp_path / "image.png"
    image.write_bytes(b"png")
    recent.add("image", owners.of(ann_here), image, {"seed": 1})
    recent.add("image", owners.of(reloaded), image, {"seed": 2})
    assert [result.settings["seed"] for result in recent.of("image", owners.of(ann_there))] == [1]
    assert [result.settings["seed"] for result in recent.of("image", f"browser:{browser}")] == [2]
    assert recent.of("image", owners.of(other)) == []


def test_the_status_lines_plain_words_for_gpus_plans_and_precisions():
    from app.server.status_words import precision, processes, sharing

    assert processes(2, "cuda", "NVIDIA H200") == "2 GPUs (NVIDIA H200)" and processes(1, "cpu") == "1 CPU process"
    assert sharing("ulysses-2, all-to-all gloo") == "each with half of every image"
    assert sharing("ulysses-2xring-2, all-to-all nccl", "video") == "each with a quarter of every video"
    assert sharing("cfg-2xallgather-2xtp-2, all-to-all copy-engine") == (
        "each with half of every image, the guided and unguided passes side by side, "
        "each holding half of the model's weights")
    assert sharing("none (1 rank)") == "" and sharing("cfg-2") == "the guided and unguided passes side by side"
    assert precision("nccl, cuda, bfloat16 + fp8, inductor-blocks") == "half precision (bfloat16) with FP8 weights"
    assert precision("nccl, cuda, bfloat16 + fp8 + fp8 attention, inductor-blocks") == (
        "half precision (bfloat16) with FP8 weights and fp8 attention")
    assert precision("gloo, cpu, float32, eager, split VAE (video)") == "full precision (float32)"


def test_with_logins_a_result_file_goes_to_its_owners_login_alone(tmp_path):
    """Gradio's own file routes and logins, in-process, behind OwnResults: another login, and a file of no job, get
    404 (a result's name alone is no key)."""
    import gradio as gr
    import httpx
    from starlette.middleware import Middleware

    from app.server.job_store import JobRow, JobStore
    from app.server.ui import OwnResults
    from tests.helpers import free_port

    store = JobStore(tmp_path / "jobs.sqlite3")
    names = {owner: f"image-20261128-120000-{owner[0] * 32}-seed1.png" for owner in ("ann", "bob")}
    for owner, name in names.items():
        (tmp_path / name).write_bytes(b"png of " + owner.encode())
        job = store.add(JobRow(id=f"image_{owner}", owner=f"user:{owner}", kind="image", model="m", request={}))
        store.change(job.id, status="completed", files={name: 10})
    stray = tmp_path / f"image-20261128-120000-{'c' * 32}-seed1.png"
    stray.write_bytes(b"no job's")
    with gr.Blocks() as demo:
        gr.Markdown("results")
    port = free_port()
    demo.launch(server_port=port, prevent_thread_lock=True, auth=[("ann", "pw-ann"), ("bob", "pw-bob")],
                allowed_paths=[str(tmp_path)], quiet=True, ssr_mode=False,
                app_kwargs={"middleware": [Middleware(OwnResults, store=store)]})
    try:
        for user in ("ann", "bob"):
            with httpx.Client(base_url=f"http://127.0.0.1:{port}/") as http:
                assert http.post("login", data={"username": user, "password": f"pw-{user}"}).status_code == 200
                for owner, name in names.items():
                    answer = http.get(f"gradio_api/file={tmp_path / name}")
                    assert answer.status_code == (200 if owner == user else 404), (user, owner)
                    assert owner != user or answer.content == b"png of " + user.encode()
                assert http.get(f"gradio_api/file={stray}").status_code == 404
    finally:
        demo.close()


def test_a_result_that_cannot_be_written_is_an_error_naming_no_server_path(monkeypatch):
    """The write's own error (a full disk, a missing ffmpeg) reaches the page as a gr.Error whose message names
    files by their names alone, as every other error of a request does."""
    import asyncio
    from types import SimpleNamespace

    import gradio as gr

    from app.server import ui
    from app.server.jobs import Finished

    class Job:
        async def follow(self, gone, every):
            yield Finished(generation=None)

    async def submit(model, server, **fields):
        return SimpleNamespace(job=Job(), request=SimpleNamespace(steps=2), estimate=None, id="image_1")

    async def write(*args):
        raise OSError(28, "No space left on device", "/srv/secret-folder/results/x.png")

    monkeypatch.setattr(ui, "submit", submit)
    monkeypatch.setattr(ui, "write", write)
    page = SimpleNamespace(owners=ui.Owners(), server=None, status=lambda: "status")

    async def run() -> None:
        async for _ in ui._generate(None, page, lambda *args, **kwargs: None, False, None, prompt="x"):
            pass

    with pytest.raises(gr.Error) as raised:
        asyncio.run(run())
    assert "x.png" in raised.value.message and "/srv" not in raised.value.message
