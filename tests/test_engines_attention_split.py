"""The sequence strategy is switched on once: engines/parallel/attention.py's split_attention.

Every model family's attention is a call of the SplitAttention that split_attention(mesh) returns.
These tests read the engines/*.py sources (no ranks spawned) and find every decision that names a
strategy: a comparison or branch test reading a plan's strategy axes or names (`plan.ulysses > 1`,
`plan.kv_exchange == "allgather"`, `strategy in ("ring", ...)`, `match plan.strategy`), a table
indexed by one, or an isinstance check against a strategy class. plan.py, mesh.py and options.py
define and parse the plan and may decide on it; elsewhere only split_attention does. A degree used
as a number (`range(plan.ring)`) is no decision.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(REPO / "engines").rglob("*.py"), *(REPO / "pipelines").rglob("*.py")])
"""The engines and the families' own adapters."""
ATTENTION = "engines/parallel/attention.py"
PLAN_MODULES = {"engines/parallel/plan.py", "engines/parallel/mesh.py", "engines/options.py"}  # the plan's own
STRATEGY_ATTRIBUTES = {"strategy", "kv_exchange", "ulysses", "ring"}  # a plan's fields that say the strategy
DEGREES = {"ulysses", "ring"}  # numbers too: an index or a key made of them is no decision


def _strategy_names() -> set[str]:
    from engines.options import STRATEGIES

    return set(STRATEGIES)


def _strategy_classes() -> set[str]:
    import engines.parallel.attention as attention

    return {value.__name__ for value in vars(attention).values()
            if isinstance(value, type) and issubclass(value, attention.SplitAttention)}


def _names_strategy(node: ast.AST, classes: set[str], *, degrees: bool = True) -> bool:
    """Whether the expression reads a strategy field (`degrees`: the axes' degrees too), holds a
    strategy's name or names a strategy class."""
    strategies = _strategy_names()
    fields = STRATEGY_ATTRIBUTES if degrees else STRATEGY_ATTRIBUTES - DEGREES
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in fields:
            return True
        if isinstance(sub, ast.Constant) and sub.value in strategies:
            return True
        if isinstance(sub, ast.Name) and sub.id in classes:
            return True
    return False


