"""The code's shape, checked: imports flow one way (launch -> pretrain -> models -> parallel, data beside;
inside pretrain config -> checkpoint / observability -> interop / training -> startup), no import cycle,
no module over 400 lines, a docstring naming each package's concern, and the entry points that moved
still answer under their old names."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pretrain", "parallel", "models", "data", "launch")
# what each top-level package may import besides itself
LAYERS = {"launch": {"pretrain", "models", "parallel", "data"}, "pretrain": {"models", "parallel", "data"},
          "models": {"parallel"}, "parallel": set(), "data": set()}
# inside pretrain: what each sub-package may import besides itself (pretrain's own entry points: anything)
PRETRAIN = {"config": set(), "checkpoint": {"config"}, "observability": {"config"},
            "interop": {"config", "checkpoint"}, "training": {"config", "checkpoint", "observability"},
            "startup": {"config", "checkpoint", "training"}}


def _module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(path): path for top in PACKAGES for path in (ROOT / top).rglob("*.py")}


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Each module's imports of the project's modules (``from a import b`` counts as a.b where that is
    a module, else as a), at any depth of the file: a function-level import is an import too."""
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                dotted = (f"{node.module}.{alias.name}" for alias in node.names)
                found |= {name if name in modules else node.module for name in dotted}
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def _package_of(module: str) -> str:
    return module.split(".")[0]


def test_imports_never_go_up_a_layer():
    graph = _imports(_modules())
    upward = sorted(f"{source} imports {target}" for source, targets in graph.items() for target in targets
                    if _package_of(target) != _package_of(source)
                    and _package_of(target) not in LAYERS[_package_of(source)])
    assert not upward, upward


def test_pretrain_sub_packages_import_in_one_direction():
    graph = _imports(_modules())
    wrong = []
    for source, targets in graph.items():
        parts = source.split(".")
        if parts[0] != "pretrain" or len(parts) < 3:  # pretrain's own entry points may use every part
            continue
        for target in targets:
            inside = target.split(".")
            if inside[0] == "pretrain" and len(inside) > 1 and inside[1] != parts[1] \
                    and inside[1] not in PRETRAIN[parts[1]]:
                wrong.append(f"{source} imports {target}")
    assert not wrong, wrong


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a module importing its own package's ``__init__`` counts), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    graph = _imports(_modules())
    # a package's __init__ that re-exports its submodules is imported through, not a cycle, when those
    # submodules import each other and never the package itself: drop package -> own submodule edges
    acyclic = {source: {t for t in targets if not t.startswith(source + ".")}
               for source, targets in graph.items()}
    assert _cycle(acyclic) is None, " -> ".join(_cycle(acyclic))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_over_400_lines():
    paths = [*_modules().values(), *(ROOT / "tests").rglob("*.py")]
    long = sorted(f"{path.relative_to(ROOT)}: {lines}" for path in paths
                  if (lines := len(path.read_text().splitlines())) > 400)
    assert not long, long


def test_every_package_names_its_concern():
    inits = [path for top in (*PACKAGES, "tests") for path in (ROOT / top).rglob("__init__.py")]
    missing = sorted(str(path.relative_to(ROOT)) for path in inits
                     if not ast.get_docstring(ast.parse(path.read_text())))
    assert not missing, missing


@pytest.mark.parametrize("module", ["pretrain", "pretrain.convert", "launch.plan", "launch.torchrun"])
def test_entry_points_keep_their_names(module):
    run = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout
