"""The shapes data set, the pixel judges on its ground truth, and a tiny CPU training run end to end."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pipelines.factory import load_pipeline
from pipelines.registry import default_folder, get_spec
from pipelines.requests import make_request, read_limits
from tests.helpers import REPO
from training import judge, shapes
from training.tiny_models import CAPTION_WORDS, t5_tokenizer


def _truth_colour(scenes: shapes.Scenes, i: int) -> str:
    return list(shapes.COLOURS)[list(shapes.COLOURS.values()).index(tuple(scenes.colour[i].tolist()))]


@pytest.mark.parametrize("size", [64, 256])
def test_judges_read_colour_and_shape_of_ground_truth_images(size):
    scenes = shapes.image_scenes(60, torch.Generator().manual_seed(size))
    images = shapes.to_uint8(shapes.render(scenes, size, size))[:, 0]
    verdicts = [judge.judge_image(image) for image in images]
    colours = [v.colour == _truth_colour(scenes, i) for i, v in enumerate(verdicts)]
    kinds = [v.shape == shapes.SHAPES[scenes.shape[i]] for i, v in enumerate(verdicts)]
    assert np.mean(colours) == 1.0
    assert np.mean(kinds) >= 0.98


def test_judges_read_motion_of_ground_truth_videos():
    scenes = shapes.video_scenes(36, 17, torch.Generator().manual_seed(1))
    videos = shapes.to_uint8(shapes.render(scenes, 64, 64))
    truth = [next(m for m in shapes.MOTIONS if shapes.MOTION_PHRASES[m] in c) for c in scenes.captions]
    assert [judge.judge_motion(v) for v in videos] == truth


def test_judges_see_no_object_on_a_plain_image():
    plain = np.full((64, 64, 3), 128, dtype=np.uint8)
    assert judge.judge_image(plain).shape is None
    assert judge.judge_motion(np.stack([plain] * 5)) == "still"


def test_data_is_seeded_and_never_shows_held_out_combinations():
    first = shapes.image_scenes(500, torch.Generator().manual_seed(3))
    again = shapes.image_scenes(500, torch.Generator().manual_seed(3))
    assert first.captions == again.captions and torch.equal(first.cx, again.cx)
    backgrounds = list(shapes.BACKGROUNDS.values())
    seen = {(_truth_colour(first, i), shapes.SHAPES[first.shape[i]],
             list(shapes.BACKGROUNDS)[backgrounds.index(tuple(first.background[i].tolist()))]) for i in range(500)}
    assert not seen & set(shapes.HELD_OUT_IMAGES)
    assert all(c != b for c, _, b in seen)
    videos = shapes.video_scenes(500, 5, torch.Generator().manual_seed(3))
    seen = {(_truth_colour(videos, i), shapes.SHAPES[videos.shape[i]],
             next(m for m in shapes.MOTIONS if shapes.MOTION_PHRASES[m] in videos.captions[i])) for i in range(500)}
    assert not seen & set(shapes.HELD_OUT_VIDEOS)


def test_captions_are_whole_t5_pieces():
    tokenizer = t5_tokenizer(max_length=64)
    captions = shapes.image_scenes(200, torch.Generator().manual_seed(0)).captions
    captions += shapes.video_scenes(200, 5, torch.Generator().manual_seed(0)).captions
    captions += shapes.video_scenes(200, 5, torch.Generator().manual_seed(0), word_dropout=0.3).captions
    captions += [p[0] for p in shapes.held_out_image_prompts() + shapes.held_out_video_prompts()]
    words = set(CAPTION_WORDS)
    for caption in captions:
        pieces = tokenizer.tokenize(caption)
        assert [p.lstrip("\u2581") for p in pieces] == caption.split(), caption
        assert set(caption.split()) <= words


def test_word_dropout_leaves_words_out_of_captions_only():
    whole = shapes.video_scenes(600, 5, torch.Generator().manual_seed(4))
    dropped = shapes.video_scenes(600, 5, torch.Generator().manual_seed(4), word_dropout=0.3)
    assert torch.equal(whole.cx, dropped.cx) and torch.equal(whole.shape, dropped.shape)
    assert torch.equal(whole.colour, dropped.colour) and torch.equal(whole.background, dropped.background)
    rates = {}
    for kind, words in (("colour", shapes.COLOURS), ("shape", shapes.SHAPES),
                        ("motion", shapes.MOTION_PHRASES.values())):
        # a caption's colour, shape or motion is the first such phrase (the background comes after it)
        left_out = [not any(w in c.split(" on ")[0] for w in words) for c in dropped.captions]
        rates[kind] = float(np.mean(left_out))
    assert all(0.24 <= rate <= 0.36 for rate in rates.values()), rates
    for caption in dropped.captions:  # a left-out shape is said as "shape"
        assert any(name in caption.split() for name in (*shapes.SHAPES, "shape")), caption


def test_vae_crops_keep_the_object_in_view():
    from training.cosmos import object_crops

    scenes = shapes.video_scenes(32, 17, torch.Generator().manual_seed(5))
    clips = shapes.render(scenes, 128, 128)
    crops = object_crops(clips, scenes, 64, torch.Generator().manual_seed(6))
    assert crops.shape == (32, 3, 17, 64, 64)
    middle = crops[:, :, 8]
    colour = scenes.colour.float().view(32, 3, 1, 1) / 127.5 - 1
    on_object = ((middle - colour).abs().amax(1) < 0.02).flatten(1).sum(1)
    assert (on_object >= 100).all(), on_object  # a moving shape's half-size is at least MOVING_HALF[0] x 128 px
    assert object_crops(clips, scenes, 128, torch.Generator()) is clips


def test_video_model_card_shows_a_strip_of_held_out_frames(tmp_path):
    from PIL import Image

    from training.card import append_scores
    from training.evaluate import Scores, frame_strip

    videos = [np.full((17, 8, 6, 3), 60 * i, dtype=np.uint8) for i in range(3)]
    frame_strip(videos, tmp_path / "examples.png")
    strip = np.asarray(Image.open(tmp_path / "examples.png"))
    assert strip.shape == (3 * 8, 9 * 6, 3)  # a row per video, frames 0, 2, ..., 16
    assert [int(strip[8 * i, 0, 0]) for i in range(3)] == [0, 60, 120]
    (tmp_path / "README.md").write_text("# card\n")
    prompts = [p[0] for p in shapes.held_out_video_prompts()[:4]]
    scores = Scores(colour=1.0, shape=0.5, motion=0.25, seen=[(p, "red circle right") for p in prompts])
    append_scores(tmp_path, scores, 4, strip="examples.png")
    card = (tmp_path / "README.md").read_text()
    assert "](examples.png)" in card and "colour 100%, shape 50%, motion 25%" in card
    assert all(f'"{p}"' in card for p in prompts[:3]) and f'"{prompts[3]}"' not in card


def test_tiny_training_run_lowers_the_loss_and_saves_loadable_folders(tmp_path):
    from training.__main__ import main

    results = main(["--device", "cpu", "--minutes", "0", "--max-steps", "8", "--small", "--batch-scale", "0.0625",
                    "--out", str(tmp_path), "--eval-prompts", "0"])
    for phases in results.values():
        for phase in phases:
            assert phase.steps == 8
        dit = phases[-1]
        assert dit.last_loss < dit.first_loss, dit
    for name, extra in (("tiny-flux", {}), ("tiny-cosmos", {"frames": 5})):
        spec, folder = get_spec(name), tmp_path / name
        assert "## Training" in (folder / "README.md").read_text()
        pipe = load_pipeline(spec, folder)
        request = make_request(spec, read_limits(spec, folder), prompt="a red circle", seed=0, steps=2,
                               height=64, width=64, **extra)
        out = np.asarray(pipe.generate(request))
        assert out.shape[-3:] == (64, 64, 3)

    # A continuation that fits the video VAE's decoder alone (in bfloat16 autocast) keeps its encoder and latent
    # statistics, so the latents its transformer learnt stay as they were; its transformer grows a block and wider
    # feed-forwards.
    from pipelines.loading import load_parts

    main(["--device", "cpu", "--minutes", "0.001", "--max-steps", "2", "--small", "--batch-scale", "0.0625", "--only",
          "cosmos", "--init", str(tmp_path), "--out", str(tmp_path / "next"), "--eval-prompts", "0",
          "--vae-share", "0.5", "--cosmos-vae-fit", "decoder", "--cosmos-bf16", "--cosmos-word-dropout", "0.2",
          "--cosmos-layers", "5", "--cosmos-mlp-ratio", "3"])
    before, after = (load_parts(folder / "tiny-cosmos", ["vae", "transformer"], dtype=torch.float32, device="cpu")
                     for folder in (tmp_path, tmp_path / "next"))
    assert (before["transformer"].config.num_layers, after["transformer"].config.num_layers) == (4, 5)
    assert after["transformer"].config.mlp_ratio == 3
    assert "--cosmos-layers 5" in (tmp_path / "next" / "tiny-cosmos" / "README.md").read_text()
    before, after = before["vae"], after["vae"]
    assert all(torch.equal(a, b) for a, b in zip(before.encoder.parameters(), after.encoder.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(before.decoder.parameters(), after.decoder.parameters()))
    assert before.config.latents_mean == after.config.latents_mean
    assert before.config.latents_std == after.config.latents_std


def test_a_grown_transformer_computes_the_same_function_and_trains_its_new_blocks():
    from pipelines.cosmos import torchvision_shim
    from training.cosmos import grow_transformer
    from training.tiny_models import cosmos_components

    torchvision_shim.install()
    transformer = cosmos_components(0)["transformer"]
    for param in transformer.parameters():  # trained-like weights: nothing left at its zero initialisation
        param.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(param.numel()))
    grown = grow_transformer(transformer, 6, mlp_ratio=3.0)
    assert grown.config.num_layers == 6 and len(grown.transformer_blocks) == 6
    assert grown.transformer_blocks[0].ff.net[2].weight.shape == (128, 384)
    generator = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(2, 16, 3, 8, 8, generator=generator),
                  timestep=torch.rand(2, 1, 3, 1, 1, generator=generator),
                  encoder_hidden_states=torch.randn(2, 7, 64, generator=generator), fps=8,
                  condition_mask=torch.zeros(2, 1, 3, 8, 8), padding_mask=torch.zeros(1, 1, 64, 64), return_dict=False)
    with torch.no_grad():
        before = transformer(**inputs)[0]
        torch.testing.assert_close(grow_transformer(transformer, 6)(**inputs)[0], before, rtol=0, atol=0)
        # Wider feed-forwards sum over more (zero) terms: the same up to float32 rounding.
        torch.testing.assert_close(grown(**inputs)[0], before, rtol=0, atol=1e-6)
    grown.requires_grad_(True)
    grown(**inputs)[0].square().mean().backward()
    for block in grown.transformer_blocks[4:]:
        for projection in (block.attn1.to_out[0], block.attn2.to_out[0], block.ff.net[2]):
            assert projection.weight.grad.abs().sum() > 0
    for block in grown.transformer_blocks[:4]:  # the widened feed-forwards' new units
        assert block.ff.net[2].weight.grad[:, 256:].abs().sum() > 0
    with pytest.raises(ValueError, match="grow, not shrink"):
        grow_transformer(grown, 4)
    with pytest.raises(ValueError, match="grow, not shrink"):
        grow_transformer(grown, 6, mlp_ratio=2.0)


def test_flux_training_target_is_what_the_pipeline_integrates():
    """A transformer that answers with training's target (noise - x0) for a fixed x0 makes the loop land on x0."""
    spec, folder = get_spec("tiny-flux"), default_folder(get_spec("tiny-flux"))
    pipe = load_pipeline(spec, folder)
    request = make_request(spec, read_limits(spec, folder), prompt="a red circle", seed=0, steps=8, height=64, width=64)
    x0 = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(1))

    def oracle(*, hidden_states, timestep, **_):
        # training: hidden_states = (1 - s) x0 + s noise at timestep s, target noise - x0
        s = timestep.view(-1, 1, 1)
        return ((hidden_states - x0) / s,)

    pipe.use_transformer(oracle)
    latents = pipe.denoise(request, pipe.encode(request))
    torch.testing.assert_close(latents, x0, atol=1e-4, rtol=1e-4)


