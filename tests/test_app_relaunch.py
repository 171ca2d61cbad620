"""A server relaunched right after a crash binds its port, and temporary results folders do not pile up."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gradio_client import Client

from app.ranks.stopping import remove_stale_folders, temporary_folder
from app.server.serve import ServeError, check_port
from tests.helpers import free_port
from tests.test_app_serve import START_SECONDS, AppProcess, descendants


def _results_folder(app: AppProcess) -> Path:
    return Path(re.search(r"results in (\S+)", app.wait_for("serving on", START_SECONDS)).group(1))


def test_port_left_in_time_wait_can_be_listened_on_but_a_live_listener_cannot():
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server's side closes first: its end of the connection stays in TIME_WAIT
    client.close()
    with pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{port}"):
        check_port("127.0.0.1", port)  # the listener is still there
    server.close()
    time.sleep(0.1)
    check_port("127.0.0.1", port)


def test_stale_temporary_folders_of_dead_processes_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"ulysses-studio-{dead.pid}-abc"
    (stale / "sub").mkdir(parents=True)
    alive = tmp_path / f"ulysses-studio-{os.getpid()}-abc"
    alive.mkdir()
    chosen = tmp_path / "ulysses-studio-mine"
    chosen.mkdir()
    remove_stale_folders("ulysses-studio", tmp_path)
    assert not stale.exists() and alive.exists() and chosen.exists()
    made = temporary_folder("ulysses-studio")
    assert made.parent == tmp_path and made.name.startswith(f"ulysses-studio-{os.getpid()}-")


def test_relaunch_right_after_a_crash_serves_and_cleans_up():
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    first = AppProcess("launch", "--nproc", "2", "serve", "--model", "tiny-flux", "--port", str(port))
    try:
        first_folder = _results_folder(first)
        client = Client(url, verbose=False)  # a connection to the server, left open
        assert client.predict(api_name="/status")
        # SIGKILL for everything (torchrun runs in a session of its own): nothing can clean up.
        for pid in [first.process.pid, *descendants(first.process.pid)]:
            os.kill(pid, signal.SIGKILL)
        first.process.wait()
    finally:
        first.stop()
    time.sleep(0.5)  # the killed ranks' sockets close; the connection stays in TIME_WAIT / FIN_WAIT
    assert first_folder.is_dir()

    second = AppProcess("launch", "--nproc", "2", "serve", "--model", "tiny-flux", "--port", str(port))
    try:
        second_folder = _results_folder(second)
        assert not first_folder.exists(), "the dead server's temporary folder was not removed at the next start"
        result = Client(url, verbose=False).predict("a red circle", 1, False, 2, 3.5, 64, 64,
                                                    api_name="/generate_image")
        path, settings = result[1], result[2]  # image, file, settings, status, ...
        assert Path(path).exists() and settings["seed"] == 1
        second.process.send_signal(signal.SIGINT)  # Ctrl-C: the temporary folder goes with the server
        assert second.process.wait(timeout=30) == 130
        assert not second_folder.exists()
    finally:
        second.stop()


def test_user_chosen_results_folder_stays(tmp_path):
    port = free_port()
    out = tmp_path / "results"
    app = AppProcess("serve", "--model", "tiny-flux", "--port", str(port), "--out", str(out))
    try:
        assert _results_folder(app) == out
        app.process.send_signal(signal.SIGTERM)
        assert app.process.wait(timeout=30) == 0
        assert out.is_dir()
    finally:
        app.stop()
