"""A shared server held to its limits against careless and hostile clients.

One `launch --nproc 2 serve` (2 gloo CPU ranks, both tiny models) with every limit set low serves
the module's server tests in file order; the last one stops it and looks for what it left behind.
The pieces the limits are made of are tested on their own first, without a server.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import PIL.Image
import pytest
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from app.commands.launch import _without_option
from app.outputs import ResultsCap, ResultsFolder
from app.server.access import (
    AUTH_ENV,
    FORWARDED_ALLOW_IPS,
    FREE_FAILURES,
    AuthError,
    LoginThrottle,
    parse_trusted_proxies,
    read_logins,
    trust_forwarded_headers,
)
from app.server.budget import RateFit, RequestBudget, RequestClock, calibration_requests
from app.server.ui import public_message
from app.server.uploads import ORPHAN_SECONDS
from pipelines.media import MediaError, check_input, read_frames
from pipelines.registry import resolve_model
from pipelines.requests import MediaLimits, RequestError, make_request, read_limits
from tests.helpers import free_port
from tests.test_app_serve import START_SECONDS, AppProcess

PASSWORD = "s3cret-Pa55word"
LIMIT_SECONDS = 20
"""The server's --max-request-seconds: tiny-flux at 256x256 takes about 0.05 s a step here (200 steps: under it)."""
MEMORY_MARGIN = 300e6
ESTIMATE_SLACK_SECONDS = 0.5


# --- the pieces -------------------------------------------------------------------------------------


def _flux_request(**fields):
    spec, _ = resolve_model("tiny-flux", None)
    limits = MediaLimits(size_multiple=16, max_height=4096, max_width=4096)
    return spec, limits, make_request(spec, limits, prompt="a red circle", **fields)


def test_a_rate_fit_finds_overhead_and_rate_and_stays_non_negative():
    fit = RateFit()
    assert fit(1e9) is None  # nothing measured: no estimate
    fit.add(1e9, 0.5)
    assert fit(2e9) == pytest.approx(1.0)  # one size: all of it arithmetic
    fit.add(3e9, 0.9)  # 0.3 s overhead + 0.2 s per GFLOP
    assert (fit.overhead, fit(1e10)) == (pytest.approx(0.3), pytest.approx(2.3))
    fit.add(5e9, 0.1)  # a measurement that would need a negative overhead: through the origin instead
    assert fit.overhead == 0 and fit.seconds_per_flop > 0


def test_budget_estimates_unseen_sizes_from_their_flops_and_refuses_over_the_limit():
    from pipelines.work import WorkCounter

    spec, folder = resolve_model("tiny-flux", None)
    limits = read_limits(spec, folder)
    count = WorkCounter(spec, folder, limits)
    small, big = (make_request(spec, limits, prompt="a red circle", width=size, height=size, steps=8)
                  for size in (256, 2048))
    # Attention's quadratic term is in the count: 8x the side is far more than 64x the work.
    assert count(big).step_flops > 200 * count(small).step_flops
    assert 40 * count(small).decode_flops < count(big).decode_flops
    budget = RequestBudget(100.0, {"image": count})
    assert budget.estimate("image", big) is None  # nothing measured yet: nothing refused up front
    budget.check("image", big)
    first, candidates = calibration_requests(small, min_frames=1, max_height=4096, max_width=4096, multiple=16)
    assert (first.width, first.steps, candidates[0].width) == (256, 3, 512)
    for request, (step, decode) in zip((first, candidates[0]), ((0.05, 0.3), (0.17, 1.0))):
        budget.record("image", request, step, decode)
    estimate = budget.estimate("image", big)
    assert 8 * 12 < estimate < 8 * 40  # measured on 2 CPU ranks: 12 s a step and 34 s of decode
    with pytest.raises(RequestError, match=r"would take about \d+ min \(8 steps at 2048x2048, and its decode\); "
                                           r"this server's limit is 100 s a request \(--max-request-seconds\)"):
        budget.check("image", big)
    assert budget.check("image", small) == pytest.approx(budget.estimate("image", small))


