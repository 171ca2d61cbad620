"""The Gradio UI (rank 0): an image tab and a video tab, a status line, and named API endpoints.

Handlers run in Gradio's worker threads. They validate a request (make_request, the one place a
request is checked), submit it to the JobQueue, relay its per-step progress to the page, and write
the result file. The lockstep service runs one job at a time on the main thread, in arrival order.

API (gradio_client): /generate_image, /generate_video, /status; see `Client(url).view_api()`.
"""

from __future__ import annotations

import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import gradio as gr

from app.jobs import Failed, JobQueue, ServiceClosed, Step
from app.outputs import EXTENSIONS, settings_of, write_result
from app.runtime import Runtime, ServedModel
from pipelines.requests import RequestError, make_request

RANDOM_SEED_LIMIT = 2**32
MAX_WAITING = 64
"""Requests Gradio holds beyond the ones waiting in our JobQueue; more are refused with a message."""
MAX_WAITING_HANDLERS = 16
"""Handler threads that may wait on the JobQueue at once (each holds one queued request)."""


def build_ui(runtime: Runtime, jobs: JobQueue, out_dir: Path) -> gr.Blocks:
    """The page for `runtime`'s models; results are written under `out_dir`."""

    def status() -> str:
        return runtime.describe(runtime.service.last_step_seconds)

    with gr.Blocks(title="ulysses-studio") as demo:
        gr.Markdown("## ulysses-studio")
        status_line = gr.Markdown(status(), label="Status", elem_id="status")
        with gr.Tab("Image", id="image"):
            image = runtime.models.get("image")
            if image is None:
                gr.Markdown("This server runs no image model: start it with `--model NAME` (e.g. tiny-flux).")
            else:
                _image_tab(image, jobs, out_dir, status, status_line)
        with gr.Tab("Video", id="video"):
            video = runtime.models.get("video")
            if video is None:
                gr.Markdown("This server runs no video model: start it with `--video-model NAME` (e.g. tiny-cosmos).")
            else:
                _video_tab(video, jobs, out_dir, status, status_line)
        demo.load(status, outputs=status_line, api_name="status", queue=False)
    demo.queue(max_size=MAX_WAITING)
    return demo


def _seed_inputs() -> tuple[gr.Number, gr.Checkbox]:
    with gr.Row():
        seed = gr.Number(label="Seed", value=0, precision=0)
        random_seed = gr.Checkbox(label="Random seed", value=True)
    return seed, random_seed


def _size_inputs(model: ServedModel) -> tuple[gr.Number, gr.Number, gr.Number, gr.Number]:
    spec, multiple = model.spec, model.limits.size_multiple
    with gr.Row():
        width = gr.Number(label=f"Width (multiple of {multiple})", value=spec.width, precision=0)
        height = gr.Number(label=f"Height (multiple of {multiple})", value=spec.height, precision=0)
        steps = gr.Number(label="Steps", value=spec.steps, precision=0)
        guidance = gr.Number(label="Guidance", value=spec.guidance)
    return width, height, steps, guidance


def _image_tab(model: ServedModel, jobs: JobQueue, out_dir: Path, status, status_line: gr.Markdown) -> None:
    gr.Markdown(f"Text to image with **{model.spec.name}**.")
    prompt = gr.Textbox(label="Prompt", lines=2, elem_id="image-prompt")
    seed, random_seed = _seed_inputs()
    width, height, steps, guidance = _size_inputs(model)
    button = gr.Button("Generate", variant="primary", elem_id="image-generate")
    result = gr.Image(label="Image", type="filepath", format="png", elem_id="image-result")
    download = gr.File(label="PNG with its settings")
    settings = gr.JSON(label="Settings")

    def generate_image(prompt: str, seed: float, random_seed: bool, steps: float, guidance: float,
                       width: float, height: float, progress: gr.Progress = gr.Progress()) -> tuple:
        path, used = _generate(model, jobs, out_dir, progress, random_seed, prompt=prompt, seed=seed, steps=steps,
                               guidance=guidance, width=width, height=height)
        return str(path), str(path), used, status()

    button.click(generate_image, inputs=[prompt, seed, random_seed, steps, guidance, width, height],
                 outputs=[result, download, settings, status_line], api_name="generate_image",
                 concurrency_limit=MAX_WAITING_HANDLERS, concurrency_id="generate")


def _video_tab(model: ServedModel, jobs: JobQueue, out_dir: Path, status, status_line: gr.Markdown) -> None:
    gr.Markdown(f"Text or image/video to video with **{model.spec.name}**.")
    prompt = gr.Textbox(label="Prompt", lines=2, elem_id="video-prompt")
    negative_prompt = gr.Textbox(label="Negative prompt", value=model.spec.negative_prompt, lines=1)
    condition = gr.File(label="Input image or video (optional: video-to-world)", type="filepath", height=120)
    with gr.Row():
        frames = gr.Number(label=f"Frames (1 + a multiple of {model.limits.frame_multiple})",
                           value=model.spec.frames, precision=0)
        fps = gr.Number(label="Frames per second", value=model.spec.fps, precision=0)
    seed, random_seed = _seed_inputs()
    width, height, steps, guidance = _size_inputs(model)
    button = gr.Button("Generate", variant="primary", elem_id="video-generate")
    result = gr.Video(label="Video", elem_id="video-result")
    download = gr.File(label="MP4")
    settings = gr.JSON(label="Settings")

    def generate_video(prompt: str, negative_prompt: str, condition: str | None, frames: float, fps: float,
                       seed: float, random_seed: bool, steps: float, guidance: float, width: float, height: float,
                       progress: gr.Progress = gr.Progress()) -> tuple:
        path, used = _generate(model, jobs, out_dir, progress, random_seed, prompt=prompt,
                               negative_prompt=negative_prompt, condition=condition or None, frames=frames,
                               fps=fps, seed=seed, steps=steps, guidance=guidance, width=width, height=height)
        return str(path), str(path), used, status()

    button.click(generate_video,
                 inputs=[prompt, negative_prompt, condition, frames, fps, seed, random_seed, steps, guidance,
                         width, height],
                 outputs=[result, download, settings, status_line], api_name="generate_video",
                 concurrency_limit=MAX_WAITING_HANDLERS, concurrency_id="generate")


def _generate(model: ServedModel, jobs: JobQueue, out_dir: Path, progress: gr.Progress, random_seed: bool,
              **fields: Any) -> tuple[Path, dict[str, Any]]:
    """Validate, queue, wait (relaying progress), write the file; returns its path and its settings."""
    if random_seed:
        fields["seed"] = secrets.randbelow(RANDOM_SEED_LIMIT)
    try:
        request = make_request(model.spec, model.limits, **fields)
        job = jobs.submit(model.key, request)
    except (RequestError, ServiceClosed) as error:
        raise gr.Error(str(error), print_exception=False) from None
    progress(0, desc="queued")
    for event in job.events():
        if isinstance(event, Step):
            progress((event.done, event.total), desc="denoising", unit="steps")
        elif isinstance(event, Failed):
            raise gr.Error(event.message, print_exception=False)  # the failing rank logged its traceback
        else:
            generation = event.generation
    name = f"{model.key}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}-seed{request.seed}"
    path = write_result(generation.result, out_dir / f"{name}{EXTENSIONS[model.spec.media]}", request, model.spec)
    settings = settings_of(request, model.spec)
    settings.update(seconds=round(generation.seconds, 3), step_seconds=round(generation.step_seconds, 4))
    return path, settings
