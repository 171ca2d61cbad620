"""One generation request, and the single place where a request is checked.

Every way in (CLI, UI, batch file) builds a GenerationRequest with `make_request`, which fills the
model's defaults and validates everything before any model work or collective starts: an invalid
request is one RequestError naming every bad field in words a person understands, never a crash on
some rank.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pipelines.family import load
from pipelines.media_suffixes import IMAGE_SUFFIXES, VIDEO_SUFFIXES
from pipelines.registry import ModelSpec, family_of

MAX_PROMPT_CHARS = 4000
MAX_STEPS = 500
MAX_SEED = 2**63 - 1


class RequestError(ValueError):
    """A request a model cannot run, with a message meant for the person who made it.

    `problems` lists one message per bad field; the message joins them (one problem: that message alone).
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]

    @classmethod
    def of(cls, problems: list[str]) -> RequestError:
        """One error for all of `problems` (at least one)."""
        if len(problems) == 1:
            return cls(problems[0])
        numbered = " ".join(f"({number}) {problem}" for number, problem in enumerate(problems, 1))
        return cls(f"{len(problems)} problems with this request: {numbered}", problems)


@dataclass(frozen=True, kw_only=True, slots=True)
class MediaLimits:
    """What sizes and frame counts a model accepts, read from its own config."""

    size_multiple: int
    """Height and width must be multiples of this (VAE downsampling x transformer patch)."""
    max_height: int
    max_width: int
    frame_multiple: int = 1
    """Video frame counts must be 1 + k * frame_multiple (the VAE's temporal compression)."""
    max_frames: int = 1
    min_frames: int = 1
    """Fewest frames a video request may ask for (a model that makes images at one frame serves them
    under its image name, so its video name starts above one)."""
    reference_image: bool = False
    """An image request may bring a reference image (FLUX.2's image-conditioned generation)."""
    video_input: bool = True
    """A video request may bring an input image or video whose frames it continues (video-to-world); False:
    videos from text alone (Wan 2.1 text-to-video)."""
    first_frame_input: bool = False
    """A video request's input (video_input) is one image, the video's first frame (image-to-video), not frames
    it continues: a video file is refused."""
    input_required: bool = False
    """A video request must bring its input (an image-to-video checkpoint makes no video from text alone); an
    image request its reference image (reference_image: an editing checkpoint)."""
    reference_area: int = 0
    """Pixels a reference image is resized to (about, its aspect kept) before its tokens join the image's, which
    the work estimate counts (pipelines.work): an editing checkpoint's, from its limits; 0: none counted."""
    loras: tuple[tuple[str, float], ...] = ()
    """The LoRAs this run loaded (--lora) for this model and their scales: what a generate or batch request that
    names no LoRA uses (serve's requests name none by default: app.server.submit)."""
    guidance_split: bool = False
    """The ranks run the conditional and unconditional guidance branches apart (--cfg-parallel), so a
    request must use guidance (guided): without it there is one branch, and half the ranks would idle."""
    guided_below_1: bool = False
    """Its guidance runs at every scale but 1 (diffusers' guider: FLUX.3's base model), not above 1 alone (the
    pipelines' `guidance_scale > 1`)."""

    def guided(self, guidance: float) -> bool:
        """Whether a request at `guidance` makes guidance's second branch (a model that has one)."""
        return guidance > 1.0 or (self.guided_below_1 and not math.isclose(guidance, 1.0))


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationRequest:
    """A complete, validated request: every field set, nothing left to a default."""

    prompt: str
    negative_prompt: str
    height: int
    width: int
    steps: int
    guidance: float
    seed: int
    frames: int
    fps: int
    guidance_2: float | None = None
    """A two-expert model's guidance on its second (low-noise) expert's steps (WanPipeline's guidance_scale_2);
    None for a model of one transformer."""
    condition: str | None = None
    """Image or video file whose frames condition a video-to-world request, or the reference image of an
    image request (models whose limits take one)."""
    step_cache: bool = True
    """In a run with a step cache (--cache): let it skip steps (faster, approximate); False computes every
    step. No effect without one."""
    lora: tuple[tuple[str, float], ...] = ()
    """The run's loaded LoRAs this request uses and their scales (engines/weights/lora.py); () none."""
    quantized_attention: bool = True
    """In a run with a quantized attention precision (--attention-precision fp8 or int8): use it (faster,
    approximate); False runs every step's attention at full precision. No effect without one."""

    def to_dict(self) -> dict[str, Any]:
        """The fields (settings, metadata, manifests); guidance_2 only where a model has a second expert,
        quantized_attention only where the request turned it off."""
        fields = asdict(self)
        if fields["guidance_2"] is None:
            del fields["guidance_2"]
        if fields["quantized_attention"]:
            del fields["quantized_attention"]
        return fields

    def with_seed(self, seed: int) -> GenerationRequest:
        return replace(self, seed=seed)


