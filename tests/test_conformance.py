"""The family conformance suite: for every registered family, its cases (the conformance.py of its folder:
pipelines.conformance says what one holds) on its tiny checkpoints.

- Each checkpoint's limits refuse what it cannot make.
- Our pipeline's final latents and output equal those of diffusers' own pipeline on the same request.
- Several gloo ranks through the app's runtime answer a request as one process does (within 1/255); with a step
  cache, every rank skips the steps one process skips.
- Through the app, as users run it: `generate` writes the output with the checkpoint's defaults in its settings,
  and `launch --nproc 2 generate` with each plan writes the same output.
- LoRAs on each family's transformer equal diffusers' PEFT adapters, and on 2 ranks one process (a family that
  diffusers has no LoRA loader for refuses them).
- --fp8's fused projections compute what separate ones do, on every case's transformer, LoRAs on them too.
- Each family's transformer, split over 2 ranks by every strategy, compiles whole, and with quantized attention errs
  as one process does.
"""

from __future__ import annotations

import importlib
import json
import threading
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np
import PIL.Image
import pytest
import torch

from pipelines.conformance import INPUTS, tiny_folder
from pipelines.factory import load_pipeline
from pipelines.media import read_mp4_settings, read_png_settings, read_video
from pipelines.registry import FAMILIES, get_spec
from pipelines.requests import RequestError, make_request, read_limits
from tests.helpers import join_ranks, run_app, spawn_ranks

DEFAULTS = dict(prompt="a red circle moving right", seed=7)


def family_module(family) -> str:
    """The conformance module of a family: conformance.py in the folder of its pipeline."""
    return family.pipeline.partition(":")[0].rpartition(".")[0] + ".conformance"


MODULES = sorted({family_module(family) for family in FAMILIES.values()})


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


def _cases(kind: str) -> list:
    return [pytest.param(module, case, id=f"{module.split('.')[1]}: {case}")
            for module in MODULES for case in getattr(_module(module), kind, {})]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The tiny checkpoints (written as cases need them) and INPUTS."""
    from pipelines.media import save_mp4

    root = tmp_path_factory.mktemp("conformance")
    image = np.zeros((64, 96, 3), np.uint8)
    image[16:40, 20:60] = (200, 30, 30)
    PIL.Image.fromarray(image).save(root / "image.png")
    PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (72, 88, 3), dtype=np.uint8)).save(root / "odd.png")
    save_mp4(np.stack([np.roll(image, 6 * i, axis=1) for i in range(9)]), root / "clip.mp4", fps=8)
    assert sorted(path.name for path in root.iterdir()) == sorted(INPUTS)
    return root


def request(module: ModuleType, model: str, fields: dict, root: Path):
    """The case's spec (with the module's SPEC changes), its tiny checkpoint and its request."""
    spec = get_spec(model)
    folder = tiny_folder(spec, root)
    spec = replace(spec, **getattr(module, "SPEC", {}))
    fields = {**DEFAULTS, **fields}
    if "condition" in fields:
        fields["condition"] = str(root / fields["condition"])
    return spec, folder, make_request(spec, read_limits(spec, folder), **fields)


def _case_models(module: str) -> list[str]:
    """The models a family's cases name, in the order they name them."""
    return [case.model for kind in ("CASES", "RANK_CASES", "APP_CASES")
            for case in getattr(_module(module), kind, {}).values()]


def _models() -> list[str]:
    """Each model of the families' cases, once."""
    return sorted({model for module in MODULES for model in _case_models(module)})


@pytest.mark.parametrize("model", _models())
def test_limits_refuse_what_the_checkpoint_cannot_make(root: Path, model: str) -> None:
    """The limits read from each tiny checkpoint's configs: a size off the family's grid or over its largest, and a
    video's frame count off its grid, refused with the message that names the rule."""
    spec = get_spec(model)
    limits = read_limits(spec, tiny_folder(spec, root))
    step = limits.size_multiple
    with pytest.raises(RequestError, match=f"width {step + 1} is not a multiple of {step}"):
        make_request(spec, limits, prompt="x", width=step + 1)
    with pytest.raises(RequestError, match=f"height {limits.max_height + step} is too large: at most "
                                           f"{limits.max_height}"):
        make_request(spec, limits, prompt="x", height=limits.max_height + step)
    if spec.media == "video" and limits.frame_multiple > 1:
        frames = limits.min_frames + 1
        with pytest.raises(RequestError, match=f"frames {frames} is not 1 \\+ a multiple of {limits.frame_multiple}"):
            make_request(spec, limits, prompt="x", frames=frames)


