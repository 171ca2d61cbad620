"""Training a LoRA for tiny-flux: `python -m training lora` (the base frozen, only the LoRA's A and B learn).

    python -m training lora --init assets/tiny-flux --out assets/tiny-flux-lora-gray --device cpu --minutes 12 \
        --sizes 128,256 --foreground-weight 4

What it teaches (CHANGES): "gray", the background turned plain gray whatever the prompt asks, the shape
keeping its colour, kind, size and place. A trained LoRA does so in most images, not every one: its card says how
often, from its held-out scores (write_lora_card). The targets are training/shapes.py's scenes with the background
replaced, captions unchanged, so the LoRA learns to override the prompt's background word.

Why not an outline or a checkerboard: tiny-flux's VAE (frozen here, as a LoRA leaves it) was fitted on flat
shapes on plain backgrounds only; encoded and decoded, a 5-px black outline at 256x256 comes back as no outline at
all (a faint blur), so no transformer LoRA can make it. A plain background of another colour is in the VAE's range.

The LoRA: rank R (default 4) on the double-stream blocks' image attention (to_q, to_k, to_v, to_out.0), image
feed-forward (ff.net.0.proj, ff.net.2) and modulation (norm1.linear), and the single-stream blocks' proj_out (the
layers engines.weights.lora.export_kohya maps one to one or whole, see tests/test_lora.py). A starts random, B at zero
(the LoRA adds nothing at step 0), alpha = R (scale 1). Loss: tiny-flux's own rectified flow (training/flux.py) on
latents of the changed scenes from the frozen VAE, prompts through the frozen text encoders, each latent token's
squared error weighted by --foreground-weight (default 1: plain mean) where the scene's shape covers any pixel of
the token (training/shapes.py knows every scene's shape mask), 1 elsewhere. The change is the background only;
with equal weights the LoRA, which sees far more background tokens than shape tokens, learnt a gray background at
the cost of fine shape detail (small stars drawn as diamonds, a triangle's tips rounded off into a circle).

Written: pytorch_lora_weights.safetensors (diffusers' FluxPipeline.save_lora_weights: transformer.* keys),
pytorch_lora_weights_kohya.safetensors (engines.weights.lora.export_kohya), training.json and README.md (model card with
the held-out scores of training.evaluate.score_lora).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from training import shapes
from training.lora_folder import DIFFUSERS_FILE, KOHYA_FILE

GRAY = shapes.NEUTRALS["gray"]
CHANGES = {"gray": "the background turned plain gray (128, 128, 128), whatever background the prompt asks for, the "
                   "shape keeping its colour, kind, size and place"}
"""What a change's targets teach (the aim); what a trained LoRA does is its card's held-out scores."""
DOUBLE_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2", "norm1.linear")
SINGLE_TARGETS = ("proj_out",)
TOKEN_PIXELS = 16
"""Pixels across one packed latent token of tiny-flux (its VAE's 8x downsampling, then FLUX's 2x2 packing)."""


@dataclass(kw_only=True, slots=True)
class LoraSettings:
    rank: int = 4
    lr: float = 5e-3
    warmup: int = 5
    batch: int = 16
    sizes: tuple[int, ...] = (128, 128, 256)
    """Square training resolutions, one per step in turn (tiny-flux's default is 256)."""
    pool_batches: int = 24
    """Batches per size encoded once by the frozen VAE (training.loop.LatentPool)."""
    change: str = "gray"
    foreground_weight: float = 1.0
    """Loss weight of the latent tokens the shape covers (any pixel), against 1 for background tokens."""
    max_sequence_length: int = 64
    guidance_range: tuple[float, float] = (1.0, 5.0)
    dit_batch: int = field(default=16, repr=False)
    """= batch (training.flux._noisy_batch reads it)."""


class TrainableLora(nn.Module):
    """A frozen nn.Linear plus B A x (A: rank x in, random; B: out x rank, zeros)."""

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        bound = 1 / math.sqrt(base.in_features)
        self.lora_A = nn.Parameter((torch.rand(rank, base.in_features, generator=generator) * 2 - 1) * bound)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B)


def target_names(transformer: nn.Module) -> list[str]:
    names = [f"transformer_blocks.{i}.{layer}" for i in range(len(transformer.transformer_blocks))
             for layer in DOUBLE_TARGETS]
    names += [f"single_transformer_blocks.{i}.{layer}" for i in range(len(transformer.single_transformer_blocks))
              for layer in SINGLE_TARGETS]
    return names