def test_cosmos_training_target_is_what_the_pipeline_inverts():
    """Same for Cosmos' EDM-preconditioned loop: input (1-t) x0 + t noise at timestep t, target noise - x0."""
    from pipelines.cosmos import torchvision_shim

    torchvision_shim.install()
    spec, folder = get_spec("tiny-cosmos"), default_folder(get_spec("tiny-cosmos"))
    pipe = load_pipeline(spec, folder)
    request = make_request(spec, read_limits(spec, folder), prompt="a red circle moving left", seed=0, steps=8,
                           frames=9, height=64, width=64)
    latent_frames = (request.frames - 1) // pipe.temporal_factor + 1
    x0 = torch.randn(1, pipe.vae_config["z_dim"], latent_frames, 8, 8, generator=torch.Generator().manual_seed(1))

    def oracle(*, hidden_states, timestep, **_):
        t = timestep.float()
        return ((hidden_states.float() - x0) / t,)

    pipe.use_transformer(oracle)
    latents = pipe.denoise(request, pipe.encode(request))
    # The loop stops at sigma_min = 0.002, so 0.002 x noise (noise ~ N(0, 1)) is left.
    assert (latents - x0).abs().max() < 0.02


def test_training_encodes_prompts_as_the_pipelines_do():
    from training import cosmos as cosmos_training
    from training import flux as flux_training
    from training.loop import TokenCache

    spec = get_spec("tiny-flux")
    pipe = load_pipeline(spec, default_folder(spec))
    request = make_request(spec, read_limits(spec, default_folder(spec)), prompt="a big red circle", seed=0)
    ours = flux_training.PromptEncoder(vars(pipe), torch.device("cpu"), spec.max_sequence_length)
    text, pooled = ours([request.prompt])
    theirs = pipe.encode(request)
    torch.testing.assert_close(text, theirs.prompt_embeds)
    torch.testing.assert_close(pooled, theirs.pooled_prompt_embeds)

    spec = get_spec("tiny-cosmos")
    pipe = load_pipeline(spec, default_folder(spec))
    tokens = TokenCache(pipe.tokenizer, spec.max_sequence_length)
    text = cosmos_training.encode_prompts(pipe.text_encoder, tokens, ["a red circle moving left"], torch.device("cpu"))
    torch.testing.assert_close(text, pipe._t5("a red circle moving left"))


