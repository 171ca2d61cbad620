"""The Gradio UI (rank 0): an image tab and a video tab, a status line, and named API endpoints.

Handlers are coroutines on Gradio's event loop. They validate a request (make_request, the one place
a request is checked, then the server's time limit), submit it to the JobQueue, relay its progress
to the page (on the result only: stage, step k/n and time left), and write the result file. The
lockstep service runs one job at a time on the main thread, in arrival order. A client that cancels
(gradio_client's Job.cancel, Gradio's /cancel) or goes away (tab closed, process ended) cancels its
job: every rank drops it at the next step. Error messages name files by their names alone. The seed used goes back into
the Seed box (so unticking "Random seed" repeats a result); a second, private, event then refreshes the tab's
recent-results gallery, where clicking an item puts its settings back into the inputs. A gallery shows its owner's
results alone (Owners): with logins, the user's (from any browser); without, the browser's (a reload shows them again).
With logins, Gradio's file routes serve a result to its owner alone (OwnResults): anyone else gets 404; without
logins a result's name, with its 32 random hex digits, is its only secret.
The status line, refreshed every STATUS_SECONDS and at once when a request is accepted, says in plain words what
runs the models and the last client request's times, what runs now (model, size, step k/n or decoding, time) and
what waits, then, smaller, the technical details (ranks, plan, backend).

API (gradio_client): /generate_image, /generate_video, /status; see `Client(url).view_api()`. The
generate endpoints return (media path, file path, settings, status line, seed used). A tab whose model carries
LoRAs (--lora) takes two more inputs, last: the LoRAs used (a list of names, default none) and one scale for them.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote

import gradio as gr
from gradio.context import LocalContext
from starlette.responses import PlainTextResponse

from app.outputs import RESULT_NAME, RecentResults
from app.ranks.lockstep import Generation
from app.ranks.runtime import Runtime, ServedModel
from app.server.gradio_paths import login_of
from app.server.job_store import JobStore
from app.server.jobs import Failed, Finished, Job, JobQueue, ServiceBusy, ServiceClosed, Started, Step
from app.server.submit import OverQuota, Server, public_message, random_seed, server_line, submit, write
from pipelines.requests import RequestError

__all__ = ["OwnResults", "Owners", "Server", "build_ui", "public_message", "queue_status"]

CLIENT_CHECK_SECONDS = 0.05
"""How often a waiting handler looks at its client (Job.follow's `every`), while its job has no news."""
MAX_MEDIA_PX = 512
"""Images are shown at their own size up to this width (never upscaled); the file is full size."""
STATUS_SECONDS = 2.0
"""How often an open page refreshes its status line."""
STATUS_WAITING_SHOWN = 3
"""Waiting requests the status line names (it counts them all)."""

MIN_VIDEO_PX = 256
"""A video is shown at least this wide (within the column): a smaller one's player, whose controls overlay its
bottom, would be a strip."""

# Gradio's own rules stretch media to its box. An image at native size (no upscaling), at most MAX_MEDIA_PX wide; a
# video at its own size up to the column's width, at least MIN_VIDEO_PX wide.
CSS = f"""
.native-media img, .native-media video {{
  width: auto !important; height: auto !important; max-width: min(100%, {MAX_MEDIA_PX}px) !important;
  max-height: {MAX_MEDIA_PX}px !important; object-fit: contain; margin: 0 auto; display: block;
}}
.native-media video {{
  min-width: min(100%, {MIN_VIDEO_PX}px) !important; max-width: 100% !important; max-height: 80vh !important;
}}
"""


def build_ui(runtime: Runtime, server: Server) -> gr.Blocks:
    """The page for `runtime`'s models."""

    jobs = server.jobs
    names = {key: model.spec.name for key, model in runtime.models.items()}
    owners = Owners()

    def status() -> str:
        return (f"{server_line(runtime, server, details=False)}  \n{queue_status(jobs, names)}  \n"
                f"<small>{runtime.describe_details()}</small>")

    # Gradio's cache holds uploads (results are served from the results folder itself, app.server.serve's static path):
    # every half hour, files older than an hour go (the whole folder goes when the server ends, app.server.serve).
    with gr.Blocks(title="ulysses-studio", delete_cache=(1800, 3600)) as demo:
        gr.HTML(f"<style>{CSS}</style>", container=False, padding=False)
        gr.Markdown("## ulysses-studio")
        status_line = gr.Markdown(status(), label="Status", elem_id="status")
        # Without logins a page's owner is its browser: an id kept in the browser's storage, so that a reload
        # finds its results again (the galleries fill once it is known).
        browser = gr.BrowserState(None, storage_key="ulysses-studio-browser")
        identified = demo.load(owners.identify, inputs=browser, outputs=browser, api_visibility="private",
                               show_progress="hidden", queue=False)
        page = _Page(server, owners, identified, status, status_line, runtime.step_cache, runtime.attention_precision)
        with gr.Tab("Image", id="image"):
            image = runtime.models.get("image")
            if image is None:
                gr.Markdown("This server runs no image model: start it with `--model NAME` (e.g. tiny-flux).")
            else:
                _image_tab(image, page)
        with gr.Tab("Video", id="video"):
            video = runtime.models.get("video")
            if video is None:
                gr.Markdown("This server runs no video model: start it with `--video-model NAME` (e.g. tiny-cosmos).")
            else:
                _video_tab(video, page)
        # no progress overlay on the status line (a busy server answered the page's first status late, and its
        # "0.0s" timer sat on the status line, over the request's own progress)
        demo.load(status, outputs=status_line, api_name="status", queue=False, show_progress="hidden")
        gr.Timer(STATUS_SECONDS).tick(status, outputs=status_line, api_visibility="private", show_progress="hidden",
                                      queue=False)
    # Handlers for every request the JobQueue may hold (waiting and running) and a few more, so that the
    # JobQueue's own refusal, which names --max-queue, is what a client over the limit hears; Gradio's
    # queue holds about as many again, for bursts.
    demo.queue(max_size=jobs.max_waiting + 2, default_concurrency_limit=jobs.max_waiting + 2)
    return demo


def queue_status(jobs: JobQueue, names: dict[str, str]) -> str:
    """What runs and what waits, e.g. "running tiny-flux 512x512, step 3 of 8, 1.2 s of about 3.0 s · 2 waiting:
    tiny-cosmos 128x128, 17 frames, 8 steps; tiny-flux 256x256, 8 steps"; "idle" where nothing does."""
    running, waiting = jobs.snapshot()
    parts = ["; ".join(f"running {job.describe(names[job.model])}" for job in running) or ("" if waiting else "idle")]
    if waiting:
        shown = "; ".join(job.describe(names[job.model]) for job in waiting[:STATUS_WAITING_SHOWN])
        more = f"; and {len(waiting) - STATUS_WAITING_SHOWN} more" if len(waiting) > STATUS_WAITING_SHOWN else ""
        parts.append(f"{len(waiting)} waiting: {shown}{more}")
    return " · ".join(part for part in parts if part)


BROWSER_ID = re.compile(r"[A-Za-z0-9_-]{22}")
"""The form of a browser's id (Owners.identify makes them)."""


class Owners:
    """Whose results a request's are (whose gallery they join): its login's user; without logins, its browser's
    (an id its page keeps in the browser's storage and names as it loads); else (an API client) its session's."""

    def __init__(self, most: int = 10_000) -> None:
        self._most = most
        self._lock = threading.Lock()
        self._browsers: OrderedDict[str, str] = OrderedDict()
        """Session -> its page's browser id; the least recently identified go beyond `most`."""

    def identify(self, browser: str | None, session: gr.Request) -> str:
        """As a page loads: its browser's id (a new one where it brings none) becomes its session's owner; returns
        the id, which the page keeps."""
        if not isinstance(browser, str) or not BROWSER_ID.fullmatch(browser):
            browser = secrets.token_urlsafe(16)
        with self._lock:
            self._browsers[session.session_hash] = browser
            self._browsers.move_to_end(session.session_hash)
            while len(self._browsers) > self._most:
                self._browsers.popitem(last=False)
        return browser

    def of(self, session: gr.Request | None) -> str:
        if session is None:
            return ""
        if session.username:
            return f"user:{session.username}"
        with self._lock:
            browser = self._browsers.get(session.session_hash)
        return f"browser:{browser}" if browser else f"session:{session.session_hash}"


class OwnResults:
    """ASGI middleware before Gradio's routes: where the UI asks for logins, a result file (its name is a result's,
    app.outputs.RESULT_NAME) goes through Gradio's file routes (/gradio_api/file=..., and /file=...) to the login
    whose job made it alone (app.server.job_store); anyone else, and any file of no job, gets 404."""

    def __init__(self, app: Any, *, store: JobStore) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and "/file=" in scope["path"]:
            name = Path(unquote(scope["path"].partition("/file=")[2])).name
            if getattr(scope.get("app"), "auth", None) and RESULT_NAME.fullmatch(name):
                user = login_of(scope)
                owner = await asyncio.to_thread(self.store.owner_of_file, name)
                if user is None or owner != f"user:{user}":
                    await PlainTextResponse("Not Found", status_code=404)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _seed_inputs(prefix: str) -> tuple[gr.Number, gr.Checkbox]:
    with gr.Row():
        seed = gr.Number(label="Seed", value=0, elem_id=f"{prefix}-seed")
        random_seed = gr.Checkbox(label="Random seed", value=True, elem_id=f"{prefix}-random-seed")
    return seed, random_seed


def _size_inputs(model: ServedModel, prefix: str) -> tuple[gr.Number, gr.Number, gr.Number, gr.Number]:
    spec, multiple = model.spec, model.limits.size_multiple
    with gr.Row():
        width = gr.Number(label=f"Width (multiple of {multiple})", value=spec.width,
                          elem_id=f"{prefix}-width")
        height = gr.Number(label=f"Height (multiple of {multiple})", value=spec.height,
                           elem_id=f"{prefix}-height")
        steps = gr.Number(label="Steps", value=spec.steps, elem_id=f"{prefix}-steps")
        guidance = gr.Number(label="Guidance", value=spec.guidance, elem_id=f"{prefix}-guidance")
    return width, height, steps, guidance


def _step_cache_input(step_cache: str | None, prefix: str) -> gr.Checkbox | None:
    """With a server started with --cache: the request's choice of it (on: faster, approximate)."""
    if step_cache is None:
        return None
    return gr.Checkbox(label=f"Faster, approximate: skip steps that barely change (step cache {step_cache})",
                       value=True, elem_id=f"{prefix}-step-cache")


def _quantized_attention_input(precision: str, prefix: str) -> gr.Checkbox | None:
    """With a server started with a quantized --attention-precision: the request's choice of it (on: faster,
    approximate)."""
    if precision == "full":
        return None
    return gr.Checkbox(label=f"Faster, approximate: {precision} attention (first and last steps at full precision)",
                       value=True, elem_id=f"{prefix}-quantized-attention")


def _lora_inputs(model: ServedModel, prefix: str) -> tuple[gr.Dropdown | None, gr.Slider | None]:
    """With --lora files that fit this tab's model: which of them a request uses (default none) and one scale for
    them all (default their --lora scale where they share one, else 1); none loaded: no inputs."""
    loaded = dict(model.limits.loras)
    if not loaded:
        return None, None
    scales = set(loaded.values())
    default = scales.pop() if len(scales) == 1 else 1.0
    with gr.Row():
        choice = gr.Dropdown(label="LoRAs (default none)", choices=list(loaded), value=[], multiselect=True,
                             elem_id=f"{prefix}-lora", scale=3)
        scale = gr.Slider(label="LoRA scale", minimum=0.0, maximum=max(2.0, *loaded.values()), step=0.05,
                          value=default, elem_id=f"{prefix}-lora-scale", scale=2)
    return choice, scale


def _lora_field(names: list[str] | str | None, scale: float | None) -> Any:
    """The request's lora field from the tab's inputs: the names chosen at `scale` (None: each at its --lora scale);
    no name: none."""
    if not names:
        return ()
    names = [names] if isinstance(names, str) else list(names)
    return names if scale is None else [[name, scale] for name in names]


def _generate_buttons(prefix: str) -> tuple[gr.Button, gr.Button]:
    with gr.Row():
        button = gr.Button("Generate", variant="primary", elem_id=f"{prefix}-generate", scale=3)
        stop = gr.Button("Stop", variant="secondary", elem_id=f"{prefix}-stop", scale=1)
    return button, stop


def _recent_gallery(prefix: str) -> tuple[gr.Gallery, gr.State]:
    """The tab's recent results (newest first) and, per page, the settings of what it shows."""
    gallery = gr.Gallery(label="Recent results (click one to restore its settings)", columns=8, height=170,
                         fit_columns=False, allow_preview=False, object_fit="contain", interactive=False,
                         elem_id=f"{prefix}-recent")
    return gallery, gr.State([])


def _examples(model: ServedModel, prompt: gr.Textbox) -> None:
    if model.spec.examples:
        gr.Examples(examples=[[text] for text in model.spec.examples], inputs=[prompt], label="Example prompts")


def _gallery_of(recent: RecentResults, key: str, owner: str) -> tuple[list[tuple[str, str]], list[dict[str, Any]]]:
    results = recent.of(key, owner)
    items = [(str(result.path), f"seed {result.settings['seed']}: {result.settings['prompt'][:40]}")
             for result in results]
    return items, [result.settings for result in results]


class _Page(NamedTuple):
    """What both tabs are built with: the server, the page's owner and its status line, the server's step cache and
    attention precision (which decide the tabs' boxes for them)."""

    server: Server
    owners: Owners
    identified: Any  # the event that learns the page's owner
    status: Callable[[], str]
    status_line: gr.Markdown
    step_cache: str | None
    attention_precision: str


def _image_tab(model: ServedModel, page: _Page) -> None:
    takes_reference = model.limits.reference_image
    gr.Markdown(f"Text{' (and a reference image)' if takes_reference else ''} to image with **{model.spec.name}**.")
    with gr.Row():
        with gr.Column():
            prompt = gr.Textbox(label="Prompt", lines=2, elem_id="image-prompt")
            _examples(model, prompt)
            reference = None
            if takes_reference:
                reference = gr.File(label="Reference image (optional; deleted after use)", type="filepath",
                                    value=None, height=120, elem_id="image-reference")
            seed, random_seed = _seed_inputs("image")
            width, height, steps, guidance = _size_inputs(model, "image")
            cached = _step_cache_input(page.step_cache, "image")
            quantized = _quantized_attention_input(page.attention_precision, "image")
            lora, lora_scale = _lora_inputs(model, "image")
            button, stop = _generate_buttons("image")
        with gr.Column():
            result = gr.Image(label="Image", type="filepath", format="png", elem_id="image-result",
                              elem_classes="native-media", buttons=[])
            download = gr.File(label="PNG with its settings (full size)", elem_id="image-file")
            with gr.Accordion("Settings", open=False):
                settings = gr.JSON(label="Settings", elem_id="image-settings")
    gallery, shown = _recent_gallery("image")

    # The reference image, the step cache's choice, the LoRAs and the attention's precision come last and have
    # defaults, so clients of text-only models, of servers without a step cache, LoRAs or quantized attention call
    # alike.
    async def generate_image(prompt: str, seed: float, random_seed: bool, steps: float, guidance: float,
                             width: float, height: float, condition: str | None = None, step_cache: bool = True,
                             lora: list[str] | None = None, lora_scale: float | None = None,
                             quantized_attention: bool = True,
                             session: gr.Request = None,
                             progress: gr.Progress = gr.Progress()) -> AsyncIterator[tuple]:
        async for update in _generate(model, page, progress, random_seed, session,
                                      prompt=prompt, seed=seed, steps=steps, guidance=guidance, width=width,
                                      height=height, condition=condition or None, step_cache=step_cache,
                                      lora=_lora_field(lora, lora_scale), quantized_attention=quantized_attention):
            yield update

    loras = [lora, lora_scale] if lora is not None else []

    def restore(shown: list[dict[str, Any]], event: gr.SelectData) -> tuple:
        used = shown[event.index]
        return (used["prompt"], used["seed"], False, used["steps"], used["guidance"], used["width"], used["height"],
                *_restored_loras(used, lora_scale), used)

    restored = [prompt, seed, random_seed, steps, guidance, width, height]
    inputs = (restored + ([reference] if reference is not None else [gr.State(None)])
              + ([cached] if cached else [gr.State(True)]) + (loras or [gr.State(None), gr.State(None)])
              + ([quantized] if quantized else [gr.State(True)]))
    _wire(page, model, button, stop, generate_image, inputs, [result, download, settings, page.status_line, seed],
          gallery, shown, restore, [*restored, *loras, settings], reference)


def _restored_loras(used: dict[str, Any], scale: gr.Slider | None) -> tuple:
    """A recent result's LoRAs back into the tab's inputs (none: no inputs): the names, and their scale (the
    first one's; the slider's own where it used none)."""
    if scale is None:
        return ()
    chosen = used.get("lora") or {}
    return list(chosen), next(iter(chosen.values()), scale.value)


def _video_tab(model: ServedModel, page: _Page) -> None:
    takes_input = model.limits.video_input
    gr.Markdown(f"Text{' or image/video' if takes_input else ''} to video with **{model.spec.name}**.")
    with gr.Row():
        with gr.Column():
            prompt = gr.Textbox(label="Prompt", lines=2, elem_id="video-prompt")
            _examples(model, prompt)
            negative_prompt = gr.Textbox(label="Negative prompt", value=model.spec.negative_prompt, lines=1)
            condition = gr.File(label="Input image or video (optional, video-to-world; deleted after use)",
                                type="filepath", value=None, height=120, elem_id="video-condition",
                                visible=takes_input)  # hidden, not left out: the API keeps its arguments
            with gr.Row():
                frames = gr.Number(label=f"Frames (1 + a multiple of {model.limits.frame_multiple})",
                                   value=model.spec.frames)
                fps = gr.Number(label="Frames per second", value=model.spec.fps)
            seed, random_seed = _seed_inputs("video")
            width, height, steps, guidance = _size_inputs(model, "video")
            # Wan 2.2 A14B's low-noise expert's own guidance; hidden, not left out, for one-transformer models
            guidance_2 = gr.Number(label="Guidance of the low-noise expert", value=model.spec.guidance_2,
                                   elem_id="video-guidance-2", visible=model.spec.guidance_2 is not None)
            cached = _step_cache_input(page.step_cache, "video")
            quantized = _quantized_attention_input(page.attention_precision, "video")
            lora, lora_scale = _lora_inputs(model, "video")
            button, stop = _generate_buttons("video")
        with gr.Column():
            result = gr.Video(label="Video", elem_id="video-result", elem_classes="native-media", autoplay=True,
                              loop=True, buttons=[])
            download = gr.File(label="MP4 (full size)", elem_id="video-file")
            with gr.Accordion("Settings", open=False):
                settings = gr.JSON(label="Settings", elem_id="video-settings")
    gallery, shown = _recent_gallery("video")

    # condition and what follows it default to None (the model's defaults), so clients may leave them out.
    async def generate_video(prompt: str, negative_prompt: str | None = None, condition: str | None = None,
                             frames: float | None = None, fps: float | None = None, seed: float | None = None,
                             random_seed: bool = True, steps: float | None = None, guidance: float | None = None,
                             width: float | None = None, height: float | None = None, step_cache: bool = True,
                             lora: list[str] | None = None, lora_scale: float | None = None,
                             guidance_2: float | None = None, quantized_attention: bool = True,
                             session: gr.Request = None,
                             progress: gr.Progress = gr.Progress()) -> AsyncIterator[tuple]:
        async for update in _generate(model, page, progress, random_seed, session,
                                      prompt=prompt, negative_prompt=negative_prompt, condition=condition or None,
                                      frames=frames, fps=fps, seed=seed, steps=steps, guidance=guidance, width=width,
                                      height=height, step_cache=step_cache, lora=_lora_field(lora, lora_scale),
                                      guidance_2=guidance_2, quantized_attention=quantized_attention):
            yield update

    loras = [lora, lora_scale] if lora is not None else []

    def restore(shown: list[dict[str, Any]], event: gr.SelectData) -> tuple:
        used = shown[event.index]
        return (used["prompt"], used["negative_prompt"], used["frames"], used["fps"], used["seed"], False,
                used["steps"], used["guidance"], used.get("guidance_2"), used["width"], used["height"],
                *_restored_loras(used, lora_scale), used)

    # guidance_2 and the attention's precision come last, after placeholders for the LoRA inputs a server without
    # LoRAs has not got
    inputs = [prompt, negative_prompt, condition, frames, fps, seed, random_seed, steps, guidance, width, height,
              *([cached] if cached else [gr.State(True)]), *(loras or [gr.State(None), gr.State(None)]), guidance_2,
              quantized or gr.State(True)]
    restored = [prompt, negative_prompt, frames, fps, seed, random_seed, steps, guidance, guidance_2, width, height]
    _wire(page, model, button, stop, generate_video, inputs, [result, download, settings, page.status_line, seed],
          gallery, shown, restore, [*restored, *loras, settings], condition)


def _wire(page: _Page, model: ServedModel, button: gr.Button, stop: gr.Button, handler: Callable[..., Any],
          inputs: list, outputs: list, gallery: gr.Gallery, shown: gr.State, restore: Callable[..., tuple],
          restored: list, upload: gr.File | None) -> None:
    """The tab's API endpoint (named as its handler) on its button (progress and errors on the result only), its
    Stop button (the ranks drop the request at the next step), then its gallery (also once the page's owner is
    known), its `upload` input emptied after each request, and a click on the gallery putting an item's settings
    back into `restored` (restore)."""

    def refresh(session: gr.Request) -> tuple:
        return _gallery_of(page.server.recent, model.key, page.owners.of(session))

    event = button.click(handler, inputs=inputs, outputs=outputs, api_name=handler.__name__,
                         show_progress_on=outputs[0], concurrency_id="generate")
    stop.click(None, cancels=[event], api_visibility="private", queue=False)
    event.success(refresh, outputs=[gallery, shown], api_visibility="private", show_progress="hidden", queue=False)
    page.identified.then(refresh, outputs=[gallery, shown], api_visibility="private", show_progress="hidden",
                         queue=False)
    if upload is not None:
        # The request deleted its upload from the server: empty the input, so that the page does not offer it again.
        event.then(lambda: None, outputs=upload, api_visibility="private", show_progress="hidden", queue=False)
    gallery.select(restore, inputs=shown, outputs=restored, api_visibility="private", show_progress="hidden")


class _Progress:
    """Relays a job's events to Gradio's progress: the stage, step k/n, and time left from the step times."""

    def __init__(self, progress: gr.Progress, steps: int, step_seconds: float | None) -> None:
        self._progress = progress
        self._steps = steps
        self._step_seconds = step_seconds  # the model's last request's, until this one has taken two steps
        self._first_step_at: float | None = None

    def _left(self, steps_left: int) -> str:
        if self._step_seconds is None:
            return ""
        seconds = steps_left * self._step_seconds
        return f" · about {seconds:.1f} s left" if seconds < 10 else f" · about {seconds:.0f} s left"

    def queued(self) -> None:
        self._progress(0, desc="queued", unit=f"steps{self._left(self._steps)}")

    def started(self) -> None:
        self._progress((0, self._steps), desc="encoding", unit=f"steps{self._left(self._steps)}")

    def step(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self._first_step_at is None:
            self._first_step_at = now
        elif done > 1:
            self._step_seconds = (now - self._first_step_at) / (done - 1)
        if done < total:
            self._progress((done, total), desc="denoising", unit=f"steps{self._left(total - done)}")
        else:
            self._progress((done, total), desc="decoding", unit="steps")

    def writing(self) -> None:
        self._progress((self._steps, self._steps), desc="writing", unit="steps")


async def _generate(model: ServedModel, page: _Page, progress: gr.Progress, random: bool, session: gr.Request | None,
                    **fields: Any) -> AsyncIterator[tuple]:
    """Validate, queue, wait (relaying progress), write the file. Yields the handler's outputs twice: once the
    request is queued, the status line alone (which then says so, not at the page's next refresh); at the end,
    (media path, file path, settings, status line, seed used).

    An upload the request brings is deleted once the request has ended (or was refused).
    """
    if random:
        fields["seed"] = random_seed()
    owner = page.owners.of(session)
    try:
        submitted = await submit(model, page.server, owner=owner or "anyone", **fields)
    except (RequestError, ServiceClosed, ServiceBusy, OverQuota) as error:
        raise gr.Error(public_message(str(error)), print_exception=False) from None
    try:
        yield gr.skip(), gr.skip(), gr.skip(), page.status(), gr.skip()
    except GeneratorExit:  # Gradio resumes no handler whose client has gone by its yield: nobody wants the job
        submitted.job.cancel("the client went away")
        raise
    request, estimate = submitted.request, submitted.estimate
    relay = _Progress(progress, request.steps, None if estimate is None else estimate / request.steps)
    generation = await _wait(submitted.job, relay)
    relay.writing()
    try:
        path, used = await write(model, page.server, submitted, generation, owner)
    except Exception as error:  # Gradio shows an exception's own text (show_error): without the server's paths
        raise gr.Error(public_message(str(error))) from error
    yield str(path), str(path), used, page.status(), used["seed"]


async def _wait(job: Job, relay: _Progress) -> Generation:
    """Relay `job`'s progress until it ends; cancel it if this handler is cancelled or its client leaves."""
    relay.queued()
    async for event in job.follow(_client_gone(), CLIENT_CHECK_SECONDS):
        if isinstance(event, Started):
            relay.started()
        elif isinstance(event, Step):
            relay.step(event.done, event.total)
        elif isinstance(event, Failed):
            raise gr.Error(public_message(event.message), print_exception=False)  # the failing rank logged it
        elif isinstance(event, Finished):
            return event.generation
    raise RuntimeError("the job's events ended without its result")  # Job.follow ends with Finished or Failed


def _client_gone() -> Callable[[], Awaitable[bool]]:
    """Whether this handler's client has gone, as Gradio's queue knows it.

    When a client's event stream closes, Gradio marks its events not alive (Queue.clean_events) but
    stops only generator handlers; a coroutine like ours must look for itself. This reads Gradio's
    queue (gradio>=6,<7, tests/test_app_limits.py checks it); outside a Gradio event it says False.
    """
    blocks, event_id = LocalContext.blocks.get(None), LocalContext.event_id.get(None)
    queue = getattr(blocks, "_queue", None)
    event = queue.event_ids_to_events.get(event_id) if queue is not None and event_id else None

    async def gone() -> bool:
        return event is not None and not event.alive

    return gone