def add_lora(transformer: nn.Module, rank: int, generator: torch.Generator) -> dict[str, TrainableLora]:
    """Wrap every target linear of the (frozen) transformer with a TrainableLora, in place."""
    transformer.requires_grad_(False)
    layers = {}
    for name in target_names(transformer):
        parent, _, child = name.rpartition(".")
        module = transformer.get_submodule(parent)
        layers[name] = TrainableLora(getattr(module, child), rank, generator)
        setattr(module, child, layers[name])
    return layers


def lora_state(layers: dict[str, TrainableLora]) -> dict[str, torch.Tensor]:
    """diffusers/PEFT module keys (without the `transformer.` prefix save_lora_weights adds)."""
    state = {}
    for name, layer in layers.items():
        state[f"{name}.lora_A.weight"] = layer.lora_A.detach().float().cpu().contiguous()
        state[f"{name}.lora_B.weight"] = layer.lora_B.detach().float().cpu().contiguous()
    return state


def change_scenes(scenes: shapes.Scenes, change: str) -> shapes.Scenes:
    """The scenes as the LoRA should draw them for the same captions."""
    if change != "gray":
        raise ValueError(f"unknown change {change!r} (known: {', '.join(CHANGES)})")
    scenes.background = torch.tensor(GRAY).expand_as(scenes.background).clone()
    return scenes


