"""A real browser on the UI: headless Chromium (Debian's /usr/bin/chromium) driven by Playwright.

The server runs as one plain process (`ulysses-studio serve`, no launcher): the same UI as on rank 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from playwright.sync_api import sync_playwright

from tests.helpers import REPO, free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run"]


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
                page.locator("#image-prompt textarea").fill("a red circle on a blue background")
                page.locator("#image-generate").click()
                page.wait_for_function(
                    "() => { const img = document.querySelector('#image-result img');"
                    " return img !== null && img.complete && img.naturalWidth > 0; }",
                    timeout=120_000,
                )
                size = page.locator("#image-result img").evaluate("img => [img.naturalWidth, img.naturalHeight]")
                assert size == [256, 256]  # tiny-flux's default size, as the page's fields say
                assert "ms/step" in page.locator("#status").inner_text()
            finally:
                browser.close()
        assert len(list(tmp_path.glob("image-*-seed*.png"))) == 1
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=30)
