"""The plans chosen for the real models at the GPU counts our users have (2-8)."""

from __future__ import annotations

import pytest

from engines.parallel.plan import ParallelPlan

FLUX_HEADS, COSMOS_2B_HEADS, COSMOS_14B_HEADS = 24, 16, 40


@pytest.mark.parametrize(
    ("world", "heads", "cfg", "expected"),
    [
        (2, FLUX_HEADS, 1, dict(strategy="ulysses", ulysses=2, ring=1, cfg=1)),
        (4, FLUX_HEADS, 1, dict(strategy="ulysses", ulysses=4, ring=1, cfg=1)),
        (8, FLUX_HEADS, 1, dict(strategy="ulysses", ulysses=8, ring=1, cfg=1)),
        (3, FLUX_HEADS, 1, dict(strategy="ulysses", ulysses=3, ring=1, cfg=1)),
        (5, FLUX_HEADS, 1, dict(strategy="ring", ulysses=1, ring=5, cfg=1)),
        (8, COSMOS_2B_HEADS, 1, dict(strategy="ulysses", ulysses=8, ring=1, cfg=1)),
        (8, COSMOS_2B_HEADS, 2, dict(strategy="ulysses", ulysses=4, ring=1, cfg=2)),
        (4, COSMOS_2B_HEADS, 2, dict(strategy="ulysses", ulysses=2, ring=1, cfg=2)),
        (6, COSMOS_2B_HEADS, 1, dict(strategy="ulysses-ring", ulysses=2, ring=3, cfg=1)),
        (8, COSMOS_14B_HEADS, 1, dict(strategy="ulysses", ulysses=8, ring=1, cfg=1)),
        (6, COSMOS_14B_HEADS, 2, dict(strategy="ring", ulysses=1, ring=3, cfg=2)),
    ],
    ids=lambda value: ParallelPlan(**value).label if isinstance(value, dict) else None,
)
def test_auto_plans_for_real_head_counts(world, heads, cfg, expected):
    plan = ParallelPlan.auto(world, heads, cfg=cfg)
    assert dict(strategy=plan.strategy, ulysses=plan.ulysses, ring=plan.ring, cfg=plan.cfg) == expected
    plan.check(world_size=world, num_heads=heads)


def test_hybrid_for_heads_the_gpu_count_does_not_divide():
    plan = ParallelPlan.auto(8, 6)
    assert (plan.strategy, plan.ulysses, plan.ring) == ("ulysses-ring", 2, 4)
