"""Train the embedded tiny models on procedural shapes and write them as diffusers folders with model cards.

    python -m training --device cuda --minutes 7 --out assets        # both models, ~7 minutes of training
    python -m training --device cpu --minutes 1 --out /tmp/tiny --small --eval-prompts 0   # CPU smoke run

    python -m torch.distributed.run --nproc-per-node 4 -m training --device cuda --minutes 8 ...   # 4 GPUs

The budget is wall-clock training time, split over the four phases (each VAE, then each transformer);
loading, saving and the final held-out evaluation come on top. Same seed and same --max-steps give the
same weights; with a time budget the step count depends on the machine and is written in the model card.
Under torchrun the ranks train one model on data-parallel batches (each rank its own, drawn from the seed
and its rank; batch sizes are per rank), averaging gradients every step (training/loop.py); rank 0 saves it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from pipelines.loading import load_parts
from training.card import write_card
from training.cosmos import CosmosSettings, grow_transformer, train_cosmos
from training.flux import FluxSettings, train_flux
from training.loop import PhaseResult
from training.tiny_models import TEXT_WIDTH, cosmos_components, flux_components, save_cosmos, save_flux


def main(argv: list[str] | None = None) -> dict[str, list[PhaseResult]]:
    """Run the command; returns each trained model's phase results. `python -m training lora ...` trains a LoRA
    for tiny-flux instead (training/lora.py)."""
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["lora"]:
        from training.lora import main as lora_main

        lora_main(arguments[1:])
        return {}
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder that receives tiny-flux/ and tiny-cosmos/")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--minutes", type=float, default=7.0, help="wall-clock training budget for all phases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("flux", "cosmos"), help="train one model only")
    parser.add_argument("--max-steps", type=int, help="stop every phase after this many steps (tests, replays)")
    parser.add_argument("--batch-scale", type=float, default=1.0, help="multiply every batch size")
    parser.add_argument("--init", type=Path, metavar="FOLDER",
                        help="start from the models in FOLDER/tiny-flux, FOLDER/tiny-cosmos (e.g. assets) instead of "
                             "random weights; their training history is carried into the new model cards")
    parser.add_argument("--vae-share", type=float, default=0.3,
                        help="share of each model's budget that fits its VAE (the rest trains its transformer); "
                             "0 keeps the VAE as it is, for runs that continue trained weights (--init)")
    parser.add_argument("--text-width", type=int, default=TEXT_WIDTH,
                        help=f"width of the T5 encoders and the transformers' text input (default {TEXT_WIDTH}; "
                             "with --init the loaded models keep theirs)")
    parser.add_argument("--guidance-distill", type=float, default=0.0, metavar="SHARE",
                        help="tiny-flux: spend this share of its transformer budget on guidance distillation "
                             "(captions are then dropped 10%% of the time in the first phase)")
    parser.add_argument("--cosmos-vae-size", type=int, metavar="PX",
                        help="tiny-cosmos: its VAE is fitted on PX x PX crops around the object of 128x128 clips "
                             "(default 64; 128: whole frames, four times the cost per clip)")
    parser.add_argument("--cosmos-vae-fit", choices=("all", "decoder"), default="all",
                        help="tiny-cosmos: fit the whole VAE, or its decoder alone (the encoder, hence the latents "
                             "its transformer learnt, stay as they are; for runs that continue trained weights)")
    parser.add_argument("--cosmos-latent-blur", type=float, default=0.0, metavar="SIGMA",
                        help="tiny-cosmos: its VAE learns to decode latents blurred by up to SIGMA latent pixels, so "
                             "that the shape is carried by codes over the whole object, not by its edges alone "
                             "(default 0)")
    parser.add_argument("--cosmos-latent-noise", type=float, default=0.0, metavar="SIGMA",
                        help="tiny-cosmos: its VAE learns to decode latents with noise of up to SIGMA times their "
                             "spread, as a transformer's latents have (default 0)")
    parser.add_argument("--cosmos-word-dropout", type=float, default=0.0, metavar="P",
                        help="tiny-cosmos: leave the colour, shape or motion out of a transformer-phase caption, each "
                             "with probability P, so each word carries its meaning alone (default 0)")
    parser.add_argument("--cosmos-bf16", action="store_true",
                        help="tiny-cosmos: bfloat16 autocast in both phases (float32 weights)")
    parser.add_argument("--cosmos-compile", action="store_true",
                        help="tiny-cosmos: torch.compile its transformer for the training steps")
    parser.add_argument("--cosmos-layers", type=int, metavar="N",
                        help="tiny-cosmos: transformer blocks (default 4); with --init, the loaded transformer "
                             "grows to N, its new blocks appended as identities (training.cosmos.grow_transformer)")
    parser.add_argument("--cosmos-mlp-ratio", type=float, metavar="R",
                        help="tiny-cosmos: feed-forward width as a multiple of the transformer's (default 2); with "
                             "--init, each loaded feed-forward widens to R, its new units adding nothing at first")
    parser.add_argument("--cosmos-vae-batch", type=int, metavar="CLIPS",
                        help="tiny-cosmos: clips per VAE step (default 32 x --batch-scale)")
    parser.add_argument("--small", action="store_true",
                        help="64-px images and 64-px 9-frame clips, for CPU smoke runs (the saved model still "
                             "defaults to the registry's sizes)")
    parser.add_argument("--eval-prompts", type=int, default=24, help="held-out prompts to score at the end (0: none)")
    parser.add_argument("--examples", type=Path,
                        help="also write examples-tiny-flux.png / examples-tiny-cosmos.png here")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    device = torch.device(args.device)
    ranks, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if ranks > 1:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        cuda = device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    generator = torch.Generator().manual_seed(args.seed + 1_000_003 * rank)  # each rank's own batches
    flux_settings, cosmos_settings = _settings(args)
    models = [args.only] if args.only else ["flux", "cosmos"]
    per_model = args.minutes * 60 / len(models)
    seconds = {}
    for model in models:
        seconds[f"{model}-vae"] = per_model * args.vae_share
        seconds[f"{model}-dit"] = per_model * (1 - args.vae_share)
    launcher = (f"python -m torch.distributed.run --nproc-per-node {ranks} -m training " if ranks > 1
                else "python -m training ")
    command = launcher + " ".join(argv if argv is not None else sys.argv[1:])
    run = {"command": command, "seed": args.seed, "torch": torch.__version__,
           "device": (f"{ranks}x " if ranks > 1 else "") + _device_name(device)}

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
    trained: dict[str, list[PhaseResult]] = {}
    if "flux" in models:
        parts, history = _start(args, "tiny-flux", lambda: flux_components(args.seed, args.text_width))
        results = train_flux(parts, device=device, generator=generator, settings=flux_settings,
                             vae_seconds=seconds["flux-vae"], dit_seconds=seconds["flux-dit"],
                             vae_steps=args.max_steps, dit_steps=args.max_steps)
        if rank == 0:
            _save(args.out / "tiny-flux", save_flux, parts, results, asdict(flux_settings), run, history)
        trained["tiny-flux"] = results
        del parts
    if "cosmos" in models:
        parts, history = _start(args, "tiny-cosmos",
                                lambda: cosmos_components(args.seed + 100, args.text_width, args.cosmos_layers or 4,
                                                          args.cosmos_mlp_ratio or 2.0))
        if args.cosmos_layers or args.cosmos_mlp_ratio:
            transformer = parts["transformer"]
            parts["transformer"] = grow_transformer(transformer, args.cosmos_layers or transformer.config.num_layers,
                                                    args.cosmos_mlp_ratio)
        results = train_cosmos(parts, device=device, generator=generator, settings=cosmos_settings,
                               vae_seconds=seconds["cosmos-vae"], dit_seconds=seconds["cosmos-dit"],
                               vae_steps=args.max_steps, dit_steps=args.max_steps)
        if rank == 0:
            _save(args.out / "tiny-cosmos", save_cosmos, parts, results, asdict(cosmos_settings), run, history)
        trained["tiny-cosmos"] = results
        del parts
    if ranks > 1:  # the collectives are over; rank 0 alone evaluates
        dist.destroy_process_group()
        if rank > 0:
            return trained
    print(f"training done in {time.perf_counter() - start:.0f}s", flush=True)

    if args.eval_prompts:
        _evaluate(args.out, models, args.eval_prompts, str(device))
    if args.examples and len(models) == 2:
        from training.evaluate import save_examples

        args.examples.mkdir(parents=True, exist_ok=True)
        save_examples(args.out, args.examples, device=str(device))
    for name in ("tiny-flux", "tiny-cosmos"):
        folder = args.out / name
        if folder.is_dir():
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            print(f"{folder}: {size / 1e6:.2f} MB", flush=True)
    print(f"all done in {time.perf_counter() - start:.0f}s", flush=True)
    return trained


def _start(args: argparse.Namespace, name: str, fresh) -> tuple[dict, list[dict]]:
    """The components to train (fresh ones, or --init's) and the training history they carry."""
    if args.init is None:
        return fresh(), []
    folder = args.init / name
    names = ["tokenizer", "text_encoder", "vae", "transformer", "scheduler"]
    if name == "tiny-flux":
        names += ["tokenizer_2", "text_encoder_2"]
    parts = load_parts(folder, names, dtype=torch.float32, device="cpu")
    history_file = folder / "training.json"
    history = json.loads(history_file.read_text()) if history_file.is_file() else [
        {"command": "(unrecorded)", "seed": None, "device": None, "torch": None, "settings": {}, "phases": []}]
    print(f"[{name}] starting from {folder} ({len(history)} run(s) in its training history)", flush=True)
    return parts, history


def _save(folder: Path, save, parts: dict, results: list[PhaseResult], settings: dict, run: dict,
          history: list[dict]) -> None:
    """Write a trained model's folder (its parts moved to the CPU) and its model card."""
    save(folder, {k: v.to("cpu") if isinstance(v, torch.nn.Module) else v for k, v in parts.items()})
    write_card(folder, folder.name, parts, results, settings, run, history)


def _settings(args: argparse.Namespace) -> tuple[FluxSettings, CosmosSettings]:
    flux, cosmos = FluxSettings(), CosmosSettings()
    if args.small:
        flux.sizes = (64,)
        cosmos.size, cosmos.frames = 64, 9
        cosmos.vae_size, cosmos.vae_frames = 32, 9
    if args.guidance_distill > 0:
        flux.distill_share, flux.prompt_dropout = args.guidance_distill, 0.1
    for settings in (flux, cosmos):
        for field in ("vae_batch", "dit_batch"):
            setattr(settings, field, max(1, round(getattr(settings, field) * args.batch_scale)))
    if args.cosmos_vae_size:
        cosmos.vae_size = args.cosmos_vae_size
    if args.cosmos_vae_batch:
        cosmos.vae_batch = args.cosmos_vae_batch
    cosmos.vae_fit, cosmos.bf16, cosmos.compile = args.cosmos_vae_fit, args.cosmos_bf16, args.cosmos_compile
    cosmos.word_dropout, cosmos.latent_blur = args.cosmos_word_dropout, args.cosmos_latent_blur
    cosmos.latent_noise = args.cosmos_latent_noise
    return flux, cosmos


BLUR_CHECK = 0.7
"""Blur (latent pixels) of the latents whose decoding the final report scores beside the clean latents' (about a
1-2-1 kernel): how much of the shape is carried by more than the sharpness of the object's edges."""
STRIP = "examples.png"
"""The video model card's strip of held-out frames, in the model folder."""


def _evaluate(out: Path, models: list[str], count: int, device: str) -> None:
    """Score the saved folders on held-out prompts and add the scores to their model cards."""
    from training.card import append_scores
    from training.evaluate import score_images, score_reconstructions, score_videos

    if "flux" in models:
        scores = score_images(out / "tiny-flux", count=count, device=device)
        print(f"tiny-flux held-out: colour {scores.colour:.0%} shape {scores.shape:.0%}", flush=True)
        append_scores(out / "tiny-flux", scores, count)
    if "cosmos" in models:
        for blur in (0.0, BLUR_CHECK):
            vae = score_reconstructions(out / "tiny-cosmos", device=device, blur=blur)
            print(f"tiny-cosmos VAE alone, held-out clips, latents blurred by {blur}: colour {vae.colour:.0%} "
                  f"shape {vae.shape:.0%} motion {vae.motion:.0%} as in the originals", flush=True)
        scores = score_videos(out / "tiny-cosmos", count=count, device=device, strip=out / "tiny-cosmos" / STRIP)
        print(f"tiny-cosmos held-out: colour {scores.colour:.0%} shape {scores.shape:.0%} "
              f"motion {scores.motion:.0%}", flush=True)
        append_scores(out / "tiny-cosmos", scores, count, strip=STRIP)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


if __name__ == "__main__":
    main()
