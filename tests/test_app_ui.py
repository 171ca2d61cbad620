"""The UI's contract through gradio_client, on one `ulysses-studio serve --cache fbcache:0.25` process
(tiny models; the 2-step requests below are never cached: first and last steps always run).

The seed used comes back for the Seed box, an invalid request is one error naming every bad field,
/generate_video's input file is optional in the API description, and the step cache is a per-request
choice whose computed steps the settings and the status line show.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

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
         "--cache", "fbcache:0.25"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        wait_until_listening(port, server, timeout=120)
        yield f"http://127.0.0.1:{port}/"
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=30)


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
    """/generate_video takes guidance_2 (Wan 2.2 A14B's second expert), optional and last; a one-transformer
    model (tiny-cosmos here) refuses it naming the field, and runs without it as before."""
    client = Client(url, verbose=False)
    parameters = {p["parameter_name"]: p for p in client.view_api(return_format="dict", print_info=False)[
        "named_endpoints"]["/generate_video"]["parameters"]}
    assert list(parameters)[-1] == "guidance_2" and parameters["guidance_2"]["parameter_default"] is None
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


def test_a_gallery_is_its_owners_the_user_with_logins_else_the_browser_session(tmp_path):
    from types import SimpleNamespace

    from app.outputs import RecentResults
    from app.ui import owner_of

    ann_here, ann_there = (SimpleNamespace(username="ann", session_hash=h) for h in ("tab1", "tab2"))
    anonymous, other = (SimpleNamespace(username=None, session_hash=h) for h in ("tab1", "tab2"))
    assert owner_of(ann_here) == owner_of(ann_there) == "user:ann"  # one user, any browser
    assert owner_of(anonymous) != owner_of(other)  # no login: each browser session its own
    recent = RecentResults()
    image = tmp_path / "image.png"
    image.write_bytes(b"png")
    recent.add("image", owner_of(ann_here), image, {"seed": 1})
    assert [result.path for result in recent.of("image", owner_of(ann_there))] == [image]
    assert recent.of("image", owner_of(anonymous)) == [] and recent.of("image", owner_of(other)) == []