@pytest.mark.parametrize("model", _models())
def test_the_work_estimate_counts_each_models_flops(root: Path, model: str, tmp_path: Path) -> None:
    """The server's time estimates (pipelines.work) count each model's FLOPs on the meta device (a count that fails
    leaves the server the stand-in of pixels, app.server.budget.counted_work): more pixels, more FLOPs in a step and
    in the decode."""
    from pipelines.work import WorkCounter

    spec = get_spec(model)
    folder = tiny_folder(spec, root)
    limits = read_limits(spec, folder)
    count = WorkCounter(spec, folder, limits)
    side = limits.size_multiple * 4
    given = {}
    if limits.input_required:  # an editing or image-to-video checkpoint: its input image
        given["condition"] = str(tmp_path / "input.png")
        PIL.Image.new("RGB", (side, side), (200, 30, 30)).save(given["condition"])
    small, large = (count(make_request(spec, limits, prompt="a red circle", height=side, width=width, **given))
                    for width in (side, 2 * side))
    assert 0 < small.step_flops < large.step_flops and 0 < small.decode_flops < large.decode_flops, (small, large)


def test_every_family_has_its_cases_or_says_why_not() -> None:
    for name in MODULES:
        module = _module(name)
        assert bool(module.CASES) != bool(getattr(module, "NO_REFERENCE", "")), name


@pytest.mark.parametrize(("module_name", "case"), _cases("CASES"))
def test_equals_diffusers(root: Path, module_name: str, case: str) -> None:
    module = _module(module_name)
    expected = module.CASES[case]
    spec, folder, req = request(module, expected.model, expected.fields, root)
    pipeline = load_pipeline(spec, folder)
    cond = pipeline.encode(req)
    ours = pipeline.denoise(req, cond)
    latents, output = module.reference(spec, folder, req, cond)
    assert ours.shape == latents.shape
    bound = expected.tolerance * (latents.abs().max().item() if expected.relative else 1.0)
    assert (ours - latents).abs().max().item() <= bound, f"latents differ by {(ours - latents).abs().max().item()}"
    result = np.asarray(pipeline.decode(req, ours), np.float64)
    frames = req.frames if spec.media == "video" else None
    assert result.shape == ((frames,) if frames else ()) + (req.height, req.width, 3)
    assert result.std() > 1  # random weights still draw something
    if output is not None:
        assert np.abs(result - np.asarray(output, np.float64)).max() <= 1


def _rank(rank: int, world_size: int, port: int, module_name: str, case: str, root: str, out: str) -> None:
    join_ranks(rank, world_size, port)
    from app.ranks.runtime import start_runtime
    from engines.options import RunOptions

    module = _module(module_name)
    expected = module.RANK_CASES[case]
    spec, folder, req = request(module, expected.model, expected.fields, Path(root))
    with start_runtime([(spec, folder)], RunOptions(device="cpu", rank_timeout=120, **expected.options),
                       stop=threading.Event()) as runtime:
        if runtime.is_main:
            assert ("cfg-2" in runtime.plan) == bool(expected.options.get("cfg_parallel")), runtime.plan
            np.save(out, np.asarray(runtime.service.run(spec.media, req).result))
        else:
            runtime.service.follow()
        if expected.options.get("cache"):
            skipped = runtime.service.pipelines[spec.media].step_caches["transformer"].skipped
            np.save(f"{out}.skipped{rank}.npy", np.asarray(skipped, np.int64))


@pytest.mark.parametrize(("module_name", "case"), _cases("RANK_CASES"))
def test_ranks_equal_one_process(root: Path, module_name: str, case: str, tmp_path: Path) -> None:
    module = _module(module_name)
    expected = module.RANK_CASES[case]
    spec, folder, req = request(module, expected.model, expected.fields, root)  # the checkpoint, before the ranks
    out = tmp_path / "ranks.npy"
    spawn_ranks(_rank, expected.ranks, module_name, case, str(root), str(out))
    pipeline = load_pipeline(spec, folder)
    if expected.options.get("cache"):
        from engines.options import CacheOptions

        pipeline.use_step_cache(CacheOptions.parse(expected.options["cache"]))
    with torch.no_grad():
        single = np.asarray(pipeline.generate(req), np.int16)
    if expected.options.get("cache"):
        skipped = pipeline.step_caches["transformer"].skipped
        assert 0 < len(skipped) < req.steps - 2, f"one process skipped steps {skipped}: no test of skipping"
        for rank in range(expected.ranks):
            assert np.load(f"{out}.skipped{rank}.npy").tolist() == skipped, f"rank {rank} skipped other steps"
    parallel = np.load(out).astype(np.int16)
    assert parallel.shape == single.shape
    assert np.abs(parallel - single).max() <= 1, f"max pixel difference {np.abs(parallel - single).max()}"


