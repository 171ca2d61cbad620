"""Model cards (README.md) for the trained tiny models: data, training, size, limits, held-out scores."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from training import shapes
from training.loop import PhaseResult

LIMITS = """\
## Limits

- It draws one flat-coloured shape on a plain background, nothing else: no textures, no scenes, no
  people, no text. Prompts outside the caption grammar above fall back to character-level T5 tokens and
  give some shape in some colour.
- Sizes far from the training sizes (above) place and scale shapes less reliably.
- It is a test fixture and a demonstration of the code path, not a generative model of the world.
"""
VIDEO_LIMITS = """\
- In videos the object mostly has the asked colour, shape and motion (held-out colour 100%, shape 83%, motion
  100%, on the GPU and on a 2-core CPU), but stars mostly come out as diamonds or circles (4 of the 5 held-out
  star prompts), the first frame is rougher than the rest, and edges are softer than in the training clips.
  The VAE alone keeps the colour and motion of every held-out clip and the shape of 96%.
"""
"""The tiny-cosmos limit, with numbers measured on assets/tiny-cosmos (the fifteen runs of its training.json),
not by the run that writes the card: review them when the model is trained further."""


def _parameters(parts: dict) -> str:
    rows = []
    for name, part in parts.items():
        if isinstance(part, torch.nn.Module):
            rows.append(f"| {name} | {type(part).__name__} | {sum(p.numel() for p in part.parameters()):,} |")
    return "| component | class | parameters |\n| --- | --- | --- |\n" + "\n".join(rows)


def write_card(folder: Path, name: str, parts: dict, results: list[PhaseResult], settings: dict, run: dict,
               history: list[dict] | None = None) -> None:
    """Write folder/README.md and folder/training.json for a freshly trained model.

    `history`: the training.json runs of the weights this run started from (--init), oldest first.
    """
    as_json = {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}
    runs = [*(history or []), {**run, "settings": as_json, "phases": [asdict(r) for r in results]}]
    (folder / "training.json").write_text(json.dumps(runs, indent=2) + "\n")
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    video = name == "tiny-cosmos"
    example = shapes.held_out_video_prompts()[0][0] if video else shapes.held_out_image_prompts()[0][0]
    phases = "\n".join(
        f"| {i} | {r['name']} | {r['steps']} | {r['samples']:,} | {r['seconds']:.0f} s | "
        f"{r['first_loss']:.4f} -> {r['last_loss']:.4f} |"
        for i, past in enumerate(runs, 1) for r in past["phases"]
    )
    commands = "\n".join(f"{i}. `{past['command']}` ({past['device']}, torch {past['torch']}, seed {past['seed']}, "
                         f"settings `{past['settings']}`)" for i, past in enumerate(runs, 1))
    if video:
        data = (f"Clips of one shape ({', '.join(shapes.SHAPES)}) in one colour ({', '.join(shapes.COLOURS)}) on a "
                f"plain background ({', '.join(shapes.BACKGROUNDS)}, never the shape's colour), "
                f"{' / '.join(shapes.MOTION_PHRASES.values())}, e.g. \"{example}\"; its half-size a fraction "
                "of the frame width, the run's settings moving_half and growth (runs without them: 0.10-0.16 moving, "
                "0.07-0.10 to 0.22-0.27 growing). "
                f"{len(shapes.HELD_OUT_VIDEOS)} (colour, shape, motion) combinations are never shown in "
                "training; the held-out scores below prompt for exactly those.")
        method = ("AutoencoderKLWan fitted first on "
                  f"{settings['vae_frames']}-frame {settings['vae_size']}x{settings['vae_size']} crops around the "
                  f"object of {settings['size']}x{settings['size']} clips (L1 + MSE with 4x weight on shape "
                  "pixels, KL 1e-4; runs whose settings say vae_fit 'decoder' fit the decoder alone and keep the "
                  "encoder; runs with a latent_blur setting decode latents blurred by a Gaussian of standard deviation "
                  "drawn from [0, latent_blur] latent pixels), its per-channel latent mean/std written to its "
                  "config; then CosmosTransformer3DModel and the T5 encoder trained "
                  "together on the EDM-preconditioned rectified-flow objective that pipelines/cosmos/pipeline.py "
                  "inverts "
                  "(transformer input (1-t) x0 + t noise, t = sigma/(sigma+1), target noise - x0), sigma half "
                  "log-uniform on [0.002, 80], half log-normal; 0/1/2 clean conditioning latent frames "
                  "(50/35/15%) for video-to-world; 15% of prompts replaced by \"\" or the negative prompt "
                  "for classifier-free guidance (runs with a word_dropout setting also leave out a caption's "
                  "colour, shape or motion, each with that probability). The transformer phase draws clips "
                  "from a pool encoded once by the frozen VAE. EMA 0.999 weights saved.")
    else:
        data = (f"Images of one shape ({', '.join(shapes.SHAPES)}) in one colour ({', '.join(shapes.COLOURS)}), "
                f"small or big, at one of nine positions, on a plain background ({', '.join(shapes.BACKGROUNDS)}, "
                f"never the shape's colour), e.g. \"{example}\"; captions drop size, position or background at "
                f"random. {len(shapes.HELD_OUT_IMAGES)} (colour, shape, background) combinations are never shown "
                "in training; the held-out scores below prompt for exactly those.")
        method = ("AutoencoderKL fitted first (L1 + MSE with 4x weight on shape pixels, KL 1e-4), latent "
                  "shift/scale written to its config; then FluxTransformer2DModel and the T5 encoder trained "
                  "together by rectified flow on packed latents (x_s = (1-s) x0 + s noise, target noise - x0, "
                  "s logit-normal with the pipeline's resolution shift; scenes drawn from a pool encoded once "
                  "per training size by the frozen VAE). CLIP stays at its random "
                  "initialisation (frozen). EMA 0.999 weights saved.")
        if settings.get("distill_share"):
            method += (f" Guidance-distilled as FLUX.1-dev is: {settings['prompt_dropout']:.0%} of captions were "
                       "empty in that phase; then, for the last "
                       f"{settings['distill_share']:.0%} of the transformer's time, a frozen copy was the teacher "
                       "and the transformer learned to output, for a guidance value g in [1, 5] fed to its "
                       "guidance embedding, the teacher's classifier-free guidance v_uncond + g (v_cond - "
                       "v_uncond) (T5 frozen in that phase). One transformer call per step, as in FLUX.1-dev.")
        else:
            method += (" Random guidance input in [1, 5] (guidance-distilled in form only: the value has no "
                       "effect).")
    regenerate = ("this command:" if len(runs) == 1 else
                  "these commands, in order\n(`--init` makes a command start from the weights the command above it "
                  "wrote, wherever its `--out` put them):")
    text = f"""# {name}