def test_reconstruction_judge_compares_with_the_originals():
    from training.evaluate import judge_reconstructions

    scenes = shapes.video_scenes(6, 9, torch.Generator().manual_seed(3), held_out=True)
    clips = shapes.to_uint8(shapes.render(scenes, 64, 64))
    same = judge_reconstructions(clips, clips, scenes.captions)
    assert (same.colour, same.shape, same.motion) == (1.0, 1.0, 1.0)
    blank = judge_reconstructions(clips, np.zeros_like(clips), scenes.captions)
    assert (blank.colour, blank.shape) == (0.0, 0.0)
    assert blank.seen[0] == (scenes.captions[0], "None None still")


def test_latent_blur_is_a_per_sample_gaussian_with_replicated_edges():
    from training.autoencoder import BLUR_RADIUS, blur_latents

    def reference(x: torch.Tensor, sigma: float) -> torch.Tensor:  # separable conv2d over padded frames
        distance = torch.arange(-BLUR_RADIUS, BLUR_RADIUS + 1, dtype=torch.float32)
        kernel = torch.exp(-0.5 * (distance / sigma).square())
        kernel = kernel / kernel.sum()
        frames = torch.nn.functional.pad(x.reshape(-1, 1, *x.shape[-2:]), (BLUR_RADIUS,) * 4, mode="replicate")
        frames = torch.nn.functional.conv2d(frames, kernel.view(1, 1, -1, 1))
        return torch.nn.functional.conv2d(frames, kernel.view(1, 1, 1, -1)).reshape(x.shape)

    latents = torch.randn(3, 4, 5, 8, 8, generator=torch.Generator().manual_seed(0))
    blurred = blur_latents(latents, torch.tensor([0.0, 0.7, 1.2]))
    torch.testing.assert_close(blurred[0], latents[0])
    torch.testing.assert_close(blurred[1], reference(latents[1], 0.7))
    torch.testing.assert_close(blurred[2], reference(latents[2], 1.2))
    images = latents[:, :, 0]  # image latents [B, C, H, W] too
    torch.testing.assert_close(blur_latents(images, 0.9), reference(images, 0.9))