def uses_guidance_batch(spec: ModelSpec) -> bool:
    """True for models whose classifier-free guidance has two branches (their record or their family's
    says so: Cosmos-style yes, FLUX-style, guidance-distilled, no)."""
    return family_of(spec).guidance_batch if spec.guidance_batch is None else spec.guidance_batch


def read_limits(spec: ModelSpec, folder: Path, *, cfg_parallel: bool = False) -> MediaLimits:
    """What `folder`'s model accepts, from its configs (no weights are loaded), by its family's
    limits function.

    cfg_parallel: the run splits guidance branches across ranks (it applies to uses_guidance_batch models).
    """
    limits = load(family_of(spec).limits)(spec, folder)
    return replace(limits, guidance_split=cfg_parallel and uses_guidance_batch(spec))


def _as_int(name: str, value: Any, allowed: str) -> int:
    """`value` as a whole number: an int, a float or a string (CSV and API clients) that is one (2.0 is 2).
    Anything else, 2.5 included, is refused rather than rounded: the person meant something else.

    allowed: the field's valid values in words, for the message.
    """
    refused = RequestError(f"{name} must be a whole number ({allowed}), got {value!r}")
    if isinstance(value, bool):
        raise refused
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)  # exact for seeds beyond a float's 53 bits
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise refused from None
    if isinstance(value, float):
        if not value.is_integer():  # also NaN and infinities
            raise refused
        return int(value)
    if not isinstance(value, int):
        raise refused
    return value


def _as_float(name: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool):
        raise RequestError(f"{name} must be a number ({allowed}), got {value!r}")
    try:
        result = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be a number ({allowed}), got {value!r}") from None
    if not math.isfinite(result):
        raise RequestError(f"{name} must be a finite number ({allowed}), got {value!r}")
    return result


def _valid_near(value: int, step: int, first: int, last: int) -> list[int]:
    """The valid values next to `value` (one each side, or `value`'s own) among first, first + step, ... last."""
    below = first + (value - first) // step * step
    return [option for option in dict.fromkeys((below, below + step)) if first <= option <= last]


def _check_stepped(name: str, value: int, *, step: int, first: int, last: int, rule: str, allowed: str) -> None:
    """`value` is one of first, first + step, ... last; else one message: too small, too large (with the
    bound alone), or off the grid (with the valid values either side, never one outside the range).

    rule: what the grid is, in words ("a multiple of 16"); allowed: the whole range, in words.
    """
    if value < first:
        raise RequestError(f"{name} {value} is too small: at least {first} ({allowed})")
    if value > last:
        raise RequestError(f"{name} {value} is too large: at most {last} ({allowed})")
    if (value - first) % step:
        options = " or ".join(map(str, _valid_near(value, step, first, last)))
        raise RequestError(f"{name} {value} is not {rule}, which this model needs; use {options} ({allowed})")


def _size_range(multiple: int, maximum: int) -> str:
    return f"multiples of {multiple} from {multiple} to {maximum // multiple * multiple}"


def _check_size(name: str, value: int, multiple: int, maximum: int) -> None:
    _check_stepped(name, value, step=multiple, first=multiple, last=maximum // multiple * multiple,
                   rule=f"a multiple of {multiple}", allowed=_size_range(multiple, maximum))


