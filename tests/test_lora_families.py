"""LoRA adapters (engines/weights/lora.py) on the families of the generic path: Wan, Qwen-Image and FLUX.3.

For each tiny transformer a random LoRA (diffusers/PEFT keys, on every linear of its repeated blocks) gives what
diffusers' own PEFT adapters give on the same weights (load_lora_adapter + set_adapters), and the same on two gloo
ranks (Ulysses on the generic path) as in one process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import join_ranks, randomize, spawn_ranks
from tests.test_engines_generic import FLUX3_TINY, QWEN_TINY, WAN_TINY, flux3_inputs, qwen_inputs, wan_inputs

TOLERANCE = 1e-5
FAMILIES = {  # name: (transformer class, its tiny config, its inputs, the linears a LoRA adapts in each block)
    "wan": ("WanTransformer3DModel", WAN_TINY, lambda: wan_inputs(False),
            ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
             "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")),
    "qwen-image": ("QwenImageTransformer2DModel", QWEN_TINY, lambda: qwen_inputs(False),
                   ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                    "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2")),
    "flux3": ("Flux3Transformer2DModel", FLUX3_TINY, lambda: flux3_inputs(True),
              ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")),
}
BLOCKS = {"wan": ("blocks",), "qwen-image": ("transformer_blocks",),
          "flux3": ("txt_mode_blocks", "mode_blocks.image", "mode_blocks.image_cond", "single_transformer_blocks")}


def model(family: str) -> torch.nn.Module:
    import diffusers

    cls, config, _, _ = FAMILIES[family]
    torch.manual_seed(0)
    return randomize(getattr(diffusers, cls)(**config))


def make_lora(family: str, path: Path, seed: int, rank: int) -> Path:
    from safetensors.torch import save_file

    transformer = model(family)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for blocks in BLOCKS[family]:
        for index in range(len(transformer.get_submodule(blocks))):
            for layer in FAMILIES[family][3]:
                name = f"{blocks}.{index}.{layer}"
                linear = transformer.get_submodule(name)
                down = torch.randn(rank, linear.in_features, generator=generator) * 0.2
                up = torch.randn(linear.out_features, rank, generator=generator) * 0.2
                state[f"transformer.{name}.lora_A.weight"] = down
                state[f"transformer.{name}.lora_B.weight"] = up
    save_file(state, str(path))
    return path


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, dict[str, Path]]:
    folder = tmp_path_factory.mktemp("family-loras")
    return {family: {"a": make_lora(family, folder / f"{family}-a.safetensors", 0, 4),
                     "b": make_lora(family, folder / f"{family}-b.safetensors", 1, 2)} for family in FAMILIES}


def adapted(family: str, files: dict[str, Path]) -> tuple[torch.nn.Module, object]:
    from engines.weights.lora import LoraFile, attach_loras, check_lora_files

    transformer = model(family)
    weights = check_lora_files([LoraFile(name=name, path=path) for name, path in files.items()], type(transformer),
                               dict(transformer.config))
    return transformer, attach_loras(transformer, weights, dtype=torch.float32)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_matches_diffusers_peft_adapters(family: str, loras) -> None:
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    reference = model(family)
    for name, path in loras[family].items():
        state = {k.removeprefix("transformer."): v for k, v in load_file(str(path)).items()}
        reference.load_lora_adapter(state, adapter_name=name, prefix=None)
    ours, chosen = adapted(family, loras[family])
    kwargs = FAMILIES[family][2]()
    with torch.no_grad():
        plain = model(family)(**kwargs)[0]
        for choice in ([("a", 0.7)], [("a", 0.7), ("b", -0.4)], [("b", 1.3)]):
            names, weights = zip(*choice)
            reference.set_adapters(list(names), list(weights))
            expected = reference(**kwargs)[0]
            chosen.select(choice)
            got = ours(**kwargs)[0]
            assert (expected - plain).abs().max() > 1e-3, choice  # the LoRA does something
            assert (got - expected).abs().max() <= TOLERANCE, (choice, (got - expected).abs().max().item())


def _worker(rank: int, world_size: int, port: int, out_dir: str, files: dict[str, dict[str, str]]) -> None:
    join_ranks(rank, world_size, port)
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.generic import parallelize_generic, parallelize_joint
    from engines.parallel.parallelize import parallelize_transformer
    from engines.parallel.plan import ParallelPlan
    from pipelines.flux3.parallel import parallelize_flux3

    adapters = {"wan": parallelize_generic, "qwen-image": parallelize_joint, "flux3": parallelize_flux3}
    ctx = init_parallel("cpu")
    results = {}
    for family, paths in files.items():
        transformer, chosen = adapted(family, {name: Path(path) for name, path in paths.items()})
        chosen.select([("a", 0.7), ("b", -0.4)])
        torch.manual_seed(1)
        kwargs = FAMILIES[family][2]()
        with torch.no_grad():
            expected = transformer(**kwargs)[0]
            parallel = parallelize_transformer(transformer, ctx, ParallelPlan.auto(world_size, 12, strategy="ulysses"),
                                               adapters[family])
            got = parallel(**kwargs)[0]
        results[family] = (got - expected).abs().max().item()
    Path(out_dir, f"rank{ctx.rank}.json").write_text(json.dumps(results))
    shutdown(ctx)


def test_two_ranks_on_the_generic_path_equal_one_process(loras, tmp_path: Path) -> None:
    files = {family: {name: str(path) for name, path in paths.items()} for family, paths in loras.items()}
    spawn_ranks(_worker, 2, str(tmp_path), files)
    for rank in range(2):
        for family, error in json.loads((tmp_path / f"rank{rank}.json").read_text()).items():
            assert error <= TOLERANCE, (family, rank, error)
