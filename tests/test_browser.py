"""A real browser on the UI: headless Chromium (Debian's /usr/bin/chromium) driven by Playwright.

The server runs as one plain process (`ulysses-studio serve`, no launcher): the same UI as on rank 0.
Screenshots of both tabs go to a temporary folder, or to UI_SCREENSHOTS (e.g. docs/ui, relative to
the repository) to refresh the checked-in ones.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from PIL import Image
from playwright.sync_api import Page, sync_playwright

from tests.helpers import REPO, free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run"]
PAGE_WIDTH = 1280
MAX_MEDIA_PX = 512
MIN_VIDEO_PX = 256
MAX_SCREENSHOT_BYTES = 300_000


def wait_until_listening(port: int, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, server.communicate()[1]
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on port {port} after {timeout} s")


def test_type_a_prompt_click_generate_and_see_the_image(tmp_path):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--model", "tiny-flux", "--port", str(port), "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        wait_until_listening(port, server, timeout=120)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{port}/", timeout=60_000)
                # Plain words first; the start-up calibration is no request; the technical part is smaller.
                status = page.locator("#status")
                # read between two of the page's refreshes: while one is pending, Gradio shows its timer ("0.1s") first
                text = page.wait_for_function(
                    "() => { const text = document.querySelector('#status')?.innerText ?? '';"
                    " return text.startsWith('tiny-flux (image)') ? text : null; }", timeout=30_000).json_value()
                assert text.startswith("tiny-flux (image) on 1 CPU process, full precision (float32) · "
                                       "no request yet\nidle\n1 rank · plan none (1 rank)"), text
                assert status.locator("small").inner_text().startswith("1 rank · plan none (1 rank) · backend cpu")
                page.locator("#image-prompt textarea").fill("a red circle on a blue background")
                page.locator("#image-generate").click()
                # The status line names the request as soon as the server has it, while its progress shows
                # (the request takes about a second; the page's own refresh comes every 2 s).
                page.wait_for_function(
                    "() => /running tiny-flux 256x256|1 waiting: tiny-flux 256x256/.test("
                    "document.querySelector('#status').innerText)"
                    " && document.querySelector('#image-result .progress-level') !== null",
                    timeout=30_000, polling=20)
                page.wait_for_function(
                    "() => { const img = document.querySelector('#image-result img');"
                    " return img !== null && img.complete && img.naturalWidth > 0; }",
                    timeout=120_000,
                )
                size = page.locator("#image-result img").evaluate("img => [img.naturalWidth, img.naturalHeight]")
                assert size == [256, 256]  # tiny-flux's default size, as the page's fields say
                page.wait_for_function("() => /last request: encode .* ms\\/step/.test("
                                       "document.querySelector('#status').innerText)", timeout=10_000)

                # Stop: a long request is dropped at the next step and the next one runs at once.
                first = page.locator("#image-result img").get_attribute("src")
                page.locator("#image-steps input").fill("500")
                page.locator("#image-generate").click()
                page.wait_for_function(
                    "() => [...document.querySelectorAll('#image-result .progress-level')]"
                    ".some(e => /denoising/.test(e.innerText))", timeout=60_000, polling=20)
                page.locator("#image-stop").click()
                stopped = time.monotonic()
                # The page drops the request's progress once the server has answered the cancel; until then
                # Gradio ignores a second click on Generate (its trigger mode is "once"), as a person sees.
                page.wait_for_function(
                    "() => document.querySelectorAll('#image-result .progress-level').length === 0",
                    timeout=30_000, polling=20)
                page.locator("#image-steps input").fill("8")
                page.locator("#image-generate").click()
                page.wait_for_function(
                    "first => { const img = document.querySelector('#image-result img');"
                    " return img !== null && img.getAttribute('src') !== first && img.complete; }",
                    arg=first, timeout=60_000)
                assert time.monotonic() - stopped < 15  # the 500 steps would take about 20 s

                # The gallery is the browser's own: this page's two results, again after a reload; none on a page of
                # another browser (a new context: its own storage; no login).
                page.wait_for_function("() => document.querySelectorAll('#image-recent img').length === 2",
                                       timeout=10_000)
                page.reload(timeout=60_000)
                page.wait_for_function("() => document.querySelectorAll('#image-recent img').length === 2",
                                       timeout=10_000)
                other = browser.new_context().new_page()
                other.goto(f"http://127.0.0.1:{port}/", timeout=60_000)
                example = "a small blue star at the top left on a yellow background"
                other.get_by_text(example).click()  # an example prompt fills the prompt box
                other.wait_for_function("text => document.querySelector('#image-prompt textarea').value === text",
                                        arg=example, timeout=10_000)
                assert other.locator("#image-recent img").count() == 0
            finally:
                browser.close()
        assert len(list(tmp_path.glob("image-*-seed*.png"))) == 2
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=30)
    assert "image request stopped: cancelled by the client" in server.stderr.read()


def start_server(out: Path, *models: str) -> subprocess.Popen:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", *models, "--port", str(port), "--out", str(out)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    server.port = port
    return server


def save_screenshot(page: Page, folder: Path, name: str) -> None:
    """A full-page PNG, reduced to a palette so that it stays small enough to check in."""
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True, animations="disabled")
    Image.open(path).convert("RGB").quantize(colors=128).save(path, optimize=True)
    assert path.stat().st_size <= MAX_SCREENSHOT_BYTES, (path, path.stat().st_size)


# What a person sees: Gradio keeps a status tracker's timer in the page at opacity 0 while an event with
# show_progress="hidden" is pending (the status line's refresh), so visibility includes the opacity.
BOXES_JS = (
    "selector => [...document.querySelectorAll(selector)]"
    ".filter(e => e.checkVisibility({checkOpacity: true, checkVisibilityCSS: true}))"
    ".map(e => { const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, width: r.width,"
    " height: r.height, text: e.innerText}; }).filter(r => r.width > 0 && r.height > 0)"
)


def visible_boxes(page: Page, selector: str) -> list[dict]:
    return page.evaluate(BOXES_JS, selector)


def overlaps(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"]
            and a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"])


def check_tab(page: Page, tab: str, folder: Path, steps: int) -> None:
    """Before, during and after a random-seed request on `tab`, then a request with two bad fields."""
    page.get_by_role("tab", name=tab.capitalize()).click()
    page.locator(f"#{tab}-generate").wait_for()
    prompt = f"a red circle on a blue background ({tab})"
    page.locator(f"#{tab}-prompt textarea").fill(prompt)
    page.locator(f"#{tab}-steps input").fill(str(steps))
    save_screenshot(page, folder, f"{tab}-before")

    page.locator(f"#{tab}-generate").click()
    # Progress: once, on the result, with the stage, step k/n and the time left. The boxes are read in
    # the same evaluation that sees the denoising stage, since the page moves on to decoding by itself.
    during = page.wait_for_function(
        f"tab => {{ const boxes = {BOXES_JS};"
        " const progress = boxes(`#${tab}-result .progress-level`);"
        " if (!progress.some(b => /denoising/.test(b.text))"
        "     || !boxes(`#${tab}-result .meta-text`).some(b => /left/.test(b.text))) return null;"
        " return {progress: boxes('.progress-level'), status: boxes('#status'),"
        "         texts: boxes('.meta-text, .progress-text, .progress-level')}; }",
        arg=tab, timeout=120_000, polling=20,
    ).json_value()
    save_screenshot(page, folder, f"{tab}-during")
    progress = during["progress"]
    assert len(progress) == 1 and "denoising" in progress[0]["text"], progress
    status, texts = during["status"][0], during["texts"]
    assert all(not overlaps(status, box) for box in texts), (status, texts)
    assert len([box for box in texts if "steps" in box["text"]]) == 1, texts
    if tab == "video":  # after the last step the progress names the stage that runs: the VAE decodes
        page.wait_for_function("() => [...document.querySelectorAll('#video-result .progress-level')]"
                               ".some(e => /decoding/.test(e.innerText))", timeout=60_000, polling=20)

    media = "img" if tab == "image" else "video"
    page.wait_for_function(
        "selector => { const m = document.querySelector(selector);"
        " return m !== null && (m.naturalWidth || m.videoWidth) > 0; }",
        arg=f"#{tab}-result {media}", timeout=120_000,
    )
    page.locator(f"#{tab}-recent img, #{tab}-recent video").first.wait_for(timeout=30_000)
    save_screenshot(page, folder, f"{tab}-after")
    native, shown = page.locator(f"#{tab}-result {media}").evaluate(
        "m => [m.naturalWidth || m.videoWidth, m.getBoundingClientRect().width]")
    if tab == "image":
        assert 0 < shown <= min(2 * native, MAX_MEDIA_PX), (native, shown)
    else:
        check_video(page)
    assert page.evaluate("document.documentElement.scrollHeight") < 1600
    # The Seed box shows the seed used, the one in the result file's name.
    seed = page.locator(f"#{tab}-seed input").input_value()
    assert seed != "0" and f"-seed{seed}" in page.locator(f"#{tab}-file").inner_text()

    # Clicking the newest recent result restores its settings, with "Random seed" off to repeat it.
    page.locator(f"#{tab}-prompt textarea").fill("something else")
    page.locator(f"#{tab}-recent .thumbnail-item").first.click()
    page.wait_for_function("([tab, prompt]) => document.querySelector(`#${tab}-prompt textarea`).value === prompt",
                           arg=[tab, prompt], timeout=10_000)
    assert page.locator(f"#{tab}-seed input").input_value() == seed
    assert not page.locator(f"#{tab}-random-seed input").is_checked()

    # Two bad fields: one message naming both, once; the status line carries no error.
    page.locator(f"#{tab}-width input").fill("100")
    page.locator(f"#{tab}-steps input").fill("0")
    page.locator(f"#{tab}-generate").click()
    page.locator(".toast-body").first.wait_for(timeout=30_000)
    page.wait_for_timeout(300)
    save_screenshot(page, folder, f"{tab}-error")
    messages = visible_boxes(page, ".toast-message-text")
    assert len(messages) == 1, messages
    assert "2 problems" in messages[0]["text"] and "width 100" in messages[0]["text"] and "steps" in messages[0]["text"]
    badges = visible_boxes(page, ".wrap .error")
    assert len(badges) <= 1 and not page.locator("#status .error").count(), badges
    page.locator(".toast-close").first.click()
    page.locator(f"#{tab}-width input").fill("64" if tab == "image" else "128")


def check_video(page: Page) -> None:
    """The finished video: at its own size up to the column's width, at least MIN_VIDEO_PX wide, whole inside its
    box (no strip that cuts it or its controls), and playing."""
    video, box, column = page.locator("#video-result video").evaluate(
        "v => [v, v.closest('.block'), v.closest('.column')].map(e => { const r = e.getBoundingClientRect();"
        " return {x: r.x, y: r.y, width: r.width, height: r.height, native: e.videoWidth,"
        " nativeHeight: e.videoHeight}; })")
    wanted = min(max(video["native"], MIN_VIDEO_PX), column["width"])
    assert abs(video["width"] - wanted) <= 1, (video, column)
    assert abs(video["height"] - wanted * video["nativeHeight"] / video["native"]) <= 1, video
    assert box["y"] <= video["y"] and video["y"] + video["height"] <= box["y"] + box["height"] + 1, (video, box)
    start = page.locator("#video-result video").evaluate("v => v.currentTime")
    page.wait_for_function("start => { const v = document.querySelector('#video-result video');"
                           " return !v.paused && v.currentTime !== start; }", arg=start, timeout=10_000)


def test_both_tabs_before_during_after_a_request_and_after_an_error(tmp_path):
    folder = REPO / os.environ["UI_SCREENSHOTS"] if os.environ.get("UI_SCREENSHOTS") else tmp_path / "screens"
    folder.mkdir(parents=True, exist_ok=True)
    server = start_server(tmp_path / "results")
    try:
        wait_until_listening(server.port, server, timeout=120)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page(viewport={"width": PAGE_WIDTH, "height": 900})
                page.goto(f"http://127.0.0.1:{server.port}/", timeout=60_000)
                check_tab(page, "image", folder, steps=40)
                check_tab(page, "video", folder, steps=24)
            finally:
                browser.close()
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=30)
