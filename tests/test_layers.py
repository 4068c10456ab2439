"""The package's folders are its layers: every import (function-level ones included) points to the same layer or
one below, and no modules import each other in a circle. Read from the source with ast, so nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "specbench"

# Bottom to top: a module may import from its own layer and the layers below it. Each entry is a top-level module
# or folder of specbench/ ("" is the package's own __init__). docs/architecture.md says what each one is.
LAYERS = [
    {"", "errors", "progress"},
    {"presets"},
    {"tasks"},
    {"core", "tree"},
    {"models"},
    {"interference"},
    {"machine"},
    {"results"},
    {"config"},
    {"registry"},
    {"zoo"},
    {"heads"},
    {"methods"},
    {"engines"},
    {"run"},
    {"report"},
    {"tune"},
    {"cli"},
]
MOST_TOP_LEVEL_MODULES = 12


def module_name(path: Path) -> str:
    parts = ["specbench", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if "tiny" not in p.relative_to(PACKAGE).parts}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source not in known:
                continue
            for alias in node.names:  # `from pkg import module` imports the module itself
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    return found - {name}


def room(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


def layer(name: str) -> int:
    for i, rooms in enumerate(LAYERS):
        if room(name) in rooms:
            return i
    raise AssertionError(f"{name}: its folder or module '{room(name)}' has no layer; add it to LAYERS")


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if layer(b) > layer(a))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_import_points_to_its_layer_or_below():
    assert upward(graph()) == []


def test_no_import_circle():
    assert circles(graph()) == []


def test_top_level_modules_are_few():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MOST_TOP_LEVEL_MODULES, top


def test_the_checks_catch_a_planted_upward_import_and_circle():
    edges = {"specbench.core.decode": {"specbench.run.runner"}, "specbench.run.runner": {"specbench.core.decode"}}
    assert upward(edges) == ["specbench.core.decode -> specbench.run.runner"]
    assert circles(edges) == [["specbench.core.decode", "specbench.run.runner"]]
    with pytest.raises(AssertionError, match="no layer"):
        layer("specbench.attic.old")


def test_a_function_level_import_counts(tmp_path):
    path = tmp_path / "plan.py"
    path.write_text("def f():\n    from ..engines import vllm\n    from . import worker\n")
    known = {
        "specbench.run",
        "specbench.run.plan",
        "specbench.run.worker",
        "specbench.engines",
        "specbench.engines.vllm",
    }
    assert imports("specbench.run.plan", path, known) == {"specbench.engines.vllm", "specbench.run.worker"}