def _pixels(path: Path) -> np.ndarray:
    if path.suffix == ".mp4":
        return np.asarray(read_video(path)[0], np.int16)
    return np.asarray(PIL.Image.open(path), np.int16)


def _generate(root: Path, case, out: Path, plan: tuple[str, ...] = ()) -> Path:
    """`generate` on one rank, or with `plan` on 2 (launch --nproc 2)."""
    spec = get_spec(case.model)
    options = [str(root / option) if option in INPUTS else option for option in case.options]
    launch = ("launch", "--nproc", "2") if plan else ()
    result = run_app(*launch, "generate", "--model", case.model, "--model-path", str(tiny_folder(spec, root)),
                     *options, *plan, "--prompt", "a red circle", "--seed", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def one_rank(root: Path):
    """Each app case's output from `generate` on one rank (made once, by the first test that asks)."""
    made = {}

    def output(module_name: str, case: str) -> Path:
        if (module_name, case) not in made:
            expected = _module(module_name).APP_CASES[case]
            suffix = ".mp4" if get_spec(expected.model).media == "video" else ".png"
            made[module_name, case] = _generate(root, expected, root / f"one-{len(made)}{suffix}")
        return made[module_name, case]

    return output


@pytest.mark.parametrize(("module_name", "case"), _cases("APP_CASES"))
def test_app_generate_writes_the_checkpoints_defaults(one_rank, module_name: str, case: str) -> None:
    """The output at the asked size (and frames), its settings with the checkpoint's defaults where none was asked,
    and the input named by its file name."""
    expected = _module(module_name).APP_CASES[case]
    spec, out = get_spec(expected.model), one_rank(module_name, case)
    asked = dict(zip(expected.options[::2], expected.options[1::2]))  # the cases' options are --name value pairs
    pixels = _pixels(out)
    assert pixels.std() > 1  # random weights still draw something
    width, height = (int(side) for side in asked["--size"].split("x"))
    assert pixels.shape[-3:] == (height, width, 3)
    settings = (read_mp4_settings if out.suffix == ".mp4" else read_png_settings)(out)
    assert (settings["model"], settings["guidance"], settings["steps"]) == (spec.name, spec.guidance, 2)
    assert settings["negative_prompt"] == spec.negative_prompt
    assert settings.get("condition") == asked.get("--input")
    if out.suffix == ".mp4":
        assert len(pixels) == int(asked.get("--frames", spec.frames))
        assert read_video(out)[1] == pytest.approx(float(asked.get("--fps", spec.fps)))


def _plans(module_name: str, case: str) -> list:
    return [pytest.param(module_name, case, plan, id=f"{module_name.split('.')[1]}: {case}: {plan}")
            for plan in _module(module_name).APP_CASES[case].plans]


@pytest.mark.parametrize(("module_name", "case", "plan"),
                         [p for param in _cases("APP_CASES") for p in _plans(*param.values)])
def test_app_two_ranks_equal_one_rank(root: Path, one_rank, module_name: str, case: str, plan: str,
                                      tmp_path: Path) -> None:
    expected = _module(module_name).APP_CASES[case]
    one = one_rank(module_name, case)
    two = _generate(root, expected, tmp_path / f"two{one.suffix}", expected.plans[plan])
    difference = np.abs(_pixels(two) - _pixels(one))
    assert difference.max() <= expected.tolerance and difference.mean() <= 0.1, (
        f"pixel difference: max {difference.max()}, mean {difference.mean():.3f}")


def _family_models() -> list:
    """One model per family: the first its cases name (its transformer class is the family's)."""
    firsts = {module: _case_models(module)[0] for module in MODULES}
    return [pytest.param(module, model, id=model) for module, model in firsts.items()]


LORA_RANKS = {"a": 4, "b": 2}
LORA_CHOICES = ([("a", 0.7)], [("a", 0.7), ("b", -0.4)], [("b", 1.3)])


def _transformer(model: str, root: Path) -> torch.nn.Module:
    from pipelines.family import load
    from pipelines.registry import family_of

    spec = get_spec(model)
    family = family_of(spec)
    if family.transformer_setup:
        load(family.transformer_setup)()
    return load(family.transformer).from_pretrained(tiny_folder(spec, root) / "transformer").eval()


def _loras(model: str, root: Path) -> dict[str, Path]:
    """Random LoRAs (diffusers/PEFT keys) on every linear of the model's repeated blocks, written once beside its
    checkpoint: A's entries with standard deviation 1/sqrt(in), B's with 0.2."""
    from safetensors.torch import save_file

    from pipelines.registry import family_of

    prefixes = tuple(f"{blocks}." for blocks in family_of(get_spec(model)).repeated_blocks)
    files, transformer = {}, None
    for seed, (name, rank) in enumerate(LORA_RANKS.items()):
        path = root / f"{model}-lora-{name}.safetensors"
        if not path.exists():
            transformer = transformer or _transformer(model, root)
            generator, state = torch.Generator().manual_seed(seed), {}
            for layer, module in transformer.named_modules():
                if isinstance(module, torch.nn.Linear) and layer.startswith(prefixes):
                    state[f"transformer.{layer}.lora_A.weight"] = \
                        torch.randn(rank, module.in_features, generator=generator) * module.in_features ** -0.5
                    state[f"transformer.{layer}.lora_B.weight"] = \
                        torch.randn(module.out_features, rank, generator=generator) * 0.2
            save_file(state, str(path))
        files[name] = path
    return files


def _takes_loras(model: str) -> bool:
    """Whether diffusers has a LoRA loader for the model's transformer class."""
    from engines.weights.lora import takes_loras
    from pipelines.registry import family_of

    return takes_loras(family_of(get_spec(model)).transformer.partition(":")[2])


def _adapted(model: str, root: Path, files: dict[str, Path], *, fused: bool = False):
    """The model's tiny transformer with `files` attached as the app attaches them (engines.weights.lora), and the
    choice it selects from; with `fused`, its projections fused first, as --fp8 fuses them."""
    from engines.levers.fp8 import fuse_shared_input_projections
    from engines.options import LoraFile
    from engines.weights.lora import attach_loras, check_lora_files
    from pipelines.registry import family_of

    transformer = _transformer(model, root)
    if fused:
        fuse_shared_input_projections(transformer, family_of(get_spec(model)).repeated_blocks)
    weights = check_lora_files([LoraFile(name=name, path=path) for name, path in files.items()], type(transformer),
                               dict(transformer.config))
    return transformer, attach_loras(transformer, weights, dtype=torch.float32)


def _transformer_call(model: str, transformer: torch.nn.Module) -> dict:
    """One call of the transformer at its family's first tiny size, 8 text tokens (its record's bench.inputs)."""
    from pipelines.family import load
    from pipelines.registry import family_of
    from pipelines.transformer_inputs import Shape

    bench = family_of(get_spec(model)).bench
    dims = [int(d) for d in bench.tiny_sizes[0].split("x")]
    shape = Shape(frames=dims[0], height=dims[1], width=dims[2], text_tokens=8) if bench.video else \
        Shape(height=dims[0], width=dims[1], text_tokens=8)
    torch.manual_seed(0)
    return load(bench.inputs)(dict(transformer.config), shape, batch=bench.batch, device=torch.device("cpu"),
                              dtype=torch.float32)[0]


def _pairs(a, b) -> list:
    """Two outputs' tensors side by side (Cosmos 3's outputs are lists)."""
    return list(zip(a, b)) if isinstance(b, list) else [(a, b)]


def _largest_difference(a, b) -> float:
    """Largest difference relative to b's largest magnitude."""
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in _pairs(a, b))


