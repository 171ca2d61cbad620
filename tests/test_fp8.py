"""--fp8 (engines/levers/fp8.py): which layers become FP8, how many activation quantizations a block runs (fused
projections quantize a shared input once, eager and compiled), FP8 runs at 2 and 4 gloo ranks equal to one
FP8 process (with --tp too: tests/test_fp8_tensor_parallel.py checks the FP8 weights bit for bit), a compiled FP8 engine
equal to the eager one, and FP8 in the engine cache's key.

(The embedded tiny-flux keeps its held-out scores with --fp8: tests/test_tiny_quality.py.)
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest

from pipelines.registry import resolve_model
from pipelines.requests import make_request, read_limits
from tests.helpers import join_ranks, spawn_ranks

PROMPT = "a big red star in the center on a white background"


def _layers(cls, config: dict, blocks: tuple[str, ...]) -> tuple[set[str], set[str]]:
    """(FP8 layer patterns, kept block-linear patterns) of a model, block indexes as N."""
    import torch

    from engines.levers.fp8 import fp8_linear_names

    with torch.device("meta"):
        model = cls(**config)
    chosen = set(fp8_linear_names(model, blocks))
    inside = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith(blocks)}

    def pattern(names: set[str]) -> set[str]:
        return {re.sub(r"\.\d+\.", ".N.", n) for n in names}

    return pattern(chosen), pattern(inside - chosen)


def test_block_linears_become_fp8_and_modulation_stays() -> None:
    from diffusers import CosmosTransformer3DModel, Flux2Transformer2DModel, FluxTransformer2DModel

    from pipelines.cosmos.record import _cosmos_predict2
    from pipelines.flux.record import FLUX_DEV
    from pipelines.flux2.record import FLUX2

    fp8, kept = _layers(FluxTransformer2DModel, FLUX_DEV.transformer,
                        ("transformer_blocks", "single_transformer_blocks"))
    assert {"transformer_blocks.N.attn.to_q", "transformer_blocks.N.ff.net.2", "single_transformer_blocks.N.proj_out",
            "single_transformer_blocks.N.proj_mlp"} <= fp8
    assert kept == {"transformer_blocks.N.norm1.linear", "transformer_blocks.N.norm1_context.linear",
                    "single_transformer_blocks.N.norm.linear"}  # AdaLN modulation
    fp8, kept = _layers(CosmosTransformer3DModel, _cosmos_predict2(num_attention_heads=16, num_layers=2).transformer,
                        ("transformer_blocks",))
    assert {"transformer_blocks.N.attn1.to_q", "transformer_blocks.N.attn2.to_k",
            "transformer_blocks.N.ff.net.2"} <= fp8
    assert kept and all(".norm" in name for name in kept)  # AdaLN-LoRA modulation
    dev = next(m for m in FLUX2.models if m.name == "flux2-dev").architecture.transformer
    fp8, kept = _layers(Flux2Transformer2DModel, {**dev, "num_layers": 1, "num_single_layers": 1},
                        ("transformer_blocks", "single_transformer_blocks"))
    assert "single_transformer_blocks.N.attn.to_qkv_mlp_proj" in fp8 and not kept  # modulation is outside the blocks


def _quantizations_per_block(model, kwargs: dict, *, compiled: bool) -> list[int]:
    """How many activations each block call casts to float8, in call order: eager, counted as they dispatch;
    compiled (inductor, each block apart as inductor-blocks does), counted in each block's graph after
    inductor's own passes, which is what its kernels compute (the casts a kernel fuses still each run)."""
    import torch
    import torch._inductor.config as inductor_config
    from torch.utils._python_dispatch import TorchDispatchMode

    def casts(nodes) -> int:
        return sum(str(n.target) in ("aten._to_copy.default", "prims.convert_element_type.default")
                   and torch.float8_e4m3fn in (*n.args[1:], n.kwargs.get("dtype")) for n in nodes)

    class Casts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            self.count += func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.float8_e4m3fn
            return func(*args, **kwargs)

    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    counts: list[int] = []
    if compiled:
        torch._dynamo.reset()
        for block in blocks:
            block.compile(backend="inductor", fullgraph=True)
        with inductor_config.patch(fx_graph_cache=False,
                                   post_grad_custom_post_pass=lambda graph: counts.append(casts(graph.nodes))):
            with torch.no_grad():
                model(**kwargs)
        return counts
    mode = Casts()
    for block in blocks:
        block.register_forward_pre_hook(lambda *_: counts.append(mode.count))
        block.register_forward_hook(lambda *_: counts.append(mode.count - counts.pop()))
    with torch.no_grad(), mode:
        model(**kwargs)
    return counts


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_projections_that_share_an_input_quantize_it_once(compiled: bool) -> None:
    """FLUX.1's q/k/v read one normed input per stream. Each FP8 linear casts its own float8 copy of its
    activation, compiled too (inductor finds a shared input's per-row maximum once, but not the copies): a
    double-stream block cast 12 activations (q, k, v of both streams, both attention outputs, both MLPs' two
    layers), a single-stream block 5 (q, k, v, proj_mlp, proj_out). Fused
    (engines.levers.fp8.fuse_shared_input_projections): 8 and 3, with the same output."""
    import torch

    from engines.levers.fp8 import quantize_fp8
    from tests.helpers import flux_inputs, randomize, tiny_flux

    torch.manual_seed(0)
    unfused = randomize(tiny_flux())
    fused = randomize(tiny_flux())
    fused.load_state_dict(unfused.state_dict())
    kwargs = flux_inputs((4, 6), 5, batch=1)
    quantize_fp8(unfused, ("transformer_blocks", "single_transformer_blocks"), fuse=False)
    quantize_fp8(fused, ("transformer_blocks", "single_transformer_blocks"))
    assert fused.transformer_blocks[0].attn.fused_projections and not isinstance(fused.transformer_blocks[0].attn.to_q,
                                                                                  torch.nn.Linear)
    with torch.no_grad():
        expected, got = unfused(**kwargs)[0], fused(**kwargs)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert _quantizations_per_block(unfused, kwargs, compiled=compiled) == [12, 5]
    assert _quantizations_per_block(fused, kwargs, compiled=compiled) == [8, 3]