def test_budget_stops_a_running_request_by_projection_and_by_the_clock():
    budget = RequestBudget(10.0, {})
    clock = RequestClock(steps=100, started=0.0)
    clock.step(now=1.0)  # the first step (maybe compiling) does not count for the projection
    assert budget.overrun(clock, 1, now=1.0) is None
    clock.step(now=1.05)
    assert budget.overrun(clock, 2, now=1.05) is None  # 1.05 s + 98 x 0.05 s: under 10 s
    slow = RequestClock(steps=100, started=0.0)
    slow.step(now=1.0)
    slow.step(now=1.2)  # 0.2 s a step: about 21 s in all
    assert "stopped at step 2 of 100: at 0.2 s a step it would take about 21 s" in budget.overrun(slow, 2, now=1.2)
    assert "stopped at step 2 of 100 after 11 s" in budget.overrun(clock, 2, now=11.0)
    assert RequestBudget(None, {}).overrun(slow, 2, now=1e9) is None
    near = RequestClock(steps=100, started=0.0)
    near.step(now=1.0)
    near.step(now=1.11)  # 0.11 s a step: about 12 s, within the margin a loaded machine's first steps need
    assert budget.overrun(near, 2, now=1.11) is None
    assert "after 10 s" in budget.overrun(near, 82, now=10.01)  # stopped by the clock when it gets there


def test_results_cap_parses_files_or_bytes_and_removes_the_oldest_results_only(tmp_path):
    assert ResultsCap.parse("500") == ResultsCap(files=500)
    assert ResultsCap.parse("2GB") == ResultsCap(bytes=2_000_000_000)
    assert ResultsCap.parse("1.5m") == ResultsCap(bytes=1_500_000)
    for bad in ("0", "1.5", "lots", "-3"):
        with pytest.raises(ValueError):
            ResultsCap.parse(bad)
    names = [f"image-20261124-1200{second:02d}-abcdef-seed{second}.png" for second in range(5)]
    for age, name in enumerate(reversed(names)):
        (tmp_path / name).write_bytes(b"x" * 100)
        stamp = time.time() - 10 * age
        os.utime(tmp_path / name, (stamp, stamp))
    (tmp_path / "notes.txt").write_text("the user's own file")
    removed = ResultsFolder(tmp_path, ResultsCap(files=3)).prune()
    assert sorted(path.name for path in removed) == names[:2]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([*names[2:], "notes.txt"])
    assert len(ResultsFolder(tmp_path, ResultsCap(bytes=150)).prune()) == 2


def test_logins_come_from_one_source_and_a_file_or_the_environment(tmp_path, capsys):
    assert read_logins(None, None, {}) is None
    assert read_logins(None, None, {AUTH_ENV: "ann:pw"}) == [("ann", "pw")]
    file = tmp_path / "logins"
    file.write_text("# who may come in\nann:pw\n\nbob:pass:word\n")
    assert read_logins(None, str(file), {}) == [("ann", "pw"), ("bob", "pass:word")]
    assert capsys.readouterr().err == ""
    assert read_logins("ann:pw", None, {}) == [("ann", "pw")]
    assert "warning: --auth shows the password" in capsys.readouterr().err
    with pytest.raises(AuthError, match="one way: --auth-file and \\$ULYSSES_STUDIO_AUTH"):
        read_logins(None, str(file), {AUTH_ENV: "ann:pw"})
    file.write_text("nopassword\n")
    with pytest.raises(AuthError, match="line 1 of --auth-file"):
        read_logins(None, str(file), {})
    assert _without_option(["serve", "--auth", "a:b", "--port", "1", "--auth=c:d"], "--auth") == [
        "serve", "--port", "1"]


