"""The job store (app.server.job_store), the fair queue (app.server.jobs.JobQueue), the owners' quotas
(app.server.submit) and the clean-up of uploads and results, in-process: no ranks. A kill -9 in the middle of writes is
a real process killed."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from app.server.job_store import INTERRUPTED, JobRow, JobStore
from app.server.jobs import Job, JobQueue, ServiceBusy
from pipelines.requests import RequestError
from tests.helpers import REPO


def row(owner: str = "key:a", kind: str = "video", **fields) -> JobRow:
    return JobRow(id=f"{kind}_{time.monotonic_ns()}", owner=owner, kind=kind, model="tiny-cosmos",
                  request={"prompt": "x"}, **fields)


def test_a_job_moves_through_one_function_that_its_subscribers_hear(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    heard: list[tuple[str, str]] = []
    store.subscribe(lambda changed: heard.append((changed.id, changed.status)))
    job = store.add(row())
    store.change(job.id, status="in_progress", started_at=1.0)
    store.change(job.id, progress=50)  # no new status: nothing to hear
    store.change(job.id, status="completed", progress=100, completed_at=2.0, files={"video-a.mp4": 1234},
                 settings={"seed": 4})
    assert heard == [(job.id, "queued"), (job.id, "in_progress"), (job.id, "completed")]
    got = store.get(job.id)
    assert (got.status, got.progress, got.files, got.settings, got.started_at) == (
        "completed", 100, ["video-a.mp4"], {"seed": 4}, 1.0)
    assert store.owner_of_file("video-a.mp4") == "key:a" and store.owner_of_file("other.mp4") is None
    assert store.usage("key:a") == (0, 1234)
    with pytest.raises(ValueError, match="no job status 'done'"):
        store.change(job.id, status="done")
    assert store.delete(job.id).id == job.id and store.get(job.id) is None
    assert store.owner_of_file("video-a.mp4") is None and store.change(job.id, progress=1) is None


def test_pages_of_an_owners_jobs_after_an_id_in_either_order(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    mine = [store.add(row()).id for _ in range(5)]
    store.add(row(owner="key:b"))
    store.add(row(kind="image"))
    page, more = store.page("key:a", "video", limit=2)
    assert [job.id for job in page] == mine[:2:-1] and more
    page, more = store.page("key:a", "video", after=mine[2], limit=2)
    assert [job.id for job in page] == [mine[1], mine[0]] and not more
    page, more = store.page("key:a", "video", after=mine[2], order="asc")
    assert [job.id for job in page] == mine[3:] and not more
    assert len(store.page(None, "video", limit=100)[0]) == 6  # an admin's view


def test_after_a_stop_the_running_job_fails_the_queued_ones_stay_and_urls_keep_their_secret(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    done = store.add(row(status="completed"))
    store.change(done.id, files={"video-done.mp4": 10})
    running = store.add(row(status="in_progress"))
    waiting = [store.add(row()).id, store.add(row(owner="key:b")).id]
    secret = store.secret()
    store.close()
    store = JobStore(path)  # the next start
    assert [job.id for job in store.recover()] == waiting
    failed = store.get(running.id)
    assert failed.status == "failed" and failed.error == {"code": "interrupted", "message": INTERRUPTED}
    assert store.get(done.id).files == ["video-done.mp4"] and store.secret() == secret


def test_expired_jobs_and_those_whose_files_the_cap_removed_are_evicted(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    old = store.add(row(status="completed", expires_at=100.0))
    young = store.add(row(status="completed", expires_at=300.0))
    capped = store.add(row(status="completed"))
    store.change(capped.id, files={"image-capped.png": 5})
    gone = store.evict(now=200.0, files=["image-capped.png"])
    assert sorted(job.id for job in gone) == sorted([old.id, capped.id])
    assert store.get(young.id) is not None and store.get(old.id) is None


WRITER = """
import sys, time
from app.server.job_store import JobRow, JobStore
store = JobStore(__import__("pathlib").Path(sys.argv[1]))
for n in range(1_000_000):
    store.add(JobRow(id=f"video_{n}", owner="key:a", kind="video", model="m", request={"prompt": "x" * 500}))
    store.change(f"video_{n}", status="in_progress", progress=n % 100)
    print(n, flush=True)
