"""The tree's layering, checked on its sources: the product never imports the benchmark harness, and a
model family is one record (no code outside a family's own modules branches on its name).

Layers: engines <- pipelines <- app <- benchmarks. benchmarks imports the app (its lockstep service,
its runtime); `ulysses-studio bench` reaches the harness by running `python -m benchmarks`, never by
importing it. A family's data and code are its folder's (pipelines/<family>/: its record names its code as
"module:attribute" references); code elsewhere reads the record instead of asking which family it has.

No import circles: no module imports itself back, whether through imports run when a module is imported or through
one inside a function (there to defer a heavy import, never to hide a circle). What two modules both need lives in
a module both import (engines.levers.fp8_matmul, engines.levers.compile_teardown, pipelines.media_suffixes,
training.lora_folder).
"""

from __future__ import annotations

import ast
import functools
import subprocess
from collections.abc import Iterable
from pathlib import Path

from tests.helpers import PYTHON, REPO

PRODUCT = ("app", "pipelines", "engines")
"""Packages that must not import benchmarks."""
SCANNED = ("app", "pipelines", "engines", "benchmarks", "training")
"""Packages whose code must not branch on a family's name, nor import in a circle."""


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
    modules = sorted(".".join(path.relative_to(REPO).with_suffix("").parts) for path in (REPO / "app").rglob("*.py")
                     if path.stem not in ("__init__", "__main__"))  # __main__ runs the command line
    assert "app.commands.cli" in modules and "app.server.serve" in modules
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
    """A family is one folder (pipelines/<family>/, holding its record.py): its modules may speak of it; every other
    module reads the records. Every code reference of a record points into its own folder, or into the shared
    engines (the generic path). training/__main__.py is exempt: its --only flux|cosmos picks one of the two embedded
    models it trains (its own recipes, training/flux.py and training/cosmos.py), not a family's behaviour."""
    from pipelines.registry import FAMILIES

    own = {REPO / "pipelines" / "families.py", REPO / "training" / "__main__.py"}
    for family in FAMILIES.values():
        references = (family.pipeline, family.parallelize, family.tensor_parallel,
                      family.transformer_setup, family.limits, family.bench.inputs, family.bench.tiny_config,
                      family.bench.tiny_checkpoint)
        for module in {r.partition(":")[0] for r in references if r}:
            folder = REPO / Path(*module.split(".")).parent
            if module.startswith("engines."):
                continue  # the shared machinery a record chooses (engines.parallel.generic's adapters and weight split)
            assert (folder / "record.py").exists(), f"{family.name}: {module} is outside a family's folder"
            own.update(folder.glob("*.py"))
    found = [f"{path.relative_to(REPO)} {branch}" for path in _sources(*SCANNED) if path not in own
             for branch in family_branches(path.read_text(), set(FAMILIES))]
    assert not found, found


Import = tuple[str, int, str]
"""One project import: (the module imported, its line, where it runs: "module", "function" or "type-checking")."""