def test_login_throttle_locks_an_address_out_after_repeated_failures():
    now = [0.0]
    answers = iter([400] * 8 + [200])

    async def login_route(scope, receive, send):
        await send({"type": "http.response.start", "status": next(answers), "headers": []})
        await send({"type": "http.response.body", "body": b""})

    throttle = LoginThrottle(login_route, clock=lambda: now[0])

    def attempt(address: str = "10.0.0.1") -> int:
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/login", "client": (address, 1)}
        asyncio.run(throttle(scope, None, send))
        return sent[0]["status"]

    assert [attempt() for _ in range(FREE_FAILURES)] == [400] * FREE_FAILURES
    assert attempt() == 429  # locked out for 1 s
    now[0] = 1.1
    assert attempt() == 400  # one more failure: 2 s now
    now[0] = 2.0
    assert attempt() == 429
    now[0] = 3.2
    assert attempt() == 400
    assert attempt("10.0.0.2") == 400  # another address is not affected
    now[0] = 8.0
    assert attempt() == 200 and throttle.lockout("10.0.0.1") == 0  # a success clears the count


def test_trusted_proxies_are_ip_addresses_or_networks_given_repeated_or_comma_separated():
    from app.commands.cli import build_parser
    from app.server.serve import ServeError, serve_plan

    assert parse_trusted_proxies(None) == []
    assert parse_trusted_proxies(["127.0.0.1", "10.0.0.7/24, ::1", ""]) == ["127.0.0.1", "10.0.0.0/24", "::1"]
    for bad in ("proxy.example.com", "*", "10.0.0.0/33"):
        with pytest.raises(AuthError, match="is not an IP address or network"):
            parse_trusted_proxies([bad])
    parser = build_parser()
    plan = serve_plan(parser.parse_args(["serve", "--model", "tiny-flux", "--trusted-proxy", "10.1.2.3",
                                         "--trusted-proxy", "10.9.0.0/16,127.0.0.1"]))
    assert plan.trusted_proxies == ["10.1.2.3", "10.9.0.0/16", "127.0.0.1"]
    assert serve_plan(parser.parse_args(["serve", "--model", "tiny-flux"])).trusted_proxies == []
    with pytest.raises(ServeError, match="--trusted-proxy 'localhost' is not an IP address"):
        serve_plan(parser.parse_args(["serve", "--model", "tiny-flux", "--trusted-proxy", "localhost"]))


def _served_throttle(trusted_proxies: list[str], monkeypatch) -> tuple[LoginThrottle, object]:
    """A LoginThrottle in front of a login route that always refuses, as uvicorn serves it with the server's
    trust_forwarded_headers: its own Config and proxy-headers middleware, starting from an inherited
    $FORWARDED_ALLOW_IPS that trusts everyone (which the server's setting must replace)."""
    import uvicorn

    async def wrong_password(scope, receive, send):
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    throttle = LoginThrottle(wrong_password)
    monkeypatch.setenv(FORWARDED_ALLOW_IPS, "*")
    trust_forwarded_headers(trusted_proxies, os.environ)
    config = uvicorn.Config(throttle, log_level="warning")  # as Gradio makes it: nothing on proxies
    config.load()
    return throttle, config.loaded_app


def _login_from(app, peer: str, forwarded_for: str | None) -> int:
    sent = []

    async def send(message):
        sent.append(message)

    headers = [(b"x-forwarded-for", forwarded_for.encode())] if forwarded_for else []
    scope = {"type": "http", "method": "POST", "path": "/login", "scheme": "http", "client": (peer, 50000),
             "headers": headers}
    asyncio.run(app(scope, None, send))
    return sent[0]["status"]


def test_a_made_up_forwarded_address_does_not_escape_the_login_throttle(monkeypatch):
    throttle, app = _served_throttle([], monkeypatch)
    answers = [_login_from(app, "127.0.0.1", f"203.0.113.{n}") for n in range(8)]
    assert answers == [400] * FREE_FAILURES + [429] * (8 - FREE_FAILURES)  # counted against the peer itself
    assert throttle.lockout("127.0.0.1") > 0 and not any(throttle.lockout(f"203.0.113.{n}") for n in range(8))