def test_flux2_double_stream_projections_are_fused() -> None:
    """FLUX.2's double-stream attention fuses like FLUX.1's; its single-stream blocks come fused already."""
    import torch
    from diffusers import Flux2Transformer2DModel

    from engines.levers.fp8 import quantize_fp8
    from tests.helpers import randomize
    from tests.test_engines_parallel import FLUX2_TINY, flux2_inputs

    torch.manual_seed(0)
    unfused = randomize(Flux2Transformer2DModel(**{**FLUX2_TINY, "num_layers": 1, "num_single_layers": 1}))
    fused = randomize(Flux2Transformer2DModel(**{**FLUX2_TINY, "num_layers": 1, "num_single_layers": 1}))
    fused.load_state_dict(unfused.state_dict())
    kwargs = flux2_inputs(7, (5, 3), None, batch=1)
    quantize_fp8(unfused, ("transformer_blocks", "single_transformer_blocks"), fuse=False)
    quantize_fp8(fused, ("transformer_blocks", "single_transformer_blocks"))
    with torch.no_grad():
        expected, got = unfused(**kwargs)[0], fused(**kwargs)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert _quantizations_per_block(unfused, kwargs, compiled=False) == [12, 2]
    assert _quantizations_per_block(fused, kwargs, compiled=False) == [8, 2]


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_wan_cross_attention_keeps_its_query_projection(kind: str) -> None:
    """Wan's cross-attention fuses K and V alone (to_kv; the image-to-video one its image K and V too, to_added_kv):
    its query projection stays, and the fused model gives the unfused one's output; its self-attention fuses all
    three (to_qkv). What a fused projection replaced is a weightless FusedAway, not gone: diffusers' processor tells
    an image-to-video attention by `attn.add_k_proj is not None`. (Every family's fused projections, and LoRAs on
    them: tests/test_conformance.py.)"""
    import torch
    from diffusers import WanTransformer3DModel

    from engines.levers.fp8 import FusedAway, fuse_shared_input_projections
    from pipelines.transformer_inputs import Shape
    from pipelines.wan.inputs import wan_inputs
    from pipelines.wan.tiny import WAN_I2V_TINY_TRANSFORMER, WAN_TINY_TRANSFORMER
    from tests.helpers import randomize

    config = WAN_I2V_TINY_TRANSFORMER if kind == "i2v" else WAN_TINY_TRANSFORMER
    torch.manual_seed(0)
    unfused = randomize(WanTransformer3DModel(**config))
    fused = randomize(WanTransformer3DModel(**config))
    fused.load_state_dict(unfused.state_dict())
    assert fuse_shared_input_projections(fused, ("blocks",)) == 2 * len(fused.blocks)
    cross, self_attention = fused.blocks[0].attn2, fused.blocks[0].attn1
    assert isinstance(cross.to_q, torch.nn.Linear) and isinstance(cross.to_kv, torch.nn.Linear)
    assert isinstance(cross.to_k, FusedAway) and isinstance(self_attention.to_q, FusedAway)
    assert isinstance(self_attention.to_qkv, torch.nn.Linear)
    assert (cross.add_k_proj is not None) == (kind == "i2v")
    # the processor takes the last 512 text tokens as text, any before them as the image's
    kwargs, _ = wan_inputs(dict(fused.config), Shape(frames=5, height=48, width=64, text_tokens=512), batch=1,
                           device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        expected, got = unfused(**kwargs)[0], fused(**kwargs)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def _request(name: str = "tiny-flux"):
    spec, path = resolve_model(name, None)
    return spec, path, make_request(spec, read_limits(spec, path), prompt=PROMPT, seed=3, steps=3, height=64,
                                    width=96)


def _run(options: dict) -> np.ndarray | None:
    """One request through the app's runtime with --fp8 and `options`; the image on rank 0, None elsewhere."""
    from app.ranks.runtime import start_runtime
    from engines.options import RunOptions

    spec, path, req = _request()
    with start_runtime([(spec, path)], RunOptions(device="cpu", rank_timeout=120, fp8=True, **options),
                       stop=threading.Event()) as runtime:
        assert "fp8" in runtime.backend
        if not runtime.is_main:
            runtime.service.follow()
            return None
        return np.asarray(runtime.service.run("image", req).result)


def _rank(rank: int, world_size: int, port: int, options: dict, out: str) -> None:
    join_ranks(rank, world_size, port)
    image = _run(options)
    if image is not None:
        np.save(out, image)


def _assert_within_fp8_noise(image: np.ndarray, reference: np.ndarray, what: str) -> None:
    """`image` equals `reference` up to FP8's own rounding noise.

    Rounding to e4m3 is a step function: float32 differences in the last bits (another reduction order on
    several ranks or in a compiled graph) flip some roundings, and a flipped rounding moves a value by up to
    1/16. Measured on this request, three draws each: one FP8 process whose transformer input moves by 1e-6
    (relative, random) differs from itself by 0.35-0.40 levels on average and 6-8 at the 99th percentile
    (without FP8: 0.00 and 0); by 1e-5, 0.55-1.01 and 10-19. The bound is that noise; a wrong shard or
    scale is off by tens of levels on average.
    """
    difference = np.abs(image.astype(np.int16) - reference.astype(np.int16))
    mean, p99 = difference.mean(), np.percentile(difference, 99)
    print(f"{what}: {mean:.2f} levels on average, {p99:.0f} at the 99th percentile, {difference.max()} at most")
    assert mean <= 1.0 and p99 <= 16, (f"{what} differ from one eager FP8 process by {mean:.2f} levels on average, "
                                      f"{p99:.0f} at the 99th percentile")


@pytest.fixture(scope="module")
def one_process() -> np.ndarray:
    return _run({})


@pytest.mark.parametrize(("world_size", "options"), [
    (2, dict(strategy="ulysses")), (4, dict(strategy="allgather")),
    (2, dict(tp=2)), (4, dict(strategy="ulysses", tp=2)),  # each rank loads its share, then quantizes it
], ids=["ulysses-2", "allgather-4", "tp-2", "ulysses-2xtp-2"])
def test_fp8_ranks_equal_one_fp8_process(one_process: np.ndarray, world_size: int, options: dict,
                                         tmp_path: Path) -> None:
    out = tmp_path / "ranks.npy"
    spawn_ranks(_rank, world_size, options, str(out))
    _assert_within_fp8_noise(np.load(out), one_process, f"{world_size} FP8 ranks ({options})")


def test_launch_generate_with_tp_and_fp8(one_process: np.ndarray, tmp_path: Path) -> None:
    """`launch --nproc 2 generate --tp 2 --fp8`: the memory plan counts the FP8 weights, the two ranks draw one
    FP8 process's image."""
    import subprocess
    import sys

    from PIL import Image

    from tests.helpers import REPO

    out = tmp_path / "tp.png"
    result = subprocess.run([sys.executable, "-m", "app", "launch", "--nproc", "2", "--gpu-memory", "1",
                             "generate", "--model", "tiny-flux", "--prompt", PROMPT, "--seed", "3", "--steps", "3",
                             "--size", "96x64", "--tp", "2", "--fp8", "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "launch: --tp 2:" in result.stderr and "FP8" in result.stderr, result.stderr
    _assert_within_fp8_noise(np.asarray(Image.open(out).convert("RGB")), one_process, "launch --tp 2 --fp8")


def test_compiled_fp8_engine_equals_eager_and_has_its_own_cache_key(one_process: np.ndarray, tmp_path: Path) -> None:
    import torch

    from engines.levers.cache import key_document
    from engines.levers.fp8 import quantize_fp8
    from engines.options import EngineOptions
    from pipelines.factory import load_pipeline

    compiled = _run(dict(backend="inductor-blocks", engine_cache=tmp_path))
    _assert_within_fp8_noise(compiled, one_process, "a compiled FP8 engine")

    spec, path, _ = _request()
    model = load_pipeline(spec, path, with_encoders=False).transformer
    module = type("Module", (), {"model": model, "device": torch.device("cpu"), "dtype": torch.float32})()
    plain = key_document(module, "signature", EngineOptions.parse("inductor-blocks"), 0)
    quantize_fp8(model, ("transformer_blocks", "single_transformer_blocks"))
    quantized = key_document(module, "signature", EngineOptions.parse("inductor-blocks"), 0)
    assert plain["fp8_layers"] == 0 and quantized["fp8_layers"] > 0


def test_a_row_of_zeros_quantizes_to_zeros_not_nan() -> None:
    """Cosmos zeroes its padded prompt tokens (and shards are zero-padded): an all-zero activation row has
    amax 0, and without engines.levers.fp8's floor its scale is 0 and the row 0/0 = NaN; tiny-cosmos then drew black."""
    import torch

    from engines.levers.fp8 import quantize_fp8

    spec, path = resolve_model("tiny-cosmos", None)
    from pipelines.factory import load_pipeline

    pipeline = load_pipeline(spec, path)
    request = make_request(spec, read_limits(spec, path), prompt="a red circle moving right", seed=2, steps=3,
                           frames=9, height=48, width=80)
    exact = np.asarray(pipeline.generate(request)).astype(np.int16)
    quantize_fp8(pipeline.transformer, ("transformer_blocks",))
    linear = pipeline.transformer.transformer_blocks[0].attn2.to_k  # reads the prompt embeddings
    rows = torch.randn(1, 4, linear.in_features)
    rows[:, 2:] = 0
    out = linear(rows)
    assert torch.isfinite(out).all() and (out[:, 2:] == 0).all()  # no bias: zeros in, zeros out
    fp8 = np.asarray(pipeline.generate(request)).astype(np.int16)
    difference = np.abs(fp8 - exact).mean()
    assert difference < 20, f"tiny-cosmos with FP8 differs from float32 by {difference:.1f} levels on average"