@pytest.mark.parametrize(("module_name", "model"), _family_models())
def test_loras_equal_diffusers_peft_adapters(root: Path, module_name: str, model: str) -> None:
    """Two LoRAs attached as the app attaches them give, for each choice of names and scales, what diffusers' own
    PEFT adapters give on the same weights (load_lora_adapter, set_adapters). A family that diffusers has no LoRA
    loader for refuses them, saying so."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    files = _loras(model, root)
    if not _takes_loras(model):
        from engines.options import LoraError

        with pytest.raises(LoraError, match="diffusers has no LoRA loader for .*, so this model takes no LoRA"):
            _adapted(model, root, files)
        return
    reference = _transformer(model, root)
    for name, path in files.items():
        state = {key.removeprefix("transformer."): value for key, value in load_file(str(path)).items()}
        reference.load_lora_adapter(state, adapter_name=name, prefix=None)
    ours, chosen = _adapted(model, root, files)
    call = _transformer_call(model, ours)
    with torch.no_grad():
        plain = _transformer(model, root)(**call)[0]
        for choice in LORA_CHOICES:
            names, scales = zip(*choice)
            reference.set_adapters(list(names), list(scales))
            expected = reference(**call)[0]
            chosen.select(choice)
            got = ours(**call)[0]
            assert _largest_difference(plain, expected) > 1e-3, choice  # the LoRA does something
            assert _largest_difference(got, expected) <= 1e-5, (choice, _largest_difference(got, expected))


@pytest.mark.parametrize("model", _models())
def test_fp8_fused_projections_equal_unfused_ones(root: Path, model: str) -> None:
    """--fp8 fuses the projections that read one input (engines.levers.fp8.fuse_shared_input_projections, diffusers'
    fuse_projections) before quantizing: every case's transformer, Wan 2.1's image-to-video attention with its image
    K and V included, computes with them fused what it computes with them apart. Two LoRAs on every linear of its
    blocks land on their slices of the fused projections (where diffusers has a LoRA loader): the same output, checked
    in float32 without FP8, whose roundings would turn the LoRA sums' last-bit differences into percents."""
    from engines.levers.fp8 import quantize_fp8
    from pipelines.registry import family_of

    def assert_equal(apart: torch.nn.Module, fused: torch.nn.Module) -> None:
        call = _transformer_call(model, fused)
        with torch.no_grad():
            difference = _largest_difference(fused(**call)[0], apart(**call)[0])
        assert difference <= 1e-5, difference

    blocks = family_of(get_spec(model)).repeated_blocks
    apart, fused = _transformer(model, root), _transformer(model, root)
    quantize_fp8(apart, blocks, fuse=False)
    quantize_fp8(fused, blocks)
    assert_equal(apart, fused)
    if _takes_loras(model):
        files = _loras(model, root)
        apart, chosen_apart = _adapted(model, root, files)
        fused, chosen_fused = _adapted(model, root, files, fused=True)
        chosen_apart.select(LORA_CHOICES[1])
        chosen_fused.select(LORA_CHOICES[1])
        assert_equal(apart, fused)