def test_behind_a_trusted_proxy_failed_logins_count_per_forwarded_client(monkeypatch):
    _, app = _served_throttle(["10.0.0.0/24", "127.0.0.1"], monkeypatch)
    # eight clients behind the proxy: none locked out by the others' failures
    assert [_login_from(app, "127.0.0.1", f"203.0.113.{n}") for n in range(8)] == [400] * 8
    # one client making up the left of the header: the rightmost address the proxies did not add counts
    answers = [_login_from(app, "127.0.0.1", f"198.51.100.{n}, 203.0.113.50, 10.0.0.9") for n in range(8)]
    assert answers == [400] * FREE_FAILURES + [429] * (8 - FREE_FAILURES)
    assert _login_from(app, "10.0.0.4", "203.0.113.50") == 429  # the same client through the other proxy
    assert _login_from(app, "10.0.0.4", "203.0.113.51") == 400
    # a peer that is no proxy of ours is itself the client, whatever its header says
    assert [_login_from(app, "192.0.2.1", f"203.0.113.{100 + n}") for n in range(6)] == [400] * FREE_FAILURES + [429]


def test_prompts_of_invisible_characters_are_empty():
    spec, limits, _ = _flux_request()
    for prompt in ("\0\0\0", "\u200b\u200d\ufeff", " \t\n\u00ad", "\x07\u2060"):
        with pytest.raises(RequestError, match="prompt is empty"):
            make_request(spec, limits, prompt=prompt)
    assert make_request(spec, limits, prompt="\u200bred\0").prompt == "\u200bred\0"


def test_inputs_over_the_limits_are_refused_from_their_header(tmp_path):
    huge = tmp_path / "huge.png"
    PIL.Image.new("1", (10000, 6000)).save(huge)  # 60 megapixels, a few kB on disk
    started = time.monotonic()
    with pytest.raises(MediaError, match=r"input image huge.png is 10000x6000 \(60 megapixels\); the limit is 50"):
        check_input(huge)
    assert time.monotonic() - started < 1.0
    (tmp_path / "fake.mp4").write_bytes(b"not a video")
    with pytest.raises(MediaError, match="^input file fake.mp4 is not a video this server can read$"):
        check_input(tmp_path / "fake.mp4")


def test_server_paths_are_cut_to_file_names():
    message = "cannot identify image file '/tmp/gradio/f3be0c/notimage.png' (step 3/8, see https://x.org/a/b)"
    assert public_message(message) == "cannot identify image file 'notimage.png' (step 3/8, see https://x.org/a/b)"