def _decisions(tree: ast.AST) -> list[tuple[ast.AST, bool]]:
    """The expressions of a module that choose between paths, each with whether a degree in it decides:
    branch and loop tests, assertions, comprehension filters, match subjects and patterns, every
    comparison and isinstance check; subscripts and dict keys (a table looked up by strategy)."""
    found: list[tuple[ast.AST, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            found.append((node.test, True))
        elif isinstance(node, ast.comprehension):
            found.extend((test, True) for test in node.ifs)
        elif isinstance(node, ast.Match):
            found.append((node.subject, True))
            found.extend((case.pattern, True) for case in node.cases)
        elif isinstance(node, ast.Compare):
            found.append((node, True))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("isinstance", "issubclass")):
            found.append((node, True))
        elif isinstance(node, ast.Subscript):
            found.append((node.slice, False))
        elif isinstance(node, ast.Dict):
            found.extend((key, False) for key in node.keys if key is not None)
    return found


def strategy_switches(source: str, classes: set[str] | None = None) -> list[tuple[str, int, str]]:
    """(enclosing function, line, source text) of each decision in `source` that names a strategy."""
    classes = _strategy_classes() if classes is None else classes
    tree = ast.parse(source)
    owner: dict[ast.AST, str] = {}
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(function):
                owner.setdefault(sub, function.name)  # outer functions first: the outermost name
    switches = {(owner.get(d, "<module>"), d.lineno, ast.get_source_segment(source, d) or "")
                for d, degrees in _decisions(tree) if _names_strategy(d, classes, degrees=degrees)}
    return sorted(switches, key=lambda s: s[1])


def test_the_strategy_is_switched_on_in_split_attention_only() -> None:
    found = {name: strategy_switches(path.read_text()) for path in SOURCES
             if (name := path.relative_to(REPO).as_posix()) not in PLAN_MODULES}
    elsewhere = {name: switches for name, switches in found.items() if switches and name != ATTENTION}
    assert not elsewhere, f"strategy switches outside engines/parallel/attention.py: {elsewhere}"
    assert found[ATTENTION], "split_attention's switch was not found: the detector is blind"
    outside = [s for s in found[ATTENTION] if s[0] != "split_attention"]
    assert not outside, f"engines/parallel/attention.py switches on the strategy outside split_attention: {outside}"


def test_other_modules_reach_attention_through_split_attention() -> None:
    """The strategies' parts (their classes, ring steps, all-to-alls) are not assembled elsewhere."""
    allowed = {"split_attention", "SplitAttention"}
    for path in SOURCES:
        if path.relative_to(REPO).as_posix() == ATTENTION:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "engines.parallel.attention":
                names = {alias.name for alias in node.names}
                assert names <= allowed, \
                    f"{path.name} imports {sorted(names - allowed)} from engines.parallel.attention"
            elif isinstance(node, ast.ImportFrom) and node.module == "engines.parallel":
                assert "attention" not in {alias.name for alias in node.names}, path.name
            elif isinstance(node, ast.Import):
                assert "engines.parallel.attention" not in {alias.name for alias in node.names}, path.name


@pytest.mark.parametrize("source", [
    "if plan.ulysses > 1:\n    pass",
    "if mesh.plan.ring == 1:\n    pass",
    "gather = plan.ring > 1 and plan.kv_exchange == 'allgather'",
    "def f(plan):\n    return plan.strategy in ('ring', 'allgather')",
    "if isinstance(split, UlyssesAttention):\n    pass",
    "x = RingAttention if plan.ulysses == 1 else UlyssesAttention",
    "split = {'ring': RingAttention, 'ulysses': UlyssesAttention}[plan.strategy]",
    "match plan.strategy:\n    case 'ring':\n        pass",
    "if plan.ring:\n    pass",
])
def test_the_detector_sees_strategy_switches(source: str) -> None:
    assert strategy_switches(source, {"UlyssesAttention", "RingAttention"}), source


@pytest.mark.parametrize("source", [
    "if plan.seq_degree > 1 and mesh.all_to_all == 'copy-engine':\n    pass",
    "size = plan.ring\nshards = [s for s in range(plan.ulysses)]\nfirst = groups[plan.ring - 1]",
    "if len(mesh.sequence_axes()) == 1:\n    pass",
    "if mesh.ring_rank == 0 and plan.tp > 1:\n    pass",
    '"""Ulysses, ring or allgather: docstrings name strategies freely."""',
])
def test_the_detector_lets_other_decisions_be(source: str) -> None:
    assert not strategy_switches(source, {"UlyssesAttention", "RingAttention"}), source


def test_split_attention_builds_the_plans_strategy() -> None:
    from engines.parallel import attention
    from engines.parallel.mesh import ParallelMesh
    from engines.parallel.plan import ParallelPlan

    def mesh(plan: ParallelPlan) -> ParallelMesh:  # no process groups: choosing a strategy needs none
        return ParallelMesh(plan=plan, device_mesh=None, ulysses_group=None, ring_group=None, cfg_group=None,
                            ulysses_rank=0, ring_rank=0, cfg_rank=0)

    expected = [
        (ParallelPlan(ulysses=2), attention.UlyssesAttention),
        (ParallelPlan(ulysses=2, cfg=2), attention.UlyssesAttention),
        (ParallelPlan(strategy="ring", ring=2), attention.RingAttention),
        (ParallelPlan(strategy="allgather", ring=2), attention.GatherAttention),
        (ParallelPlan(strategy="ulysses-ring", ulysses=2, ring=2), attention.HybridAttention),
    ]
    for plan, kind in expected:
        assert type(attention.split_attention(mesh(plan))) is kind, plan
    with pytest.raises(ValueError, match="splits no sequence"):
        attention.split_attention(mesh(ParallelPlan(cfg=2)))