def test_vae_fitted_on_blurred_latents_gets_gradients_through_its_encoder():
    from training.autoencoder import reconstruction_loss
    from training.tiny_models import cosmos_components

    vae = cosmos_components(0, 32, 1, 2.0)["vae"]
    clips = shapes.render(shapes.video_scenes(2, 5, torch.Generator().manual_seed(0)), 32, 32)
    torch.manual_seed(0)
    loss = reconstruction_loss(vae, clips, latent_blur=1.0)
    loss.backward()
    assert torch.isfinite(loss)
    assert vae.encoder.conv_in.weight.grad.abs().sum() > 0


def _data_parallel_worker(rank: int, world_size: int, port: int, out: str) -> None:
    """Two ranks, each half of a fixed batch; saves rank `rank`'s trained weights to `out`."""
    import torch.distributed as dist

    from tests.helpers import join_ranks
    from training.loop import run_phase

    join_ranks(rank, world_size, port)
    dist.init_process_group("gloo")
    model, inputs, targets = _regression_problem()
    half = len(inputs) // world_size
    mine = slice(rank * half, (rank + 1) * half)
    run_phase("dp", lambda: (model(inputs[mine]) - targets[mine]).square().mean(), [model], seconds=3600.0,
              max_steps=12, lr=1e-2, batch=half, warmup=1)
    torch.save(model.state_dict(), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def _regression_problem() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    generator = torch.Generator().manual_seed(1)
    return model, torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)