def test_server_paths_are_aliased_across_chunks_and_taken_back(tmp_path):
    """app.server.gradio_paths.ServerPaths alone: an event stream whose events (and a path) are cut across chunks goes
    out whole events at a time with the folder aliased; a JSON answer gets its new length; a JSON request's alias and a
    file route's come back as the folder."""
    from app.server.gradio_paths import ServerPaths

    uploads, results = (tmp_path / "up").resolve(), (tmp_path / "out").resolve()
    stream = f'data: {{"path": "{results}/a.png"}}\n\ndata: {{"path": "{uploads}/b.png"}}\n\n'.encode()
    seen = {}

    async def inner(scope, receive, send):
        seen["path"] = scope["path"]
        seen["body"] = (await receive()).get("body", b"")
        kind = b"text/event-stream" if scope["path"] == "/events" else b"application/json"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", kind), (b"content-length", b"1")]})
        body = stream if kind == b"text/event-stream" else f'["{uploads}/c.png"]'.encode()
        for start in range(0, len(body), 7):  # chunks that cut events and paths
            await send({"type": "http.response.body", "body": body[start:start + 7],
                        "more_body": start + 7 < len(body)})

    async def call(path, body=b""):
        sent = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
                 "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1)}
        await ServerPaths(inner, uploads=uploads, results=results)(scope, receive, send)
        return sent

    sent = asyncio.run(call("/events"))
    chunks = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert b"".join(chunks) == b'data: {"path": "~results/a.png"}\n\ndata: {"path": "~uploads/b.png"}\n\n'
    assert all(chunk.endswith(b"\n\n") or not chunk for chunk in chunks), chunks
    sent = asyncio.run(call("/gradio_api/queue/join", b'{"data": [{"path": "~uploads/d.png"}]}'))
    assert seen["body"] == f'{{"data": [{{"path": "{uploads}/d.png"}}]}}'.encode()
    body = b"".join(m["body"] for m in sent if m["type"] == "http.response.body")
    assert body == b'["~uploads/c.png"]' and (b"content-length", str(len(body)).encode()) in sent[0]["headers"]
    asyncio.run(call("/gradio_api/file=~results/e.png"))
    assert seen["path"] == f"/gradio_api/file={results}/e.png"


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """A 20-second 1080p clip of one colour (30 fps, 600 frames; a few tens of kB)."""
    import imageio_ffmpeg

    path = tmp_path_factory.mktemp("clip") / "clip.mp4"
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-loglevel", "error", "-f", "lavfi", "-i",
                    "color=c=red:s=1920x1080:r=30:d=20", "-c:v", "libx264", "-preset", "ultrafast",
                    "-pix_fmt", "yuv420p", str(path)], check=True)
    return path


def test_a_long_clip_is_read_from_its_end_in_small_frames(clip):
    frames = read_frames(clip, (128, 128), last=17)
    assert len(frames) == 17 and all(frame.size == (128, 128) for frame in frames)
    assert frames[-1].getpixel((64, 64))[0] > 200  # red


# --- a server ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    environment = {AUTH_ENV: f"ann:{PASSWORD}"}
    app = AppProcess("launch", "--nproc", "2", "serve", "--port", str(port), "--max-request-seconds",
                     str(LIMIT_SECONDS), "--max-queue", "1", "--max-upload-mb", "1", "--keep-results", "3",
                     "--max-upload-mb-per-owner", "2",
                     env=environment)
    try:
        line = app.wait_for("serving on", START_SECONDS)
        app.results = Path(re.search(r"results in (\S+)", line).group(1))
        app.url = f"http://127.0.0.1:{port}/"
        app.ranks = app.rank_pids()
        app.uploads = next(Path("/tmp").glob(f"ulysses-studio-uploads-{app.ranks[0]}-*"))
        yield app
    finally:
        app.stop()


def _client(server) -> Client:
    return Client(server.url, auth=("ann", PASSWORD), verbose=False)


def _image(prompt: str, seed: int, steps: int = 3, size: int = 256) -> tuple:
    return (prompt, seed, False, steps, 3.5, size, size)


def _step(job) -> int:
    return max((unit.index or 0 for unit in job.status().progress_data or []), default=0)


def test_the_password_is_in_no_command_line_or_rank_environment(server):
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert PASSWORD.encode() not in cmdline.read_bytes(), cmdline
        except OSError:
            continue
    for pid in server.ranks.values():
        assert PASSWORD.encode() not in Path(f"/proc/{pid}/environ").read_bytes()
    with pytest.raises(Exception, match="(?i)login|auth"):  # no login, no service
        Client(server.url, verbose=False).predict(*_image("x", 0), api_name="/generate_image")