def _lora_ranks(rank: int, world_size: int, port: int, root: str, out: str, models: list[str]) -> None:
    join_ranks(rank, world_size, port)
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.parallelize import parallelize_transformer
    from pipelines.family import load
    from pipelines.registry import family_of

    ctx = init_parallel("cpu")
    errors = {}
    for model in models:
        transformer, chosen = _adapted(model, Path(root), _loras(model, Path(root)))
        chosen.select(list(LORA_CHOICES[1]))
        call = _transformer_call(model, transformer)
        with torch.no_grad():
            expected = transformer(**call)[0]
            parallel = parallelize_transformer(transformer, ctx, None, load(family_of(get_spec(model)).parallelize))
            errors[model] = _largest_difference(parallel(**call)[0], expected)
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(errors))
    shutdown(ctx)


def test_loras_on_two_ranks_equal_one_process(root: Path, tmp_path: Path) -> None:
    """Every family's transformer that takes LoRAs with two chosen, split over 2 gloo ranks by its parallel plan
    (Ulysses): the output of one process."""
    models = [param.values[1] for param in _family_models() if _takes_loras(param.values[1])]
    for model in models:
        _loras(model, root)  # the checkpoints and files, before the ranks
    spawn_ranks(_lora_ranks, 2, str(root), str(tmp_path), models)
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(errors) == sorted(models)
        assert all(error <= 1e-5 for error in errors.values()), (rank, errors)


def _compile_plans(model: str) -> list[str]:
    """The strategies a family's transformer is compiled with: every sequence split, and CFG groups where its
    guidance is one batched call."""
    from pipelines.registry import family_of

    return ["ulysses", "ring", "allgather"] + (["cfg"] if family_of(get_spec(model)).bench.batch == 2 else [])


QUANTIZED = ("int8", "fp8")
"""The attention precisions each split is checked at (the CPU's reference kernels)."""


def _largest(a, b) -> float:
    """Largest absolute difference of two outputs."""
    return max((x - y).abs().max().item() for x, y in _pairs(a, b))