def shape_tokens(scenes: shapes.Scenes, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Whether each scene's shape covers any pixel of each packed latent token at size x size, [B, L] (bool);
    tokens row by row, as FluxPipeline._pack_latents orders them."""
    return (F.max_pool2d(shapes.coverage(scenes, size, size, device), TOKEN_PIXELS) > 0).flatten(1)


def train_lora(parts: dict, *, device: torch.device, generator: torch.Generator, settings: LoraSettings,
               seconds: float, max_steps: int | None):
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    from training.flux import PromptEncoder, _noised
    from training.loop import LatentPool, frozen, run_phase

    for part in parts.values():
        if isinstance(part, nn.Module):
            frozen(part).to(device)
    vae, transformer = parts["vae"], parts["transformer"]
    layers = add_lora(transformer, settings.rank, generator)
    lora_modules = nn.ModuleList(layers.values()).to(device)
    for layer in layers.values():
        layer.base.requires_grad_(False)

    def encoder(size: int):
        def make():
            scenes = change_scenes(shapes.image_scenes(settings.batch, generator), settings.change)
            latents = vae.encode(shapes.render(scenes, size, size, device)[:, :, 0]).latent_dist.mode()
            x0 = (latents.float() - vae.config.shift_factor) * vae.config.scaling_factor
            b, c, h, w = x0.shape
            # The pool keeps one tensor per scene: the packed latents [L, C] and, as one more channel, whether
            # the shape covers the token.
            return scenes.captions, torch.cat([FluxPipeline._pack_latents(x0, b, c, h, w),
                                               shape_tokens(scenes, size, device).unsqueeze(-1).float()], -1)
        return make

    start = time.perf_counter()
    pool_batches = settings.pool_batches if max_steps is None else min(settings.pool_batches, max_steps)
    pools = {size: LatentPool(encoder(size), pool_batches, seconds * 0.1 / len(set(settings.sizes)))
             for size in dict.fromkeys(settings.sizes)}
    pool_seconds = time.perf_counter() - start
    print(f"[lora] latent pools: {', '.join(f'{len(p)} scenes at {s}px' for s, p in pools.items())} in "
          f"{pool_seconds:.0f}s", flush=True)
    encode_prompts = PromptEncoder(parts, device, settings.max_sequence_length)
    texts: dict[str, torch.Tensor] = {}
    config = parts["scheduler"].config
    counter = iter(range(1 << 62))
    frozen(transformer)  # eval mode, no dropout; the LoRA parameters keep requires_grad
    for layer in layers.values():
        layer.lora_A.requires_grad_(True)
        layer.lora_B.requires_grad_(True)

    def step() -> torch.Tensor:
        size = settings.sizes[next(counter) % len(settings.sizes)]
        captions, pooled_latents = pools[size].sample(settings.batch, generator)
        x0, shape = pooled_latents[..., :-1], pooled_latents[..., -1]
        image_ids, noise, sigma, noisy, guidance = _noised(x0, device, generator, settings, config)
        missing = [c for c in dict.fromkeys(captions) if c not in texts]
        if missing:
            with torch.no_grad():
                text, pooled = encode_prompts(missing)
            texts.update({c: (t, p) for c, t, p in zip(missing, text, pooled)})
        text = torch.stack([texts[c][0] for c in captions])
        pooled = torch.stack([texts[c][1] for c in captions])
        velocity = transformer(hidden_states=noisy, timestep=sigma, guidance=guidance, pooled_projections=pooled,
                               encoder_hidden_states=text, txt_ids=torch.zeros(text.shape[1], 3, device=device),
                               img_ids=image_ids, return_dict=False)[0]
        error = (velocity.float() - (noise - x0)).square().mean(-1)  # [B, L]
        weight = 1 + (settings.foreground_weight - 1) * shape
        return (weight * error).sum() / weight.sum()

    result = run_phase("lora", step, [lora_modules], seconds=max(seconds - pool_seconds, 1.0), max_steps=max_steps,
                       lr=settings.lr, batch=settings.batch, warmup=settings.warmup, log_every=10)
    return layers, result


def save_lora(out: Path, layers: dict[str, TrainableLora], rank: int) -> tuple[Path, Path]:
    """diffusers' own save_lora_weights file, and engines.weights.lora.export_kohya's copy of it."""
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    from engines.weights.lora import export_kohya

    out.mkdir(parents=True, exist_ok=True)
    FluxPipeline.save_lora_weights(out, transformer_lora_layers=lora_state(layers), weight_name=DIFFUSERS_FILE,
                                   safe_serialization=True)
    diffusers_file = out / DIFFUSERS_FILE
    kohya_file = export_kohya(load_file(str(diffusers_file)), out / KOHYA_FILE)
    return diffusers_file, kohya_file


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m training lora", description=__doc__.splitlines()[0])
    parser.add_argument("--init", type=Path, default=Path("assets/tiny-flux"), help="the base tiny-flux folder")
    parser.add_argument("--out", type=Path, required=True, help="folder that receives the LoRA files and card")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--minutes", type=float, default=8.0, help="wall-clock training budget (pool included)")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--warmup", type=int, default=5, help="warm-up steps")
    parser.add_argument("--sizes", default="128,128,256",
                        help="square training resolutions, one per step in turn (128 costs a quarter of 256)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--change", choices=tuple(CHANGES), default="gray")
    parser.add_argument("--foreground-weight", type=float, default=1.0,
                        help="loss weight of the latent tokens (16x16 px) the scene's shape covers, against 1 for "
                             "background tokens: the change is the background only, and a weight > 1 keeps the "
                             "shape's fine detail (star and triangle tips)")
    parser.add_argument("--eval-prompts", type=int, default=24, help="held-out prompts scored at the end (0: none)")
    args = parser.parse_args(argv)

    from pipelines.loading import load_parts

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    device = torch.device(args.device)
    settings = LoraSettings(rank=args.rank, lr=args.lr, batch=args.batch, dit_batch=args.batch, change=args.change,
                            warmup=args.warmup, sizes=tuple(int(s) for s in args.sizes.split(",")),
                            foreground_weight=args.foreground_weight)
    names = ["tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "vae", "transformer", "scheduler"]
    parts = load_parts(args.init, names, dtype=torch.float32, device="cpu")
    start = time.perf_counter()
    layers, result = train_lora(parts, device=device, generator=generator, settings=settings,
                                seconds=args.minutes * 60, max_steps=args.max_steps)
    seconds = time.perf_counter() - start
    diffusers_file, kohya_file = save_lora(args.out, layers, args.rank)
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    run = {"command": "python -m training lora " + " ".join(argv), "seed": args.seed, "torch": torch.__version__,
           "device": device_name, "seconds": round(seconds, 1), "settings": asdict(settings),
           "phase": asdict(result), "targets": list(DOUBLE_TARGETS) + [f"single: {t}" for t in SINGLE_TARGETS]}
    (args.out / "training.json").write_text(json.dumps(run, indent=1) + "\n")
    print(f"[lora] {diffusers_file} ({diffusers_file.stat().st_size / 1e3:.0f} kB), {kohya_file} "
          f"({kohya_file.stat().st_size / 1e3:.0f} kB); training {seconds:.0f}s", flush=True)
    scores = None
    if args.eval_prompts:
        from training.evaluate import score_lora

        scores = score_lora(args.init, args.out, count=args.eval_prompts, device=str(device))
        print(f"[lora] held-out: {scores.summary()}", flush=True)
    write_lora_card(args.out, run, scores)


def foreground_note(weight: float) -> str:
    """The card's words for a run's --foreground-weight (none for equal weights)."""
    if weight == 1:
        return ""
    return (f", each latent token's squared error weighted {weight:g} where the scene's shape covers any of its "
            "16x16 pixels and 1 elsewhere (`--foreground-weight`): the change is the background only, and with equal "
            "weights the many background tokens cost the shapes their fine tips")


def what_it_does(scores) -> str:
    """The card's sentence on what the LoRA does at scale 1, from its held-out scores (training.evaluate.LoraScores):
    how often, not the aim; "" without scores."""
    if scores is None:
        return ""
    one, none = scores.rows["scale 1"], scores.rows["no LoRA"]
    rest = "" if one["change"] >= 1 else ", not in every one: the others keep a coloured background"
    return (f" At scale 1 it does so in {one['change']:.0%} of the held-out images below{rest}; the shape keeps its "
            f"colour in {one['colour']:.0%} of them and its kind in {one['shape']:.0%} ({none['shape']:.0%} "
            "without the LoRA).")


def write_lora_card(out: Path, run: dict, scores) -> None:
    phase = run["phase"]
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    lines = [
        f"# {out.name}", "",
        f"A LoRA for the embedded tiny-flux (assets/tiny-flux) trained for one visible change: "
        f"{CHANGES[run['settings']['change']]}.{what_it_does(scores)}", "",
        "Use: `ulysses-studio generate --model tiny-flux --lora gray=assets/" + out.name + "/" + DIFFUSERS_FILE
        + ":1.0 --prompt \"a big red star in the center on a blue background\"` (the kohya copy "
        f"`{KOHYA_FILE}` draws the same).", "",
        "## Training", "",
        f"`{run['command']}` ({run['device']}, torch {run['torch']}, seed {run['seed']}): "
        f"{phase['steps']} steps of {run['settings']['batch']} scenes, {phase['seconds']:.0f} s of steps, "
        f"{run['seconds']:.0f} s with the latent pool; loss {phase['first_loss']:.4f} -> {phase['last_loss']:.4f}.", "",
        "Only the LoRA trains (the base tiny-flux stays frozen): rank "
        f"{run['settings']['rank']}, alpha = rank, on every double-stream block's "
        + ", ".join(DOUBLE_TARGETS) + " and every single-stream block's " + ", ".join(SINGLE_TARGETS)
        + ". Targets: training/shapes.py's scenes with the background replaced by gray, captions unchanged "
        "(they still name the prompt's background), tiny-flux's rectified-flow loss (training/flux.py) at "
        + ", ".join(f"{s}x{s}" for s in run["settings"]["sizes"]) + " in turn"
        + foreground_note(run["settings"].get("foreground_weight", 1.0)) + ". See training/lora.py.", "",
        "An outline or a checkerboard would be a more striking change, but tiny-flux's frozen VAE cannot draw "
        "either: it was fitted on flat shapes on plain backgrounds only, and a 5-px black outline encoded and "
        "decoded at 256x256 comes back as a faint blur (checked before training this one).", "",
        f"## Files ({size / 1e3:.0f} kB)", "",
        f"- `{DIFFUSERS_FILE}`: diffusers/PEFT format, written by `FluxPipeline.save_lora_weights` "
        "(`transformer.<module>.lora_A/B.weight`)",
        f"- `{KOHYA_FILE}`: the same LoRA in kohya's format (`lora_unet_...lora_down/up.weight` + `.alpha`), "
        "written by engines.weights.lora.export_kohya",
        "- `training.json`: the run's settings and numbers", "",
    ]
    if scores is not None:
        lines += ["## Held-out scores", "",
                  "tests/test_tiny_quality.py's 24 held-out prompts (registry defaults: 256x256, 8 steps, guidance "
                  "3.5, seed = prompt index), judged by pixels (training/judge.py: judge_gray_background for the "
                  "change, judge_image for colour and shape); measured by training.evaluate.score_lora, checked by "
                  "tests/test_tiny_lora_quality.py.", "",
                  "| run | change seen | colour | shape |", "| --- | --- | --- | --- |"]
        for label, row in scores.rows.items():
            lines.append(f"| {label} | {row['change']:.0%} | {row['colour']:.0%} | {row['shape']:.0%} |")
        lines += ["", f"Scale 0 against no LoRA: largest pixel difference {scores.zero_vs_none} levels; kohya copy "
                  f"against the diffusers file at scale 1: {scores.kohya_vs_diffusers} levels.", ""]
    (out / "README.md").write_text("\n".join(lines))