def test_a_cancelled_request_frees_the_server_within_two_steps_and_a_full_queue_says_so(server):
    client = _client(server)
    # 100 steps: about 5 s here, and under the time limit on a machine slowed 4x (200 were stopped by it on one
    # slowed 2x by other work)
    long = client.submit(*_image("a long request", 1, steps=100), api_name="/generate_image")
    while _step(long) < 2:
        assert not long.done(), long.result()
        time.sleep(0.02)
    waiting = _client(server).submit(*_image("waits its turn", 2), api_name="/generate_image")
    time.sleep(1.0)  # queued behind the long one
    status = _client(server).predict(api_name="/status")
    assert re.search(r"running tiny-flux 256x256, step \d+ of 100, [\d.]+ s of about [\d.]+ s · 1 waiting: tiny-flux "
                     r"256x256, 3 steps", status), status
    with pytest.raises(AppError, match=r"the server is busy: its queue is full \(1 waiting, --max-queue 1\)"):
        _client(server).predict(*_image("one too many", 3), api_name="/generate_image")
    long.cancel()
    started = time.monotonic()
    assert Path(waiting.result(timeout=60)[0]).is_file()
    seconds = time.monotonic() - started
    line = server.wait_for("image request stopped: cancelled by the client", 10)
    asked, stopped = map(int, re.search(r"asked after step (\d+), stopped at step (\d+) of 100", line).groups())
    assert stopped - asked <= 2, line
    print(f"cancel asked after step {asked}, stopped at step {stopped}; the next request done {seconds:.2f} s after")


def test_a_client_that_goes_away_has_its_request_stopped(server):
    script = (f"from gradio_client import Client\nimport time\n"
              f"job = Client({server.url!r}, auth=('ann', {PASSWORD!r}), verbose=False).submit("
              f"'a client that leaves', 0, False, 120, 3.5, 256, 256, api_name='/generate_image')\n"
              f"while not any(u.index for u in job.status().progress_data or []): time.sleep(0.02)\n"
              f"print('started', flush=True)\ntime.sleep(600)\n")
    leaver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert leaver.stdout.readline().strip() == "started"
    finally:
        leaver.kill()
    line = server.wait_for("image request stopped: the client went away", 15)
    asked, stopped = map(int, re.search(r"asked after step (\d+), stopped at step (\d+) of", line).groups())
    assert stopped - asked <= 2, line
    assert Path(_client(server).predict(*_image("next", 4), api_name="/generate_image")[0]).is_file()


SIZES = [  # (tab, side, frames, steps): the two that held a 60 s server for minutes, then ten across the ranges
    ("image", 4096, 1, 1), ("video", 512, 63, 1),
    ("image", 256, 1, 8), ("image", 512, 1, 8), ("image", 768, 1, 4), ("image", 1024, 1, 2), ("image", 1536, 1, 4),
    ("image", 2048, 1, 1), ("video", 128, 17, 8), ("video", 256, 9, 4), ("video", 128, 33, 4), ("video", 512, 33, 2),
]


def test_no_request_holds_the_ranks_past_the_limit_and_none_that_fits_is_refused(server):
    """Every request is estimated (sizes never served included), refused up front over the limit, and run
    otherwise; what runs holds the ranks at most 1.25x the limit, and its estimate is within 2x of its time (or within
    ESTIMATE_SLACK_SECONDS of it: a busy 2-core machine can halve a sub-second request's time either way)."""
    client = _client(server)
    for tab, side, frames, steps in SIZES:
        started = time.monotonic()
        try:
            if tab == "image":
                settings = client.predict(*_image("a red circle", 1, steps=steps, size=side),
                                          api_name="/generate_image")[2]
            else:
                settings = client.predict("a red circle moving right", frames=frames, steps=steps, width=side,
                                          height=side, seed=1, random_seed=False, api_name="/generate_video")[2]
        except AppError as error:
            estimate = re.search(r"would take about ([\d.]+) (s|min) ", str(error))
            assert estimate, error
            seconds = float(estimate.group(1)) * (60 if estimate.group(2) == "min" else 1)
            print(f"{tab} {side}x{side}x{frames}, {steps} steps: refused in {time.monotonic() - started:.2f} s, "
                  f"estimate {seconds:.0f} s")
            # A shape not seen before has its work counted first (pipelines.work, on meta tensors): 3-5 s for a
            # 63-frame video on a busy 2-core machine, against the minutes it would hold the ranks.
            assert seconds > LIMIT_SECONDS and time.monotonic() - started < 10
            assert (tab, side) not in (("image", 256), ("image", 512), ("video", 128)), error  # well under the limit
            continue
        held, estimate = settings["seconds"], settings["estimate_seconds"]
        print(f"{tab} {side}x{side}x{frames}, {steps} steps: held the ranks {held:.1f} s, estimate {estimate:.1f} s "
              f"({estimate / held:.2f}x)")
        assert held <= 1.25 * LIMIT_SECONDS
        assert 0.5 <= estimate / held <= 2.0 or abs(estimate - held) <= ESTIMATE_SLACK_SECONDS


