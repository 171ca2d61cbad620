"""Rank 0's prompt cache (pipelines/prompt_cache.py): a repeated prompt is not encoded again, and what the
encoding depends on (negative prompt, guidance) keys it."""

from __future__ import annotations

import pytest
import torch

from pipelines.factory import load_pipeline
from pipelines.prompt_cache import PromptCache
from pipelines.registry import resolve_model
from pipelines.requests import make_request, read_limits


def _counting(module: torch.nn.Module) -> list[int]:
    """A list whose length is how many times `module`'s forward ran (a forward hook)."""
    calls: list[int] = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_a_repeated_prompt_is_not_encoded_again() -> None:
    spec, folder = resolve_model("tiny-flux", None)
    pipeline = load_pipeline(spec, folder)
    pipeline.use_prompt_cache(PromptCache(entries=2))
    clip, t5 = _counting(pipeline.text_encoder), _counting(pipeline.text_encoder_2)
    limits = read_limits(spec, folder)
    first = pipeline.encode(make_request(spec, limits, prompt="a red circle", seed=1))
    again = pipeline.encode(make_request(spec, limits, prompt="a red circle", seed=2, steps=3))  # new seed, steps
    assert len(clip) == len(t5) == 1 and torch.equal(first.prompt_embeds, again.prompt_embeds)
    pipeline.encode(make_request(spec, limits, prompt="a blue square"))
    assert len(t5) == 2 and pipeline.prompt_cache.hits == 1 and pipeline.prompt_cache.misses == 2
    pipeline.encode(make_request(spec, limits, prompt="a green ring"))  # 2 entries: "a red circle" goes
    pipeline.encode(make_request(spec, limits, prompt="a red circle"))
    assert len(t5) == 4
    uncached = load_pipeline(spec, folder)  # and the cached encoding is the encoding
    assert torch.equal(uncached.encode(make_request(spec, limits, prompt="a red circle")).prompt_embeds,
                       first.prompt_embeds)


def test_the_negative_prompt_and_guidance_key_a_cosmos_encoding() -> None:
    spec, folder = resolve_model("tiny-cosmos", None)
    pipeline = load_pipeline(spec, folder)
    pipeline.use_prompt_cache(PromptCache())
    t5 = _counting(pipeline.text_encoder)
    limits = read_limits(spec, folder)
    ask = dict(prompt="the square moves up", frames=5, height=32, width=32)
    pipeline.encode(make_request(spec, limits, **ask, negative_prompt="blurry"))
    pipeline.encode(make_request(spec, limits, **ask, negative_prompt="blurry", seed=9))
    assert len(t5) == 2  # prompt and negative prompt, once
    pipeline.encode(make_request(spec, limits, **ask, negative_prompt="static"))
    assert len(t5) == 4
    without_guidance = pipeline.encode(make_request(spec, limits, **ask, negative_prompt="static", guidance=1.0))
    assert len(t5) == 5 and without_guidance.negative_prompt_embeds is None


def test_a_cache_holds_at_least_one_entry_and_stores_no_failure() -> None:
    with pytest.raises(ValueError, match="at least one entry"):
        PromptCache(entries=0)
    cache = PromptCache()
    with pytest.raises(RuntimeError):
        cache.get_or_compute("k", lambda: (_ for _ in ()).throw(RuntimeError("encoder failed")))
    assert len(cache) == 0 and cache.get_or_compute("k", lambda: 3) == 3