"""


def test_the_file_survives_a_kill_9_in_the_middle_of_writes_and_loses_no_row_written(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    written = -1
    deadline = time.monotonic() + 30
    while written < 300 and time.monotonic() < deadline:
        written = int(writer.stdout.readline())
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert written >= 300
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    store = JobStore(path)
    assert all(store.get(f"video_{n}").status == "in_progress" for n in range(written + 1))  # every row it was told of
    assert len(store.recover()) <= 1  # the one it may have added without its move yet
    assert store.get("video_0").error["message"] == store.get(f"video_{written}").error["message"] == INTERRUPTED


def test_owners_take_turns_and_each_holds_at_most_its_share_of_the_queue():
    from pipelines.registry import get_spec
    from pipelines.requests import make_request

    spec = get_spec("tiny-flux")
    from pipelines.requests import MediaLimits

    request = make_request(spec, MediaLimits(size_multiple=16, max_height=512, max_width=512), prompt="x")
    jobs = JobQueue(30, per_owner=20)
    many = [jobs.submit("image", request, owner="a") for _ in range(20)]
    with pytest.raises(ServiceBusy, match="you have 20 requests waiting.*--max-queue-per-owner 20"):
        jobs.submit("image", request, owner="a")
    one = jobs.submit("image", request, owner="b")
    later = jobs.submit("image", request, owner="c")
    assert jobs.snapshot()[1][:4] == [many[0], one, later, many[1]]  # the status line's order is the turns'
    taken = [jobs.take(timeout=0) for _ in range(4)]
    assert taken == [many[0], one, later, many[1]]
    again = jobs.submit("image", request, owner="b")  # b was served longer ago than a: its turn comes first
    assert [jobs.take(timeout=0) for _ in range(3)] == [again, many[2], many[3]]


def test_a_job_cancelled_while_the_queue_looks_at_it_is_failed_not_lost():
    """A client cancels without the queue's lock: a job whose `cancelled` changes between two looks of one take
    is still failed with its reason (it was once in neither the kept nor the dropped jobs)."""
    from pipelines.registry import get_spec
    from pipelines.requests import MediaLimits, make_request

    class CancelledOnSecondLook(Job):
        looks = 0

        @property
        def cancelled(self) -> str | None:
            self.looks += 1
            return None if self.looks == 1 else "the client went away"

        @cancelled.setter
        def cancelled(self, value: str | None) -> None:
            pass

    request = make_request(get_spec("tiny-flux"), MediaLimits(size_multiple=16, max_height=512, max_width=512),
                           prompt="x")
    jobs, told = JobQueue(4), []
    job = CancelledOnSecondLook("image", request, owner="a", changed=lambda **changes: told.append(changes))
    jobs._waiting.append(job)
    assert [jobs.take(timeout=0), jobs.take(timeout=0)] == [None, None]  # seen cancelled by the second take
    assert jobs.waiting() == 0 and job.ended
    assert [changes["error"] for changes in told] == ["the client went away"]


def test_a_full_queue_says_when_a_place_should_free_by_the_running_jobs_estimate():
    from pipelines.registry import get_spec
    from pipelines.requests import MediaLimits, make_request

    request = make_request(get_spec("tiny-flux"), MediaLimits(size_multiple=16, max_height=512, max_width=512),
                           prompt="x")
    jobs = JobQueue(1)
    jobs.submit("image", request, estimate=30.0, owner="a")
    jobs.take(timeout=0).start()
    jobs.submit("image", request, owner="b")
    with pytest.raises(ServiceBusy) as refused:
        jobs.submit("image", request, owner="c")
    assert 29.0 <= refused.value.retry_after <= 30.0


def test_quotas_refuse_an_owner_over_its_uploads_or_results_before_any_job(tmp_path):
    from app.server.submit import OverQuota, Quotas, submit
    from tests.test_openai_api import flux2_server

    model, _, server = flux2_server(tmp_path, Quotas(upload_bytes=1000, result_bytes=100))
    kept = server.store.add(row(owner="key:full", status="completed"))
    server.store.change(kept.id, files={"image-kept.png": 100})
    with pytest.raises(OverQuota, match=r"your results take 0\.0 MB here.*--max-results-mb-per-owner"):
        asyncio.run(submit(model, server, owner="key:full", prompt="x", width=32, height=32))
    big = server.uploads.folder / "upload" / "big.png"
    big.parent.mkdir()
    from PIL import Image

    Image.effect_noise((64, 64), 50).convert("RGB").save(big)
    with pytest.raises(OverQuota, match="this one brings.*--max-upload-mb-per-owner"):
        asyncio.run(submit(model, server, owner="key:other", prompt="x", width=32, height=32, condition=str(big)))
    assert not big.exists()  # a refused request's upload goes at once
    assert server.store.page("key:other", "image")[0] == [] and server.jobs.waiting() == 0
    with pytest.raises(RequestError, match="^input file big.png is no longer on the server: an upload that no "):
        asyncio.run(submit(model, server, owner="key:other", prompt="x", width=32, height=32, condition=str(big)))
    asyncio.run(submit(model, server, owner="key:other", prompt="x", width=32, height=32))
    assert server.jobs.waiting() == 1 and server.store.page("key:other", "image")[0][0].status == "queued"


def test_unused_uploads_go_within_a_minute_and_used_ones_stay(tmp_path):
    from app.server.uploads import UNUSED_SECONDS, Uploads

    uploads = Uploads(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    unused, used = tmp_path / "a" / "unused.png", tmp_path / "b" / "used.png"
    unused.write_bytes(b"x" * 10)
    used.write_bytes(b"y" * 10)
    uploads.use(used)
    assert uploads.sweep(now=time.time() + 1) == []
    assert uploads.sweep(now=time.time() + UNUSED_SECONDS + 1) == [unused] and used.exists()
    assert UNUSED_SECONDS < 60
    uploads.sweep(now=time.time() + UNUSED_SECONDS + 1)
    assert not (tmp_path / "a").exists()  # its folder, empty, goes next


def test_an_upload_that_arrives_as_its_folder_is_removed_stays(tmp_path, monkeypatch):
    """Gradio may store an upload in a folder just as the last request using the folder's other upload ends: the
    folder looked empty a moment before (the look is made to say so here), and the upload that arrived stays,
    with no error for the request that ended."""
    from pathlib import Path

    from app.server.uploads import Uploads

    uploads = Uploads(tmp_path)
    (tmp_path / "a").mkdir()
    used, arrived = tmp_path / "a" / "used.png", tmp_path / "a" / "arrived.png"
    used.write_bytes(b"x")
    arrived.write_bytes(b"y")
    uploads.use(used)
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(()))  # what a look before `arrived` came would see
    uploads.release(used)
    assert not used.exists() and arrived.exists()
    assert uploads.sweep(max_age=-1.0) == [arrived] and not (tmp_path / "a").exists()  # in its time, with its folder


def test_results_cap_takes_an_age_and_api_keys_may_be_marked_admin(tmp_path):
    from app.outputs import ResultsCap
    from app.server.access import AuthError, read_api_keys

    assert ResultsCap.parse("7d") == ResultsCap(seconds=7 * 86400)
    assert ResultsCap.parse("2GB, 24h") == ResultsCap(bytes=2_000_000_000, seconds=86400)
    with pytest.raises(ValueError, match="or an age"):
        ResultsCap.parse("3 weeks")
    keys = tmp_path / "keys.txt"
    keys.write_text("# keys\nuser-key-0123456789abcdef\nadmin-key-0123456789abcdef admin\n")
    assert read_api_keys(keys) == (["user-key-0123456789abcdef", "admin-key-0123456789abcdef"],
                                   ["admin-key-0123456789abcdef"])
    keys.write_text("user-key-0123456789abcdef root\n")
    with pytest.raises(AuthError, match="line 1 .*followed by the word admin"):
        read_api_keys(keys)


def test_a_stop_leaves_the_waiting_jobs_queued_and_the_running_one_interrupted_in_their_rows(tmp_path):
    from app.server.submit import submit
    from tests.test_openai_api import flux2_server

    model, _, server = flux2_server(tmp_path)
    running, waiting = (asyncio.run(submit(model, server, owner="key:a", prompt=prompt, width=32, height=32))
                        for prompt in ("runs", "waits"))
    server.jobs.take(timeout=0).start()
    running.job.fail("the server is shutting down: Ctrl-C")  # as the ranks drop it
    server.jobs.close("the server is shutting down")
    assert server.store.get(running.id).error == {
        "code": "interrupted", "message": f"{INTERRUPTED} (the server is shutting down: Ctrl-C)"}
    assert server.store.get(waiting.id).status == "queued"  # the next start runs it
    assert [job.id for job in server.store.recover()] == [waiting.id]
    from app.ranks.lockstep import STOPPED
    from app.server.submit import record

    stopped = server.store.add(row(status="in_progress"))
    record(server.store, stopped.id, status="failed", error=STOPPED)  # Ctrl-C while it ran: the ranks' word for it
    assert server.store.get(stopped.id).error == {"code": "interrupted", "message": f"{INTERRUPTED} ({STOPPED})"}


def test_a_start_puts_the_ui_owners_results_back_in_their_galleries(tmp_path):
    from types import SimpleNamespace

    from app.server.submit import restore_galleries
    from tests.test_openai_api import flux2_server

    model, video, server = flux2_server(tmp_path)
    for n, owner in enumerate(("user:ann", "user:ann", "browser:abc", "key:api")):
        name = f"image-20261128-120000-{n:032x}-seed{n}.png"
        (server.results.folder / name).write_bytes(b"png")
        job = server.store.add(JobRow(id=f"image_{n}", owner=owner, kind="image", model="flux2-dev", request={}))
        server.store.change(job.id, status="completed", completed_at=float(n), files={name: 3}, settings={"seed": n})
    runtime = SimpleNamespace(models={"image": model, "video": video})
    assert restore_galleries(runtime, server) == 3  # an API key's results are no gallery's
    assert [result.settings["seed"] for result in server.recent.of("image", "user:ann")] == [1, 0]  # newest first
    assert [result.settings["seed"] for result in server.recent.of("image", "browser:abc")] == [2]
