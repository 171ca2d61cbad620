"""The generic context-parallel path (engines/parallel/generic.py) on spawned gloo ranks (CPU, float32) against one
process.

FLUX.1 runs on it (with its speed features: its processor, overlapped single blocks, shared modulation), FLUX.2
(FLUX.1's processor in its double-stream blocks) and Cosmos-Predict2 (its self-attention processor) too.

Each transformer is split by its own diffusers plan (`_cp_plan`), every strategy, CFG groups on a guidance batch:
- Wan: rotary tables and video tokens padded to the sequence degree (45 tokens: 2 and 4 ranks pad), and the
  per-token timestep of Wan 2.2 TI2V (a 2-D timestep that the root entry of the plan splits);
- Qwen-Image: text and image tokens split each with its own padding (7 and 15 tokens) and joined text-first in
  the attention; with a reference image's tokens after the image's (Qwen-Image-Edit, 30 tokens), and
  Qwen-Image-Edit-2509's zero_cond_t variant (a per-token modulation index, split in every block, and the
  per-sample image shapes split with the batch over CFG groups);
- FLUX.3, by our plan (pipelines/flux3/parallel.py): text, image and reference-image tokens each split on entry,
  per-mode blocks attending one stream each and joint blocks all three (7 + 15 + 6 tokens);
- on CFG plans, Qwen-Image's and FLUX.3's guidance as two calls of different text lengths (7 and 5 tokens),
  one per CFG group (forward_guided).
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import join_ranks, randomize, spawn_ranks

TOLERANCE = 1e-5
HEADS = 12
WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=8, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)
LATENTS = (3, 6, 10)  # frames x height x width of the latent: 3 x 3 x 5 = 45 tokens after 2x2 patches


def plans(world_size: int) -> list:
    from engines.parallel.plan import ParallelPlan

    out = [ParallelPlan.auto(world_size, HEADS, strategy=s) for s in ("ulysses", "ring", "allgather")]
    if world_size == 2:
        out += [ParallelPlan(cfg=2), ParallelPlan(tp=2)]
    if world_size == 4:
        out += [ParallelPlan(strategy="ulysses-ring", ulysses=2, ring=2),
                ParallelPlan(strategy="ulysses", ulysses=2, cfg=2), ParallelPlan(strategy="ring", ring=2, cfg=2),
                ParallelPlan(strategy="ulysses", ulysses=2, tp=2)]
    return out


QWEN_TINY = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
                 num_attention_heads=HEADS, joint_attention_dim=16, axes_dims_rope=(2, 2, 4))
QWEN_GRID = (3, 5)  # latent tokens (after 2x2 packing): 15 image tokens; 7 text tokens


def qwen_inputs(edit: bool) -> dict:
    h, w = QWEN_GRID
    shapes = [(1, h, w), (1, h, w)] if edit else [(1, h, w)]  # Edit: the reference image's tokens follow
    return dict(hidden_states=torch.randn(2, h * w * len(shapes), 16), encoder_hidden_states=torch.randn(2, 7, 16),
                timestep=torch.tensor([0.7, 0.7]), img_shapes=[shapes] * 2, return_dict=False)


FLUX3_TINY = dict(in_channels=8, cond_in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=8,
                  num_attention_heads=HEADS, joint_attention_dim=16, timestep_channels=32, axes_dims_rope=(2, 2, 2, 2))


def flux3_inputs(reference: bool) -> dict:
    h, w = QWEN_GRID
    grid = torch.meshgrid(torch.zeros(1), torch.arange(h).float(), torch.arange(w).float(), torch.zeros(1),
                          indexing="ij")
    img_ids = torch.stack(grid, -1).reshape(-1, 4)
    txt_ids = torch.zeros(7, 4)
    txt_ids[:, 3] = torch.arange(7)
    kwargs = dict(hidden_states=torch.randn(2, h * w, 8), encoder_hidden_states=torch.randn(2, 7, 16),
                  timestep=torch.tensor([0.7, 0.7]), img_ids=img_ids, txt_ids=txt_ids, return_dict=False)
    if reference:  # a reference image of 6 tokens at time coordinate 1
        kwargs.update(image_cond_hidden_states=torch.randn(2, 6, 8),
                      image_cond_ids=img_ids[:6] + torch.tensor([1.0, 0, 0, 0]))
    return kwargs


def wan_inputs(per_token_timestep: bool) -> dict:
    frames, height, width = LATENTS
    tokens = frames * (height // 2) * (width // 2)
    timestep = torch.tensor([700.0, 700.0])
    if per_token_timestep:  # Wan 2.2 TI2V: the first frame's tokens clean
        timestep = torch.full((2, tokens), 700.0)
        timestep[:, : tokens // frames] = 0.0
    return dict(hidden_states=torch.randn(2, 4, *LATENTS), timestep=timestep,
                encoder_hidden_states=torch.randn(2, 7, 16), return_dict=False)


def _count_split_attention(parallel) -> list:
    """Record each call of the split attention (the processors' shared SequenceSplit, a family's own processors
    and the blocks that took the place of the model's), to show the split ran."""
    calls: list = []
    holders = [getattr(p, "_parallel_config", p) for p in (m.processor for m, _ in parallel._replaced)]
    holders += [blocks[index] for blocks, index, _ in getattr(parallel, "_blocks", [])]
    for holder in {id(h): h for h in holders}.values():
        attention = holder.attention

        def counted(*args, attention=attention, **kwargs):
            calls.append(kwargs["layout"])
            return attention(*args, **kwargs)

        holder.attention = counted
    return calls


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    join_ranks(rank, world_size, port)
    from diffusers import Flux3Transformer2DModel, QwenImageTransformer2DModel, WanTransformer3DModel

    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.generic import parallelize_generic, parallelize_joint
    from engines.parallel.parallelize import parallelize_transformer
    from pipelines.flux3.parallel import parallelize_flux3

    ctx = init_parallel("cpu")
    torch.manual_seed(0)
    models = {"wan": (randomize(WanTransformer3DModel(**WAN_TINY)), wan_inputs, parallelize_generic),
              "qwen": (randomize(QwenImageTransformer2DModel(**QWEN_TINY)), qwen_inputs, parallelize_joint),
              "qwen-edit": (randomize(QwenImageTransformer2DModel(**QWEN_TINY, zero_cond_t=True)), qwen_inputs,
                            parallelize_joint),
              "flux3": (randomize(Flux3Transformer2DModel(**FLUX3_TINY)), flux3_inputs, parallelize_flux3)}
    results, guided = [], []
    for plan in plans(ctx.world_size):
        for (name, (model, inputs, adapter)), variant in itertools.product(models.items(), (False, True)):
            if (name == "qwen-edit" and variant) or (name == "wan" and plan.tp > 1):
                continue  # the variant is the edit model itself; Wan's norm across heads refuses tp (test below)
            torch.manual_seed(1)
            kwargs = inputs(variant or name == "qwen-edit")
            if plan.tp > 1:  # tp splits the weights for good: a copy of the model's
                model = copy.deepcopy(model)
            with torch.no_grad():
                expected = model(**kwargs)[0]
                parallel = parallelize_transformer(model, ctx, plan, adapter)
                split_calls = _count_split_attention(parallel)
                got = parallel(**kwargs)[0]
                parallel.restore()
                again = model(**kwargs)[0]  # restore() leaves the model as it was
            results.append(dict(plan=plan.label, model=name, variant=variant, same_shape=got.shape == expected.shape,
                                err=(got - expected).abs().max().item(), scale=expected.abs().max().item(),
                                restored=(again - expected).abs().max().item(), split_calls=len(split_calls),
                                seq_degree=plan.seq_degree, real_tokens=parallel.real_tokens,
                                tokens=45 if name == "wan" else kwargs["hidden_states"].shape[1],
                                attentions=(4 + variant) if name == "flux3" else 2))  # FLUX.3: per mode, joint
        if plan.cfg > 1:  # guidance as two calls of their own text lengths, one per CFG group (forward_guided)
            for name in ("qwen", "flux3"):
                model, inputs, adapter = models[name]
                torch.manual_seed(2)
                conditional = inputs(False)
                unconditional = {**conditional, "encoder_hidden_states": conditional["encoder_hidden_states"][:, :5]}
                if "txt_ids" in conditional:
                    unconditional["txt_ids"] = conditional["txt_ids"][:5]
                passes = [{k: v for k, v in call.items() if k != "return_dict"}
                          for call in (conditional, unconditional)]
                with torch.no_grad():
                    expected = [model(**call)[0] for call in (conditional, unconditional)]
                    parallel = parallelize_transformer(model, ctx, plan, adapter)
                    got = parallel.forward_guided(passes)
                    parallel.restore()
                guided.append(dict(plan=plan.label, model=name, scale=min(e.abs().max().item() for e in expected),
                                   err=max((g - e).abs().max().item() for g, e in zip(got, expected))))
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(dict(results=results, guided=guided)))
    shutdown(ctx)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_wan_and_qwen_image_by_their_diffusers_plans_match_one_process(world_size: int, tmp_path: Path) -> None:
    spawn_ranks(_worker, world_size, str(tmp_path))
    count = 0
    for rank in range(world_size):
        ran = json.loads((tmp_path / f"rank{rank}.json").read_text())
        cfg_plans = [plan.label for plan in plans(world_size) if plan.cfg > 1]
        assert sorted((g["plan"], g["model"]) for g in ran["guided"]) == sorted(
            itertools.product(cfg_plans, ("flux3", "qwen")))
        for g in ran["guided"]:  # each CFG group ran one call, the other's prediction came over
            assert g["scale"] > 0.01 and g["err"] <= TOLERANCE, f"guided {g} on rank {rank}"
        for r in ran["results"]:
            case = f"{r['model']} {r['plan']} (variant: {r['variant']}) on rank {rank}"
            assert r["same_shape"], case
            assert r["scale"] > 0.01, f"{case}: output too small to compare ({r['scale']:.3g})"
            assert r["err"] <= TOLERANCE, f"{case}: max error {r['err']:.3g}"
            assert r["restored"] == 0.0 or "tp" in r["plan"], case
            if r["seq_degree"] > 1:  # the tokens were split: both blocks' self-attention ran split, on a shard
                assert r["split_calls"] == r["attentions"], case
                tokens = r["tokens"]
                assert r["real_tokens"][1] <= -(-tokens // r["seq_degree"]), case
            count += 1
    tp_plans = sum(plan.tp > 1 for plan in plans(world_size))
    assert count == world_size * (len(plans(world_size)) * 7 - tp_plans * 2)


def test_a_model_whose_attention_normalizes_across_heads_is_refused_tensor_parallelism() -> None:
    from diffusers import WanTransformer3DModel

    from engines.parallel.generic import generic_weights

    with pytest.raises(ValueError, match=r"normalizes q and k across all heads \(blocks\.0\.attn1\.norm_q\)"):
        generic_weights(WanTransformer3DModel(**WAN_TINY), 2)


def flux_plans(world_size: int) -> list:
    from engines.parallel.plan import ParallelPlan

    out = [ParallelPlan.auto(world_size, 6, strategy=s) for s in ("ulysses", "ring", "allgather")]
    return out + ([ParallelPlan(cfg=2), ParallelPlan(tp=2)] if world_size == 2 else [])


def _flux_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """FLUX.1, FLUX.2 and Cosmos-Predict2 (their records' adapters, all on the generic path) against one process."""
    join_ranks(rank, world_size, port)
    from diffusers import Flux2Transformer2DModel

    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.parallelize import parallelize_transformer
    from pipelines.cosmos.parallel import parallelize_cosmos
    from pipelines.flux.parallel import parallelize_flux
    from pipelines.flux2.inputs import flux2_inputs
    from pipelines.flux2.parallel import parallelize_flux2
    from pipelines.flux2.tiny import FLUX2_TINY_TRANSFORMER
    from pipelines.transformer_inputs import Shape
    from tests.helpers import cosmos_inputs, flux_inputs, tiny_cosmos, tiny_flux

    ctx = init_parallel("cpu")
    torch.manual_seed(0)
    shape = Shape(height=80, width=48, text_tokens=7)  # 5 x 3 image tokens after 2x2 packing
    models = {"flux": (randomize(tiny_flux()), lambda: flux_inputs((3, 5), 7), parallelize_flux),
              "flux2": (randomize(Flux2Transformer2DModel(**FLUX2_TINY_TRANSFORMER)),
                        lambda: flux2_inputs(FLUX2_TINY_TRANSFORMER, shape, batch=2, device=torch.device("cpu"),
                                             dtype=torch.float32)[0], parallelize_flux2),
              # 45 video tokens (pads on 2 and 4 ranks), the learnable position embedding on; per-frame timesteps
              # (video-to-world: per-token time embeddings, split at each block) and one timestep a sample
              "cosmos": (randomize(tiny_cosmos()), lambda: cosmos_inputs((3, 3, 5)), parallelize_cosmos),
              "cosmos-one-timestep": (randomize(tiny_cosmos()),
                                      lambda: {**cosmos_inputs((3, 3, 5)), "timestep": torch.rand(2)},
                                      parallelize_cosmos)}
    results = []
    for plan in flux_plans(ctx.world_size):
        for name, (model, inputs, adapter) in models.items():
            torch.manual_seed(1)
            kwargs = inputs()
            model = copy.deepcopy(model) if plan.tp > 1 else model
            with torch.no_grad():
                expected = model(**kwargs)[0]
                parallel = parallelize_transformer(model, ctx, plan, adapter)
                split_calls = _count_split_attention(parallel)
                got = parallel(**kwargs)[0]
                parallel.restore()
            results.append(dict(model=name, plan=plan.label, err=(got - expected).abs().max().item(),
                                scale=expected.abs().max().item(), split_calls=len(split_calls),
                                seq_degree=plan.seq_degree))
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


@pytest.mark.parametrize("world_size", [2, 3])
def test_flux_flux2_and_cosmos_on_the_generic_path_match_one_process(world_size: int, tmp_path: Path) -> None:
    spawn_ranks(_flux_worker, world_size, str(tmp_path))
    results = [r for rank in range(world_size) for r in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    assert len(results) == world_size * len(flux_plans(world_size)) * 4
    # every block's self-attention ran split: FLUX.1 1 + 1 blocks, FLUX.2 2 + 2, Cosmos 2
    calls = {"flux": 2, "flux2": 4, "cosmos": 2, "cosmos-one-timestep": 2}
    for r in results:
        assert r["scale"] > 0.01 and r["err"] <= TOLERANCE, r
        if r["seq_degree"] > 1:
            assert r["split_calls"] == calls[r["model"]], r