def test_data_parallel_training_equals_one_process_on_the_whole_batch(tmp_path):
    """Ranks that average their gradients end with the same weights, those of one process on both halves."""
    from tests.helpers import spawn_ranks
    from training.loop import run_phase

    spawn_ranks(_data_parallel_worker, 2, str(tmp_path))
    first, second = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    model, inputs, targets = _regression_problem()
    run_phase("one", lambda: (model(inputs) - targets).square().mean(), [model], seconds=3600.0, max_steps=12,
              lr=1e-2, batch=len(inputs), warmup=1)
    for name, value in model.state_dict().items():
        assert torch.equal(first[name], second[name]), name
        torch.testing.assert_close(first[name], value, rtol=1e-5, atol=1e-6)
    assert not torch.equal(first["0.weight"], _regression_problem()[0].state_dict()["0.weight"])  # it trained


def test_training_under_torchrun_saves_one_model_from_all_ranks(tmp_path):
    """Two gloo ranks on a wall-clock budget (so each rank's clock could stop it at another step) fit the VAE,
    pool latent statistics over both ranks, train the transformer and save once, with the torchrun command."""
    import subprocess

    from tests.helpers import torchrun

    out = tmp_path / "out"
    result = subprocess.run(
        torchrun(2, "-m", "training", "--device", "cpu", "--minutes", "0.15", "--small", "--batch-scale", "0.0625",
                 "--only", "cosmos", "--vae-share", "0.5", "--out", str(out), "--eval-prompts", "0"),
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    history = json.loads((out / "tiny-cosmos" / "training.json").read_text())
    run = history[-1]
    assert run["command"].startswith("python -m torch.distributed.run --nproc-per-node 2 -m training ")
    assert run["device"].startswith("2x ")
    batches = {"cosmos-vae": run["settings"]["vae_batch"], "cosmos-dit": run["settings"]["dit_batch"]}
    assert [phase["name"] for phase in run["phases"]] == list(batches)
    for phase in run["phases"]:
        assert phase["steps"] >= 1 and phase["samples"] == phase["steps"] * 2 * batches[phase["name"]]
    assert result.stdout.count("all done in") == 1  # rank 0 alone reports and saves
    spec, folder = get_spec("tiny-cosmos"), out / "tiny-cosmos"
    pipe = load_pipeline(spec, folder)
    request = make_request(spec, read_limits(spec, folder), prompt="a red circle", seed=0, steps=2, height=64,
                           width=64, frames=5)
    assert np.asarray(pipe.generate(request)).shape == (5, 64, 64, 3)


def test_lora_shape_tokens_are_the_packed_tokens_the_shape_covers():
    """training.lora's foreground loss weight reads shape_tokens: in FluxPipeline._pack_latents' token order, a
    token is the shape's when its 16x16 pixels hold any of it."""
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    from training.lora import TOKEN_PIXELS, shape_tokens

    scenes = shapes.image_scenes(6, torch.Generator().manual_seed(0))
    size = 128
    tokens = shape_tokens(scenes, size)
    assert tokens.shape == (6, (size // TOKEN_PIXELS) ** 2) and tokens.any(1).all() and not tokens.all(1).any()
    # A 4-channel "latent" at the VAE's 8x downsampling that holds the shape's coverage, packed as training packs.
    latent = torch.nn.functional.max_pool2d(shapes.coverage(scenes, size, size), TOKEN_PIXELS // 2)
    latent = latent.expand(-1, 4, -1, -1)
    packed = FluxPipeline._pack_latents(latent, 6, 4, size // 8, size // 8)
    assert torch.equal(packed.amax(-1) > 0, tokens)


def test_the_lora_card_says_how_often_the_change_is_seen(tmp_path):
    """assets/tiny-flux-lora-gray's card opens with what write_lora_card writes for its own table's numbers: the
    change as the aim, then how often it is seen (not every image), never that every background becomes gray."""
    from training.evaluate import LoraScores
    from training.lora import write_lora_card

    asset = REPO / "assets" / "tiny-flux-lora-gray"
    table = [line.strip("|").split("|") for line in (asset / "README.md").read_text().splitlines()
             if line.startswith("| ") and "%" in line]
    rows = {label.strip(): dict(zip(("change", "colour", "shape"), (float(cell.strip(" %")) / 100 for cell in cells)))
            for label, *cells in table}
    out = tmp_path / asset.name
    out.mkdir()
    write_lora_card(out, json.loads((asset / "training.json").read_text()),
                    LoraScores(rows=rows, zero_vs_none=0, kohya_vs_diffusers=1))
    written = (out / "README.md").read_text().splitlines()[2]
    assert written == (asset / "README.md").read_text().splitlines()[2]
    assert f"does so in {rows['scale 1']['change']:.0%} of the held-out images below, not in every one" in written
    assert "every background" not in written