def _peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def test_a_20_second_1080p_input_clip_costs_rank_0_little_memory_and_its_upload_goes(server, clip):
    client = _client(server)
    client.predict("a red circle moving right", steps=2, api_name="/generate_video")  # the idle peak includes a video
    idle = _peak_rss(server.ranks[0])
    started = time.monotonic()
    result = client.predict("a red circle moving right", condition=handle_file(str(clip)), steps=2,
                            api_name="/generate_video")
    seconds = time.monotonic() - started
    peak = _peak_rss(server.ranks[0])
    print(f"rank 0 peak {idle / 1e6:.0f} MB idle, {peak / 1e6:.0f} MB with the clip; request {seconds:.1f} s")
    assert peak - idle <= MEMORY_MARGIN
    assert result[2]["condition"] == "clip.mp4"  # by its name: the server's folders are not the client's business
    assert not list(server.uploads.rglob("clip.mp4"))  # deleted once used


def test_over_limit_uploads_are_refused_by_the_server(server, tmp_path):
    big = tmp_path / "big.mp4"
    big.write_bytes(b"\0" * 1_500_000)
    with pytest.raises(ValueError, match="exceeds the maximum file size"):  # gradio_client reads the limit first
        _client(server).predict("x", condition=handle_file(str(big)), api_name="/generate_video")
    with httpx.Client(base_url=server.url) as http:  # a client that does not
        http.post("login", data={"username": "ann", "password": PASSWORD}).raise_for_status()
        answer = http.post("gradio_api/upload", files={"files": ("big.mp4", big.read_bytes())})
    assert answer.status_code == 413, answer.text
    assert not list(server.uploads.rglob("big.mp4"))


def test_errors_name_uploads_without_server_paths_and_invisible_prompts_are_refused(server, tmp_path):
    fake = tmp_path / "notimage.png"
    fake.write_bytes(b"garbage")
    with pytest.raises(AppError) as error:
        _client(server).predict("x", condition=handle_file(str(fake)), api_name="/generate_video")
    assert str(error.value) == "input file notimage.png is not an image this server can read (UnidentifiedImageError)"
    assert not list(server.uploads.rglob("notimage.png"))
    with pytest.raises(AppError, match="^prompt is empty"):
        _client(server).predict(*_image("\0\0\u200b", 6), api_name="/generate_image")


def test_the_results_folder_keeps_its_cap(server):
    client = _client(server)
    for seed in range(4):
        client.predict(*_image("fill the folder", 10 + seed, steps=1, size=64), api_name="/generate_image")
    assert len([path for path in server.results.iterdir() if path.suffix in (".png", ".mp4")]) == 3
    # Results are served from the results folder: Gradio's cache holds no copy of any; the empty file Gradio
    # leaves for each request that brought one (above) goes with the next request once it is ORPHAN_SECONDS old.
    time.sleep(ORPHAN_SECONDS)
    client.predict(*_image("one more", 20, steps=1, size=64), api_name="/generate_image")
    assert not [path for path in server.uploads.rglob("*") if path.is_file()]