Embedded default model of ulysses-studio: the real diffusers classes, shrunk, trained here on procedural
shapes in a few minutes. Regenerate with {regenerate}

{commands}

## Data

Procedural, generated on the fly from the seed by `training/shapes.py` (no downloads). {data}

## Training

{method}

| run | phase | steps | samples | time | loss (first -> last) |
| --- | --- | --- | --- | --- | --- |
{phases}

## Size

{size / 1e6:.2f} MB on disk (float32 safetensors).

{_parameters(parts)}

{LIMITS}{VIDEO_LIMITS if video else ""}"""
    (folder / "README.md").write_text(text)


def append_scores(folder: Path, scores, count: int, strip: str | None = None) -> None:
    """Add the held-out evaluation (training/evaluate.py) to folder/README.md; `strip`, an image in `folder`
    showing the first prompts' frames (training.evaluate.frame_strip), is shown above the table."""
    lines = [f"\n## Held-out scores ({count} prompts, registry defaults, seed = prompt index)\n",
             f"colour {scores.colour:.0%}, shape {scores.shape:.0%}"
             + ("" if scores.motion != scores.motion else f", motion {scores.motion:.0%}") + "\n"]
    if strip is not None:
        from training.evaluate import EXAMPLES

        shown = "; ".join(f'"{prompt}"' for prompt, _ in scores.seen[:EXAMPLES])
        lines += [f"![every second frame of the first {EXAMPLES} held-out videos]({strip})\n",
                  f"Rows, top to bottom: {shown}.\n"]
    lines += ["| prompt | judged |", "| --- | --- |"]
    lines += [f"| {prompt} | {seen} |" for prompt, seen in scores.seen]
    with open(folder / "README.md", "a") as card:
        card.write("\n".join(lines) + "\n")
