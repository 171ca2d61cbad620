"""The tree's layering, checked on its sources: the product never imports the benchmark harness, and a
model family is one record (no code outside a family's own modules branches on its name).

Layers: engines <- pipelines <- app <- benchmarks. benchmarks imports the app (its lockstep service,
its runtime); `ulysses-studio bench` reaches the harness by running `python -m benchmarks`, never by
importing it. Per-family data and code are the record's (pipelines.families), named as
"module:attribute" references; code elsewhere reads the record instead of asking which family it has.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from tests.helpers import PYTHON, REPO

PRODUCT = ("app", "pipelines", "engines")
"""Packages that must not import benchmarks."""
SCANNED = ("app", "pipelines", "engines", "benchmarks", "training")
"""Packages whose code must not branch on a family's name."""


def _sources(*packages: str) -> list[Path]:
    return sorted(path for package in packages for path in (REPO / package).rglob("*.py"))


def _imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _is_benchmarks(module: str) -> bool:
    return module == "benchmarks" or module.startswith("benchmarks.")


def test_no_product_source_imports_benchmarks() -> None:
    """No `import benchmarks...` / `from benchmarks... import` in app/, pipelines/ or engines/, at any depth
    (a function-level import counts: it is the same dependency, only later)."""
    found = [f"{path.relative_to(REPO)}: {module}" for path in _sources(*PRODUCT)
             for module in _imported_modules(ast.parse(path.read_text(), str(path))) if _is_benchmarks(module)]
    assert not found, found


def test_no_family_record_names_benchmarks_code() -> None:
    """A record's references are product code the app loads (its input builder included)."""
    from pipelines.registry import FAMILIES

    for family in FAMILIES.values():
        references = (family.transformer, family.pipeline, family.parallelize, family.tensor_parallel, family.limits,
                      family.transformer_setup, family.bench.inputs, family.bench.tiny_config,
                      family.bench.tiny_checkpoint)
        assert not [r for r in references if _is_benchmarks(r.partition(":")[0])], family.name


def test_importing_every_app_module_imports_no_benchmarks_module() -> None:
    """Every module of app/ imported in one fresh process; then no benchmarks module is in sys.modules."""
    modules = sorted(f"app.{path.stem}" for path in (REPO / "app").glob("*.py")
                     if path.stem not in ("__init__", "__main__"))  # __main__ runs the command line
    assert "app.cli" in modules and "app.serve" in modules
    script = ("import importlib, sys\n"
              f"for name in {modules!r}:\n"
              "    importlib.import_module(name)\n"
              "print(sorted(m for m in sys.modules if m == 'benchmarks' or m.startswith('benchmarks.')))\n")
    proc = subprocess.run([PYTHON, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def _family_names() -> set[str]:
    from pipelines.registry import FAMILIES

    return set(FAMILIES)


def _strings(node: ast.AST) -> list[str]:
    """The string constants `node` is, or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def family_branches(source: str, families: set[str]) -> list[str]:
    """Comparisons in `source` that ask which family something is: an operand that reads a family
    (`spec.family`, `family.name`, a variable `family`) against string constants, or any operand against
    a registered family's name (`name == "cosmos3"`, `x in ("flux", "flux2")`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        constants = [s for operand in operands for s in _strings(operand)]
        reads_family = any("family" in ast.unparse(operand).lower() and not _strings(operand) for operand in operands)
        if (reads_family and constants) or families.intersection(constants):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_the_branches_it_is_meant_to() -> None:
    families = {"flux", "cosmos3"}
    for branch in ('if spec.family == "cosmos3":\n    pass', 'ok = family in ("flux", "toy")',
                   'x = self._family.name != "anything"', 'y = "flux" == kind', 'z = name in {"cosmos3"}'):
        assert family_branches(branch, families), branch
    for fine in ('key = ("flux", prompt)', 'if spec.family != self.name:\n    pass', 'a = family.name == other.name',
                 'b = mode == "fluxion"'):
        assert not family_branches(fine, families), fine


def test_no_code_outside_a_familys_own_modules_branches_on_its_name() -> None:
    """pipelines/families.py holds the records; the modules a record names (its pipeline, engines adapter,
    input builder, ...) are that family's own and may speak of it. Everywhere else reads the record.
    training/__main__.py is exempt: its --only flux|cosmos picks one of the two embedded models it trains
    (its own recipes, training/flux.py and training/cosmos.py), not a family's behaviour."""
    from pipelines.registry import FAMILIES

    own = {REPO / "pipelines" / "families.py", REPO / "training" / "__main__.py"}
    shared = {"pipelines.requests", "pipelines.transformer_inputs", "training.tiny_models"}  # several families' code
    for family in FAMILIES.values():
        references = (family.pipeline, family.parallelize, family.tensor_parallel, family.transformer_setup)
        for module in {r.partition(":")[0] for r in references if r} - shared:
            if module.split(".")[0] in SCANNED:
                own.add(REPO / Path(*module.split(".")).with_suffix(".py"))
    found = [f"{path.relative_to(REPO)} {branch}" for path in _sources(*SCANNED) if path not in own
             for branch in family_branches(path.read_text(), set(FAMILIES))]
    assert not found, found