def test_a_ui_result_is_a_row_of_its_login_whose_file_route_serves_it_to_her(server):
    from app.server.job_store import JobStore

    _client(server).predict(*_image("mine", 30, steps=1, size=64), api_name="/generate_image")
    newest = max(server.results.glob("image-*.png"), key=lambda path: path.stat().st_mtime)
    assert JobStore(server.results / "jobs.sqlite3").owner_of_file(newest.name) == "user:ann"
    with httpx.Client(base_url=server.url) as http:
        assert http.get(f"gradio_api/file={newest}").status_code == 404  # no login: no owner
        assert http.post("login", data={"username": "ann", "password": PASSWORD}).status_code == 200
        assert http.get(f"gradio_api/file={newest}").content == newest.read_bytes()


def test_repeated_failed_logins_are_slowed(server):
    def login(http: httpx.Client, password: str) -> int:
        return http.post("login", data={"username": "ann", "password": password}).status_code

    with httpx.Client(base_url=server.url) as http:
        assert [login(http, f"guess{n}") for n in range(FREE_FAILURES)] == [400] * FREE_FAILURES
        assert login(http, PASSWORD) == 429  # locked out: not even the right password is looked at
        answers = [login(http, f"guess{n}") for n in range(20 - FREE_FAILURES)]
        assert answers.count(429) >= len(answers) - 2, answers
        deadline = time.monotonic() + 20
        while login(http, PASSWORD) != 200:  # the lockout ends (after 1 s, or 2 s, 4 s after more failures)
            assert time.monotonic() < deadline
            time.sleep(0.25)
        # No --trusted-proxy: a made-up X-Forwarded-For on each try is not a new address
        answers = [http.post("login", data={"username": "ann", "password": f"guess{n}"},
                             headers={"X-Forwarded-For": f"203.0.113.{n}"}).status_code
                   for n in range(FREE_FAILURES + 1)]
        assert answers == [400] * FREE_FAILURES + [429], answers
        while login(http, PASSWORD) != 200:
            assert time.monotonic() < deadline + 20
            time.sleep(0.25)


def test_the_ui_names_no_server_folder_and_holds_uploads_to_the_owner_quota(server):
    """Gradio's answers name the upload and results folders by aliases (app.server.gradio_paths), which its routes take
    back; an owner's unused uploads count against --max-upload-mb-per-owner (2 MB here) at Gradio's upload route.
    Last but one of the module: the uploads it leaves stay for up to a minute."""
    import json

    folders = (str(server.uploads.resolve()), str(server.results.resolve()))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        http.post("login", data={"username": "ann", "password": PASSWORD}).raise_for_status()
        page = http.get("")
        assert page.status_code == 200 and not any(folder in page.text for folder in folders)
        # a generation's events name its result by the alias, which the file route serves
        event = http.post("gradio_api/call/generate_image", json={"data": list(_image("alias", 40, 1, 64))})
        stream = http.get(f"gradio_api/call/generate_image/{event.json()['event_id']}").text
        assert "~results/" in stream and not any(folder in stream for folder in folders), stream
        result = json.loads(stream.rsplit("data: ", 1)[1])[0]
        assert result["path"].startswith("~results/image-")
        file = http.get(f"gradio_api/file={result['path']}")
        assert file.status_code == 200 and file.content == (server.results / result["path"][9:]).read_bytes()
        # uploads: answered by alias, served back by it, and refused past the owner's quota
        blob = os.urandom(900_000)
        stored = [http.post("gradio_api/upload", files={"files": (f"{name}.bin", blob)}) for name in "ab"]
        assert [answer.status_code for answer in stored] == [200, 200]
        paths = [answer.json()[0] for answer in stored]
        assert all(path.startswith("~uploads/") for path in paths) and not any(
            folder in answer.text for answer in stored for folder in folders)
        assert http.get(f"gradio_api/file={paths[0]}").content == blob
        refused = http.post("gradio_api/upload", files={"files": ("c.bin", blob)})
        assert refused.status_code == 429 and "--max-upload-mb-per-owner" in refused.text, refused.text
        assert not list(server.uploads.rglob("c.bin"))


def test_nothing_is_left_behind_after_the_server_exits(server):
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=30) == 130
    assert not server.uploads.exists()
    assert not server.results.exists()