def _module_name(relative: str) -> str:
    parts = Path(relative).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(tree: ast.Module, module: str, package: str, names: set[str]) -> list[Import]:
    """The imports of the modules `names` that `module` (of `package`) makes: project_imports' list for one module."""

    def resolve(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    imports: list[Import] = []

    def visit(nodes: Iterable[ast.AST], where: str) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and where == "module" and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.body, "type-checking")
                visit(node.orelse, where)
                continue
            inner = "function" if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else where
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from ..y import z: counted from this module's package
                    parts = package.split(".")
                    base = ".".join([*parts[:len(parts) - node.level + 1], *([base] if base else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names]
            for target in targets:
                resolved = resolve(target)
                if resolved is not None and resolved != module:
                    imports.append((resolved, node.lineno, where))
            visit(ast.iter_child_nodes(node), inner)

    visit(tree.body, "module")
    return imports


def project_imports(sources: dict[str, str]) -> dict[str, list[Import]]:
    """Each module of `sources` (its path relative to the repository -> its text) -> the imports of other modules of
    `sources` it makes: `import a.b`, `from a.b import c` (a.b.c where that is a module), relative ones. "module":
    run when the module is imported (at its top level, in a class body, under a plain `if` or `try`); "function":
    inside a function or lambda, run when it is called; "type-checking": under `if TYPE_CHECKING:`, never run."""
    names = {_module_name(relative): relative for relative in sources}
    return {module: _imports_of(ast.parse(sources[relative], relative), module,
                                module if Path(relative).name == "__init__.py" else module.rpartition(".")[0],
                                set(names))
            for module, relative in names.items()}


def import_cycles(imports: dict[str, list[Import]], where: tuple[str, ...]) -> list[str]:
    """Every set of modules that import each other in a circle through the imports run at `where` (Tarjan's strongly
    connected components), as the shortest circle through each of their modules, each circle once, written from its
    first module in sorted order: `a -> b (a.py line 3) -> a (b.py line 9, in a function)`."""
    graph = {module: sorted({target for target, _, at in found if at in where}) for module, found in imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components = []

    def connect(module: str) -> None:  # recursion as deep as the longest import chain: a few dozen modules
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                connect(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            connect(module)
    circles = set()
    for component in components:
        members = set(component)
        for start in component:  # the shortest circle through each module (breadth first), each circle once
            paths, queue, circle = {start: [start]}, [start], None
            while queue and circle is None:
                module = queue.pop(0)
                for target in graph[module]:
                    if target == start:
                        circle = paths[module]
                        break
                    if target in members and target not in paths:
                        paths[target] = paths[module] + [target]
                        queue.append(target)
            first = circle.index(min(circle))
            circles.add(tuple(circle[first:] + circle[:first]))
    written = []
    for circle in sorted(circles):
        steps = [circle[0]]
        for importer, imported in zip(circle, circle[1:] + circle[:1]):
            line, at = next((line, at) for target, line, at in imports[importer] if target == imported and at in where)
            steps.append(f"{imported} ({importer.replace('.', '/')}.py line {line}"
                         f"{'' if at == 'module' else ', ' + ('in a function' if at == 'function' else at)})")
        written.append(" -> ".join(steps))
    return written


@functools.cache
def _project_imports() -> dict[str, list[Import]]:
    return project_imports({str(path.relative_to(REPO)): path.read_text() for path in _sources(*SCANNED)})


def test_the_import_scan_finds_the_circles_it_is_meant_to() -> None:
    sources = {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import thing\n",
               "pkg/b.py": "import pkg.c\n", "pkg/c.py": "def f():\n    from . import a\n",
               "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
               "pkg/e.py": "class E:\n    from pkg.d import x\n", "pkg/f.py": "import os\nfrom pkg import a\n",
               "pkg/g.py": "from pkg.h import y\n",
               "pkg/h.py": "try:\n    from .g import x\nexcept ImportError:\n    x = 0\n"}
    imports = project_imports(sources)
    assert imports["pkg.c"] == [("pkg.a", 2, "function")]
    assert imports["pkg.d"] == [("pkg.e", 3, "type-checking")] and imports["pkg.e"] == [("pkg.d", 2, "module")]
    assert imports["pkg.f"] == [("pkg.a", 2, "module")]
    module_level = "pkg.g -> pkg.h (pkg/g.py line 1) -> pkg.g (pkg/h.py line 2)"
    assert import_cycles(imports, ("module",)) == [module_level]
    assert import_cycles(imports, ("module", "function", "type-checking")) == [
        "pkg.a -> pkg.b (pkg/a.py line 1) -> pkg.c (pkg/b.py line 1) -> pkg.a (pkg/c.py line 2, in a function)",
        "pkg.d -> pkg.e (pkg/d.py line 3, type-checking) -> pkg.d (pkg/e.py line 2)", module_level]


def test_no_import_cycle_at_module_level() -> None:
    """No module of app/, pipelines/, engines/, benchmarks/ or training/ imports itself back through the imports
    its import runs: a circle would make the order in which modules are first imported decide whether they load."""
    cycles = import_cycles(_project_imports(), ("module",))
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_no_import_cycle_closed_by_a_deferred_import() -> None:
    """Nor through an import inside a function (or under TYPE_CHECKING): such an import may defer a heavy module
    (torch, PIL, diffusers) to when it is needed, but a circle it closes is still a circle, only hidden. The piece
    both sides need belongs in a module of its own that both import."""
    cycles = import_cycles(_project_imports(), ("module", "function", "type-checking"))
    assert not cycles, "import circles closed inside a function or under TYPE_CHECKING:\n" + "\n".join(cycles)


def test_the_commands_that_generate_import_no_web_server_package() -> None:
    """generate, batch, build and launch (and the ranks they start) run where no web server package is installed
    (a GPU host with the pipelines' packages alone): importing them, and the CLI that registers serve's options,
    imports neither Gradio nor starlette, fastapi or uvicorn."""
    modules = ["app.commands.cli", "app.commands.generate", "app.commands.batch", "app.commands.build",
               "app.commands.launch", "app.ranks.runtime", "app.ranks.lockstep", "app.ranks.groups"]
    script = ("import importlib, sys\n"
              f"for name in {modules!r}:\n"
              "    importlib.import_module(name)\n"
              "print(sorted(m for m in sys.modules if m.split('.')[0] in "
              "('gradio', 'gradio_client', 'starlette', 'fastapi', 'uvicorn')))\n")
    proc = subprocess.run([PYTHON, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
