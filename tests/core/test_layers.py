"""The layering rule of docs/architecture.md, checked on the source: imports point down, never up, never in a circle.

Layers, bottom to top (a module may import from its own unit and the layers below):

    0 core         functrain/core/        the state, the stage pipeline, the transform protocol, grad, rng, checks
    1 compiler     functrain/compiler/    ft.compile: capture, backend, runtime, memory, caches
    2 transforms   functrain/transforms/, optim  functrain/optim/, distributed  functrain/distributed/,
                   driver  functrain/driver.py (ft.run)
    3 data         functrain/data/,       checkpoint  functrain/checkpoint/,
                   testing  functrain/testing/ (its data-parallel checker launches ranks: above distributed)
    4 trainer      functrain/trainer/

Units of one layer do not import each other (transforms, optim and distributed are independent, and so are
data and checkpoint). ``functrain/__init__.py`` (the public names) and ``functrain/launch.py`` (the
``python -m`` entry point) sit above everything and may import anything. Any other module directly in
``functrain/`` is refused: it belongs in a layer.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "functrain"
TOP = {"functrain", "functrain.launch"}  # facades above every layer
LEVELS = {"core": 0, "compiler": 1, "transforms": 2, "optim": 2, "distributed": 2, "driver": 2, "testing": 3,
          "data": 3, "checkpoint": 3, "bench": 3, "trainer": 4}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit(module: str) -> str:
    """The layer unit of a module: its package (or top-level module) under functrain."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def level(module: str) -> int:
    return LEVELS[unit(module)]


def imports(path: pathlib.Path, module: str) -> list[tuple[str, int, bool]]:
    """``(imported functrain module, line, at module level)`` for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    found = []
    top_level = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" for a in node.names]  # resolves to prefix when a.name is no module
        else:
            continue
        for name in names:
            if name == "functrain" or name.startswith("functrain."):
                found.append((name, node.lineno, id(node) in top_level))
    return found


def resolve(name: str, modules: set[str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def graph() -> tuple[dict[str, list[tuple[str, int, bool]]], dict[str, pathlib.Path]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges: dict[str, list[tuple[str, int, bool]]] = {}
    for mod, path in files.items():
        targets = []
        for name, line, top in imports(path, mod):
            target = resolve(name, set(files))
            if target is not None and target != mod:
                targets.append((target, line, top))
        edges[mod] = targets
    return edges, files


def test_every_module_is_in_a_layer():
    _, files = graph()
    stray = sorted(str(files[m].relative_to(ROOT.parent)) for m in files if m not in TOP and unit(m) not in LEVELS)
    assert not stray, f"modules outside every layer (move them into one of {sorted(LEVELS)}): {stray}"


def test_no_upward_or_sideways_import():
    edges, files = graph()
    bad = []
    for mod, targets in edges.items():
        if mod in TOP or unit(mod) not in LEVELS:
            continue
        for target, line, _ in targets:
            if target in TOP or unit(target) not in LEVELS:
                bad.append(f"{files[mod].relative_to(ROOT.parent)}:{line} imports the facade {target}")
            elif level(target) > level(mod):
                bad.append(f"{files[mod].relative_to(ROOT.parent)}:{line} ({unit(mod)}, layer {level(mod)}) imports "
                           f"{target} ({unit(target)}, layer {level(target)}): an upward import")
            elif level(target) == level(mod) and unit(target) != unit(mod):
                bad.append(f"{files[mod].relative_to(ROOT.parent)}:{line} imports {target}: packages of one layer "
                           f"({unit(mod)}, {unit(target)}) must not depend on each other")
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_no_import_cycle():
    edges, files = graph()
    # every import counts, also the ones inside functions: a lazy import that closes a cycle still
    # means two modules that cannot be understood apart (a package's __init__ re-exporting its own
    # modules is not a dependency of those modules on it)
    deps = {m: {t for t, _, _ in ts if not (m.startswith(t + ".") and files[t].name == "__init__.py")}
            for m, ts in edges.items() if m not in TOP}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(deps.get(m, ())):
            if t in TOP:
                continue
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                cycle = visit(t)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(deps):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("source, expected", [
    ("from ..trainer import Trainer", "upward"),
    ("from ..data import shard", "must not depend on each other"),
    ("from ..compiler import compile", None),
])
def test_the_checker_catches_violations(tmp_path, source, expected, monkeypatch):
    """The rule above is not vacuous: a planted upward or sideways import is reported."""
    fake = tmp_path / "functrain"
    (fake / "checkpoint").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "checkpoint" / "__init__.py").write_text("")
    (fake / "checkpoint" / "bad.py").write_text(source + "\n")
    (fake / "trainer").mkdir()
    (fake / "trainer" / "__init__.py").write_text("Trainer = 1\n")
    (fake / "data").mkdir()
    (fake / "data" / "__init__.py").write_text("shard = 1\n")
    (fake / "compiler").mkdir()
    (fake / "compiler" / "__init__.py").write_text("compile = 1\n")
    monkeypatch.setitem(globals(), "ROOT", fake)
    if expected is None:  # a downward import (checkpoint -> compiler) is allowed
        test_no_upward_or_sideways_import()
        return
    with pytest.raises(AssertionError, match=expected):
        test_no_upward_or_sideways_import()


def test_the_checker_catches_a_stray_module(tmp_path, monkeypatch):
    """A new module dropped directly into functrain/ belongs to no layer and is reported."""
    fake = tmp_path / "functrain"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "helpers.py").write_text("X = 1\n")
    monkeypatch.setitem(globals(), "ROOT", fake)
    with pytest.raises(AssertionError, match="helpers.py"):
        test_every_module_is_in_a_layer()