def _frame_range(limits: MediaLimits) -> tuple[int, int]:
    """The fewest and most frames a video request may ask for (both 1 + a multiple of frame_multiple)."""
    multiple = limits.frame_multiple
    first = 1 + -(-(max(limits.min_frames, 1) - 1) // multiple) * multiple
    return first, 1 + (limits.max_frames - 1) // multiple * multiple


def _frames_allowed(limits: MediaLimits) -> str:
    first, last = _frame_range(limits)
    if limits.frame_multiple == 1:
        return f"{first} to {last}"
    return f"1 + a multiple of {limits.frame_multiple}, from {first} to {last}"


def _check_video_frames(limits: MediaLimits, frames: int) -> None:
    first, last = _frame_range(limits)
    _check_stepped("frames", frames, step=limits.frame_multiple, first=first, last=last,
                   rule=f"1 + a multiple of {limits.frame_multiple}", allowed=_frames_allowed(limits))


class _Problems:
    """Collects every field's error, so that one RequestError names all of them."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def check(self, check: Callable[..., Any], *args: Any) -> Any:
        """check(*args), or None (and its message noted) if it raises RequestError."""
        try:
            return check(*args)
        except RequestError as error:
            self.messages.extend(error.problems)
            return None


def _as_switch(problems: _Problems, name: str, value: Any) -> bool:
    """A request's true/false field (`value`; "true"/"false" from CSV prompt files), or its problem noted."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        problems.messages.append(f"{name} must be true or false, got {value!r}")
    return value


def visible(text: str) -> str:
    """`text` without white space and without control, format (zero-width) and other invisible characters
    (Unicode categories C*): what is left is what a person can see."""
    return "".join(ch for ch in text if not ch.isspace() and not unicodedata.category(ch).startswith("C"))


def _check_prompt(prompt: Any) -> None:
    if not isinstance(prompt, str) or not visible(prompt):
        raise RequestError("prompt is empty: describe what to generate")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RequestError(f"prompt is {len(prompt)} characters long; the limit is {MAX_PROMPT_CHARS}")


def _check_negative(negative_prompt: Any) -> None:
    if not isinstance(negative_prompt, str) or len(negative_prompt) > MAX_PROMPT_CHARS:
        raise RequestError(f"negative prompt must be text of at most {MAX_PROMPT_CHARS} characters")


def _check_steps(steps: int) -> None:
    if not 1 <= steps <= MAX_STEPS:
        raise RequestError(f"steps must be between 1 and {MAX_STEPS}, got {steps}")


def _check_guidance(limits: MediaLimits, guidance: float, name: str = "guidance") -> None:
    if not 0.0 <= guidance <= 100.0:
        raise RequestError(f"{name} must be between 0 and 100, got {guidance}")
    if limits.guidance_split and not limits.guided(guidance):
        wanted = "other than 1" if limits.guided_below_1 else "above 1"
        raise RequestError(f"{name} must be {wanted} here (got {guidance:g}): this run splits classifier-free "
                           "guidance's two branches across ranks (--cfg-parallel), and without guidance there is one")


def _check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise RequestError(f"seed must be between 0 and {MAX_SEED}, got {seed}")


def _check_fps(fps: int) -> None:
    if not 1 <= fps <= 240:
        raise RequestError(f"fps must be between 1 and 240, got {fps}")


def _check_condition(condition: Any) -> str:
    """The input file's path, once its header shows a readable file within pipelines.media's INPUT_LIMITS.
    Messages name the file by its name alone: on a server its folder is the server's business."""
    from pipelines.media import MediaError, check_input  # numpy and PIL: not for every command line's start

    path = Path(str(condition))
    try:
        found = path.is_file()
    except OSError as error:  # a name too long for the file system, a folder this process may not enter
        raise RequestError(f"input file {path.name} cannot be read ({error.strerror})") from None
    if not found:
        raise RequestError(f"input file {path.name} does not exist")
    if path.suffix.lower() not in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
        raise RequestError(f"input file {path.name} is neither an image ({', '.join(IMAGE_SUFFIXES)}) "
                           f"nor a video ({', '.join(VIDEO_SUFFIXES)})")
    try:
        check_input(path)
    except MediaError as error:
        raise RequestError(str(error)) from None
    return str(path)


def _check_image(condition: Any, takes: str) -> str:
    """An input image's path (_check_condition); a video is refused, `takes` saying what the model takes instead."""
    if Path(str(condition)).suffix.lower() in VIDEO_SUFFIXES:
        raise RequestError(f"input file {Path(str(condition)).name} is a video; this model {takes}")
    return _check_condition(condition)


def _check_first_frame(condition: Any) -> str:
    """An image-to-video input's path, once its header shows a readable image (a video is refused)."""
    return _check_image(condition, "starts a video from an image (its first frame)")


REFERENCE_MIN_SIDE, REFERENCE_MAX_ASPECT = 64, 8
"""The reference images FLUX.2's pipelines accept (Flux2ImageProcessor.check_image_input)."""


def _check_reference(condition: Any) -> str:
    """A reference image's path, once its header shows an image FLUX.2's pipelines accept."""
    from pipelines.media import probe

    path = _check_image(condition, "takes a reference image")
    info = probe(path)
    if min(info.width, info.height) < REFERENCE_MIN_SIDE:
        raise RequestError(f"reference image {Path(path).name} is {info.width}x{info.height}; both sides must be at "
                           f"least {REFERENCE_MIN_SIDE} pixels")
    if max(info.width, info.height) > REFERENCE_MAX_ASPECT * min(info.width, info.height):
        raise RequestError(f"reference image {Path(path).name} is {info.width}x{info.height}; its long side may be "
                           f"at most {REFERENCE_MAX_ASPECT} times its short side")
    return path


def _check_lora(limits: MediaLimits, value: Any, model: str = "") -> tuple[tuple[str, float], ...]:
    """A request's LoRA choice as (name, scale) pairs of the run's loaded LoRAs: "a:0.8,b" (CSV, text), {"a": 0.8},
    or a list of names and [name, scale] pairs (JSON); a name without a scale takes its --lora scale."""
    from engines.options import LORA_MAX_SCALE, LoraError, check_lora_scale

    defaults = dict(limits.loras)
    if isinstance(value, str):
        value = [part.strip().rsplit(":", 1) if ":" in part else part.strip()
                 for part in value.split(",") if part.strip()]
    items = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple)):
        raise RequestError(f"lora must be names with scales such as \"style:0.8,detail\", got {value!r}")
    chosen: dict[str, float] = {}
    for item in items:
        if isinstance(item, str):
            name, scale = item, None
        elif isinstance(item, (list, tuple)) and len(item) in (1, 2) and isinstance(item[0], str):
            name, scale = item[0], item[1] if len(item) == 2 else None
        else:
            raise RequestError(f"lora must be names with scales such as \"style:0.8,detail\", got {item!r}")
        name = name.strip()
        if name not in defaults:
            loaded = ", ".join(defaults) or "none (start the run with --lora NAME=PATH)"
            raise RequestError(f"LoRA {name!r} is not loaded in this run{f' for {model}' if model else ''}; "
                               f"{f'{model} has' if model else 'loaded'}: {loaded}")
        if name in chosen:
            raise RequestError(f"LoRA {name!r} is named twice")
        scale = defaults[name] if scale is None else _as_float(f"LoRA {name}'s scale", scale,
                                                                     f"-{LORA_MAX_SCALE:g} to {LORA_MAX_SCALE:g}")
        try:
            check_lora_scale(name, scale)
        except LoraError as error:
            raise RequestError(str(error)) from None
        chosen[name] = float(scale)
    return tuple(chosen.items())


