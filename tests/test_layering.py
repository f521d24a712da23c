"""The package's imports run one way and close no cycle (docs/architecture.md).

Every import statement of every module is read with `ast`, including imports inside functions
and under `if TYPE_CHECKING:` (a cycle hidden in a function is still a cycle), and so are
`importlib.import_module("...")` and `__import__("...")` calls with a literal name. The layers,
from the bottom up:

    base         offload_engine.errors, offload_engine.fsutil   (used by every layer)
    formats      offload_engine.formats.*                      (config, checkpoints, GGUF, tokenizers)
    runtime      offload_engine.runtime.*                      (model math, KV cache, store, streamer)
    speculation  offload_engine.speculation.*                  (decoder, drafts, acceptance)
    planning     offload_engine.planning.*                     (profiles, profiler, auto tree, simulator)
    engine       offload_engine.engine, offload_engine (the package's __init__)
    apps         offload_engine.apps.*, offload_engine.__main__ (CLI, server, distillation)

A module may import its own layer or any layer below it, never one above. `sequoia_trees` is
pure: it imports nothing of `offload_engine` (nor `hw_profiles` or `benchmarks`). `benchmarks`
sits beside the applications: only `apps` may import it.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "offload_engine"
LAYERS = ("base", "formats", "runtime", "speculation", "planning", "engine", "apps")
FOLDER_LAYERS = ("formats", "runtime", "speculation", "planning", "apps")
TOP_LAYERS = {"errors": "base", "fsutil": "base", "engine": "engine", "__init__": "engine", "__main__": "apps"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> str:
    """The layer of a module of the package; a module that fits no layer fails the test."""
    parts = module.split(".")
    assert parts[0] == PACKAGE, module
    if len(parts) == 1:
        return TOP_LAYERS["__init__"]
    if parts[1] in FOLDER_LAYERS:
        return parts[1]
    if len(parts) == 2 and parts[1] in TOP_LAYERS:
        return TOP_LAYERS[parts[1]]
    raise AssertionError(f"{module} is in no layer: put it in a folder of {FOLDER_LAYERS} or name it in TOP_LAYERS")


def imports_of(path: Path, module: str, is_package: bool) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every import in the file, relative
    imports resolved; names is [] for a plain `import x`."""
    return [(target, list(names), line) for target, names, line in
            _imports_in(path.read_text(encoding="utf-8"), module, is_package)]


@functools.lru_cache(maxsize=None)
def _imports_in(source: str, module: str, is_package: bool) -> tuple[tuple[str, tuple[str, ...], int], ...]:
    """imports_of's reading of a file's text, kept by its text and module: the negative controls
    check whole copies of the tree, in which every file but the one sabotaged has the text an
    earlier check read (each of the 19 checks parsed all ~100 files again, 0.5 s a check)."""
    tree = ast.parse(source, module)
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and _called_name(node.func) in ("import_module", "__import__")
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.args[0].value, (), node.lineno))  # importlib.import_module("x.y"), __import__("x.y")
        elif isinstance(node, ast.Import):
            found += [(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, tuple(alias.name for alias in node.names), node.lineno))
    return tuple(found)


def _called_name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, list[tuple[str, int]]]:
    """module -> [(module of those packages it imports, line)], for every .py file under them."""
    modules = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            modules[module_name(path, root)] = path

    def known(target: str) -> str:
        """The longest known module an import names (`a.b.c` may be the attribute c of a.b)."""
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    graph = {}
    for name, path in modules.items():
        edges = []
        for target, names, line in imports_of(path, name, path.name == "__init__.py"):
            # `from pkg import mod` imports the module pkg.mod; `from pkg import thing`, pkg itself
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            targets = submodules + ([known(target)] if len(submodules) < len(names) or not names else [])
            edges += [(t, line) for t in targets if t and t != name]
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target, _ in graph.get(node, []):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def upward_imports(graph: dict[str, list[tuple[str, int]]], root: Path) -> list[str]:
    """Every import of the package that runs up the layers, or from outside where it may not."""
    bad = []
    for module, edges in graph.items():
        top = module.split(".")[0]
        for target, line in edges:
            where = f"{module} (line {line}) imports {target}"
            target_top = target.split(".")[0]
            if top == "sequoia_trees" and target_top != "sequoia_trees":
                bad.append(f"{where}: sequoia_trees must stay pure")
            elif top == PACKAGE and target_top == "benchmarks" and layer_of(module) != "apps":
                bad.append(f"{where}: only the applications may import benchmarks")
            elif top == PACKAGE and target_top == PACKAGE:
                if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(module)):
                    bad.append(f"{where}: {layer_of(module)} may not import {layer_of(target)}")
    return bad


def check(root: Path) -> list[str]:
    graph = import_graph(root, (PACKAGE, "sequoia_trees", "benchmarks", "hw_profiles"))
    problems = upward_imports(graph, root)
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    return problems


def test_imports_run_one_way_without_cycles():
    problems = check(ROOT)
    assert problems == [], f"layers, bottom up: {' < '.join(LAYERS)}\n" + "\n".join(problems)


def test_every_module_is_in_a_layer():
    for path in (ROOT / PACKAGE).rglob("*.py"):
        layer_of(module_name(path, ROOT))  # raises for a module outside the layers


def _copy_tree(tmp_path: Path) -> Path:
    for pkg in (PACKAGE, "sequoia_trees", "benchmarks", "hw_profiles"):
        for path in (ROOT / pkg).rglob("*.py"):
            dest = tmp_path / path.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text(encoding="utf-8") + f"\n\ndef _sabotage():\n    {line}\n", encoding="utf-8")


@pytest.mark.parametrize("file, line, expected", [
    # an upward import hidden in a function (measure -> engine was a real cycle once)
    ("offload_engine/speculation/measure.py", "from ..engine import Engine", "speculation may not import engine"),
    ("offload_engine/formats/config.py", "from ..runtime import model", "formats may not import runtime"),
    ("offload_engine/runtime/model.py", "from offload_engine.apps import cli", "runtime may not import apps"),
    ("offload_engine/planning/profiler.py", "import benchmarks.latency", "only the applications may import benchmarks"),
    ("sequoia_trees/dp.py", "from offload_engine import errors", "sequoia_trees must stay pure"),
    ("sequoia_trees/tree.py", "import hw_profiles", "sequoia_trees must stay pure"),
    # imports by name at run time
    ("offload_engine/formats/config.py", "importlib.import_module('offload_engine.engine')", "formats may not import engine"),
    ("offload_engine/runtime/kv_cache.py", "__import__('offload_engine.apps.server')", "runtime may not import apps"),
    # a cycle inside one layer (drafts <-> acceptance_store was a real one)
    ("offload_engine/speculation/drafts.py", "from .acceptance_store import draft_key", "import cycle: "),
])
def test_the_check_catches_sabotage(tmp_path, file, line, expected):
    """Negative controls: each breakage, made in a copy of the tree, is reported."""
    root = _copy_tree(tmp_path)
    assert check(root) == []
    _append(root / file, line)
    problems = check(root)
    assert any(expected in p for p in problems), problems