def _split_ranks(rank: int, world_size: int, port: int, root: str, out: str, models: list[str]) -> None:
    join_ranks(rank, world_size, port)
    import torch.distributed._functional_collectives as funcol

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("_maybe_view_chunk_cat reached: torch 2.11's dynamo cannot trace it")

    funcol._maybe_view_chunk_cat = refuse  # stands in for torch 2.11's graph break there (the GPU image's torch)
    from engines.levers.quantized_attention import attention_precision
    from engines.parallel.distributed import init_parallel, shutdown
    from engines.parallel.parallelize import parallelize_transformer
    from engines.parallel.plan import ParallelPlan
    from pipelines.family import load
    from pipelines.registry import family_of

    ctx = init_parallel("cpu")
    compiled_errors, quantized = {}, {}
    for model in models:
        transformer = _transformer(model, Path(root))
        family = family_of(get_spec(model))
        for name in family.repeated_blocks:  # one block of each kind: every kind traced, in a fraction of the time
            parent, _, attribute = name.rpartition(".")
            blocks = transformer.get_submodule(name)
            setattr(transformer.get_submodule(parent) if parent else transformer, attribute, blocks[:1])
        adapter = load(family.parallelize)
        call = _transformer_call(model, transformer)
        with torch.no_grad():  # one process, at full precision and quantized
            one = {"full": transformer(**call)[0]}
            for precision in QUANTIZED:
                with attention_precision(precision):
                    one[precision] = transformer(**call)[0]
        for strategy in _compile_plans(model):
            plan = ParallelPlan(cfg=2) if strategy == "cfg" else \
                ParallelPlan.auto(world_size, transformer.config.num_attention_heads, strategy=strategy)
            torch._dynamo.reset()
            with torch.no_grad():
                parallel = parallelize_transformer(transformer, ctx, plan, adapter)
                eager = parallel(**call)[0]
                compiled = torch.compile(parallel, fullgraph=True, backend="aot_eager")(**call)[0]
                for precision in QUANTIZED:
                    with attention_precision(precision):
                        got = parallel(**call)[0]
                    quantized[f"{model} {strategy} {precision}"] = dict(
                        err=_largest(got, one[precision]), own=_largest(one[precision], one["full"]),
                        full=_largest(got, one["full"]))
                parallel.restore()
            compiled_errors[f"{model} {strategy}"] = _largest(compiled, eager)
    Path(out, f"rank{ctx.rank}.json").write_text(json.dumps(dict(compiled=compiled_errors, quantized=quantized)))
    shutdown(ctx)


def test_every_split_compiles_whole_and_quantizes_attention_as_one_process(root: Path, tmp_path: Path) -> None:
    """Every family's transformer (one block of each kind) split over 2 gloo ranks by its parallel plan, with each
    sequence split (and CFG groups where guidance is one batched call):
    - compiled whole (fullgraph=True) with "aot_eager": what inductor receives (dynamo's graph with the functional
      collectives, then AOT autograd), without its fusion, so it equals eager exactly; any graph break fails. torch
      2.11 (the GPU image) cannot trace torch._utils._maybe_view_chunk_cat, which funcol's all-gather calls for a
      non-zero gather dim; torch 2.13 (here) can, so the ranks make it raise: the test fails if the parallel layer
      ever reaches it;
    - with quantized attention (--attention-precision int8 and fp8) it errs as one process does: the ranks quantize
      other blocks of tokens than one process (padding, ring blocks), so their rounding is another of the same size.
      Against one process at the same precision, and against full precision, they stay within twice one process's
      own error (its quantized output against its full-precision one; 2026-11-30, the largest ratios 1.56 and 1.43,
      both ring: a ring block's keys are smoothed and scaled on their own)."""
    models = [param.values[1] for param in _family_models()]
    for model in models:
        _transformer(model, root)  # the checkpoints, before the ranks
    spawn_ranks(_split_ranks, 2, str(root), str(tmp_path), models)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        errors, quantized = results["compiled"], results["quantized"]
        assert len(errors) == sum(len(_compile_plans(model)) for model in models)
        assert all(error == 0.0 for error in errors.values()), (rank, errors)
        assert len(quantized) == len(errors) * len(QUANTIZED)
        for case, r in quantized.items():
            assert r["own"] > 0, (rank, case, r)  # its attention was quantized
            assert r["err"] <= 2 * r["own"] and r["full"] <= 2 * r["own"], (rank, case, r)