def make_request(spec: ModelSpec, limits: MediaLimits, **fields: Any) -> GenerationRequest:
    """Fill `spec`'s defaults for missing (or None) fields and validate the result.

    Raises one RequestError naming every field that is wrong and what would be right.
    """
    unknown = set(fields) - set(GenerationRequest.__dataclass_fields__)
    if unknown:
        raise RequestError(f"unknown request field(s): {', '.join(sorted(unknown))}")
    given = {key: value for key, value in fields.items() if value is not None}
    problems = _Problems()

    prompt = given.get("prompt", "")
    problems.check(_check_prompt, prompt)
    negative_prompt = given.get("negative_prompt", spec.negative_prompt)
    problems.check(_check_negative, negative_prompt)

    height = problems.check(_as_int, "height", given.get("height", spec.height),
                            _size_range(limits.size_multiple, limits.max_height))
    if height is not None:
        problems.check(_check_size, "height", height, limits.size_multiple, limits.max_height)
    width = problems.check(_as_int, "width", given.get("width", spec.width),
                           _size_range(limits.size_multiple, limits.max_width))
    if width is not None:
        problems.check(_check_size, "width", width, limits.size_multiple, limits.max_width)

    steps = problems.check(_as_int, "steps", given.get("steps", spec.steps), f"1 to {MAX_STEPS}")
    if steps is not None:
        problems.check(_check_steps, steps)

    guidance = problems.check(_as_float, "guidance", given.get("guidance", spec.guidance), "0 to 100")
    if guidance is not None:
        problems.check(_check_guidance, limits, guidance)

    guidance_2 = None
    if spec.experts > 1:
        default_2 = spec.guidance_2 if spec.guidance_2 is not None else guidance
        guidance_2 = problems.check(_as_float, "guidance_2", given.get("guidance_2", default_2), "0 to 100")
        if guidance_2 is not None:
            problems.check(_check_guidance, limits, guidance_2, "guidance_2")
    elif "guidance_2" in given:
        problems.messages.append(f"guidance_2 is the second expert's guidance of a two-expert model (Wan 2.2 A14B); "
                                 f"model '{spec.name}' has one transformer: use guidance")

    seed = problems.check(_as_int, "seed", given.get("seed", 0), f"0 to {MAX_SEED}")
    if seed is not None:
        problems.check(_check_seed, seed)

    frames = problems.check(_as_int, "frames", given.get("frames", spec.frames),
                            "1 for an image model" if spec.media == "image" else _frames_allowed(limits))
    fps = problems.check(_as_int, "fps", given.get("fps", spec.fps), "1 to 240")
    condition = given.get("condition")
    step_cache = _as_switch(problems, "step_cache", given.get("step_cache", True))
    quantized_attention = _as_switch(problems, "quantized_attention", given.get("quantized_attention", True))
    if spec.media == "image":
        if frames is not None and frames != 1:
            problems.messages.append(f"model '{spec.name}' makes images; frames must be 1, got {frames}")
        if condition is not None and not limits.reference_image:
            problems.messages.append(
                f"model '{spec.name}' makes images from text alone; it takes no input image or video")
        elif condition is not None:
            condition = problems.check(_check_reference, condition)
        elif limits.input_required:
            problems.messages.append(f"model '{spec.name}' edits an image: give one as its input")
    else:
        if frames is not None:
            problems.check(_check_video_frames, limits, frames)
        if fps is not None:
            problems.check(_check_fps, fps)
        if condition is not None and not limits.video_input:
            problems.messages.append(
                f"model '{spec.name}' makes videos from text alone; it takes no input image or video")
        elif condition is not None:
            condition = problems.check(_check_first_frame if limits.first_frame_input else _check_condition,
                                       condition)
        elif limits.input_required:
            problems.messages.append(f"model '{spec.name}' makes videos from an image: give one as its input "
                                     "(its first frame)")

    lora = problems.check(_check_lora, limits, given.get("lora", limits.loras), spec.name)

    if problems.messages:
        raise RequestError.of(problems.messages)
    return GenerationRequest(
        prompt=prompt, negative_prompt=negative_prompt, height=height, width=width, steps=steps,
        guidance=guidance, guidance_2=guidance_2, seed=seed, frames=frames, fps=fps, condition=condition,
        step_cache=step_cache, lora=lora, quantized_attention=quantized_attention,
    )
