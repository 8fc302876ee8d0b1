"""The protocol closed in fact, checked on the source: functrain reads a transform, an optimizer or a step
only through names their protocol classes declare.

Two rules, over every module of functrain (ast, not text):

1. No ``getattr(x, "name", ...)`` / ``hasattr(x, "name")`` with a literal ``name`` that the protocol
   classes do not declare (:class:`Transform`, :class:`StepContext`, :class:`InitContext`,
   :class:`Step`, :class:`CompiledStep`, :class:`Optimizer`, :class:`TrainState`: their attributes,
   annotations, fields and the ``self.x`` they set themselves) when ``x`` is a transform, an optimizer
   or a step: either the name is one that functrain's own transform classes carry (``self.n`` on
   accumulate, ``self.shard`` on the sharded data_parallel; checked in the modules that import the
   protocol), or the receiver is named as one (``t``, ``transform``, ``step``, ``optimizer``,
   ``present``, ``x.optimizer``, ...). And no name at all read off a protocol's function
   (``optimizer.learning_rate``, ``update``, ``init``, ``loss_fn``), which declares none.
2. No attribute stashed on a function object (``learning_rate.schedule = lr``) to be read back
   elsewhere, except the few listed in ``STASHES`` with the reason each is not a protocol leak.

Each rule is shown to catch a planted violation.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

import functrain as ft

ROOT = pathlib.Path(ft.__file__).parent

# Function attributes that are not a protocol read-back, each with why (path relative to functrain/).
STASHES = {
    ("optim/schedules.py", "total_steps"): "the documented schedule protocol: a schedule callable may carry its "
                                           "horizon (schedules.horizon); users' schedules set it too",
    ("core/module.py", "module"): "functionalize's apply_fn.module: a convenience for the user, never read by "
                                  "functrain",
    ("compiler/package.py", "loader"): "keeps the AOTInductor library alive as long as the call; never read",
    ("compiler/probe_memo.py", "_functrain_memo"): "marks torch's own patched function (a monkeypatch guard), not a "
                                              "functrain object",
}

PROTOCOL_RECEIVER = re.compile(r"^(t|tr|transform|transforms?\[.*\]|step|base|present|compiled|cstep|optimizer|opt|"
                               r".*\.(step|optimizer|transforms\[.*\]))$")
# A protocol's functions (an optimizer's learning_rate / update / init, a step's loss_fn) declare no attributes:
# any name read off one is a value stashed on it.
PROTOCOL_FUNCTION = re.compile(r"^(.*\.)?(learning_rate|update|init|loss_fn)$")


def _class_names(cls: type) -> set[str]:
    """What ``cls`` declares: its attributes (inherited too), annotations, and the ``self.x`` it sets."""
    import inspect
    import textwrap

    names = set(dir(cls))
    for klass in cls.__mro__:
        names |= set(vars(klass).get("__annotations__", {}))
        names |= set(vars(klass).get("_fields", ()))
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return names


def declared() -> set[str]:
    from functrain.compiler import CompiledStep
    from functrain.core.state import TrainState
    from functrain.core.step import Step
    from functrain.core.transform import InitContext, StepContext, Transform
    from functrain.optim import Optimizer

    out: set[str] = set()
    for cls in (Transform, StepContext, InitContext, Step, CompiledStep, Optimizer, TrainState):
        out |= _class_names(cls)
    return out


def _transform_classes(trees: dict[str, ast.Module]) -> list[ast.ClassDef]:
    """functrain's own Transform subclasses (by their bases, transitively, across modules)."""
    classes = [n for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)]
    known = {"Transform"}
    changed = True
    while changed:
        changed = False
        for c in classes:
            bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", None) for b in c.bases}
            if c.name not in known and bases & known:
                known.add(c.name)
                changed = True
    return [c for c in classes if c.name in known and c.name != "Transform"]


def carried(trees: dict[str, ast.Module]) -> set[str]:
    """Names functrain's transforms carry beyond the protocol: class-body names and ``self.x`` they set."""
    names: set[str] = set()
    for c in _transform_classes(trees):
        for node in ast.walk(c):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
        for stmt in c.body:
            for t in (stmt.targets if isinstance(stmt, ast.Assign) else
                      [stmt.target] if isinstance(stmt, ast.AnnAssign) else []):
                if isinstance(t, ast.Name):
                    names.add(t.id)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(stmt.name)
    return names


def _functions_in_scope(body: list) -> set[str]:
    names = set()
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(stmt.name)
        elif isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Lambda):
            names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
    return names


PROTOCOL_MODULES = re.compile(r"(^|\.)(core\.step|core\.transform|step|transform|optim(\.\w+)?|compiler(\.\w+)?|"
                              r"base|api)$")


def handles_protocol(tree: ast.Module) -> bool:
    """Whether a module works with transforms, optimizers or steps: it imports their protocol (the core's
    step/transform modules, optim, the compiler) or is part of it. Elsewhere (data loading, trackers) a
    name such as ``shard`` belongs to other objects (a dataset's ``shard`` method)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and PROTOCOL_MODULES.search(node.module or ""):
            return True
        if isinstance(node, ast.ClassDef) and {getattr(b, "id", getattr(b, "attr", None)) for b in node.bases} & {
                "Transform", "NamedTuple"} and node.name in ("Transform", "Optimizer"):
            return True
    return False


def scan(sources: dict[str, str]) -> list[str]:
    """Every violation of the two rules in ``sources`` ({path relative to functrain/: source})."""
    trees = {path: ast.parse(src, path) for path, src in sources.items()}
    ok, extra = declared(), carried(trees)
    found = []
    for path, tree in sorted(trees.items()):
        protocol = handles_protocol(tree) or path.startswith(("transforms/", "optim/", "core/transform", "core/step"))
        for node in ast.walk(tree):
            # rule 1: getattr / hasattr of an undeclared literal name on a transform, optimizer or step
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)):
                name, receiver = node.args[1].value, ast.unparse(node.args[0])
                stashed = PROTOCOL_FUNCTION.match(receiver) and not name.startswith("__")
                if stashed or (name not in ok and ((protocol and name in extra) or PROTOCOL_RECEIVER.match(receiver))):
                    found.append(f"{path}:{node.lineno} {node.func.id}({receiver}, {name!r}): {name!r} is not declared "
                                 f"on the protocol")
            # rule 2: an attribute stashed on a function object of the same scope
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
                fns = _functions_in_scope(node.body)
                for stmt in node.body:
                    if not isinstance(stmt, ast.Assign):
                        continue
                    for t in stmt.targets:
                        if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in fns
                                and not t.attr.startswith("__") and (path, t.attr) not in STASHES):
                            found.append(f"{path}:{stmt.lineno} {ast.unparse(t)} = ...: an attribute stashed on a "
                                         f"function (declare it on the protocol instead)")
            # a parameter annotated as a callable/schedule carrying an attribute (``schedule.total_steps = n``)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                callables = {a.arg for a in node.args.args + node.args.kwonlyargs
                             if a.annotation is not None and re.search(r"Callable|Schedule", ast.unparse(a.annotation))}
                for stmt in ast.walk(node):
                    for t in (stmt.targets if isinstance(stmt, ast.Assign) else []):
                        if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in callables
                                and not t.attr.startswith("__") and (path, t.attr) not in STASHES):
                            found.append(f"{path}:{stmt.lineno} {ast.unparse(t)} = ...: an attribute stashed on a "
                                         f"function (declare it on the protocol instead)")
    return found


def sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in sorted(ROOT.rglob("*.py"))}


def test_functrain_reads_only_declared_names():
    assert scan(sources()) == []


def test_the_declarations_the_trainer_and_sharding_read_exist():
    """What replaced the undeclared reads: Transform.micro_batches (Step's is their product), Optimizer.schedule,
    Optimizer.per_param; and the checker's view of them."""
    import torch

    loss = lambda p, b, x: (p["w"] * x).sum()  # noqa: E731
    base = ft.train_step(loss, ft.optim.adamw(ft.optim.schedules.cosine_decay(1e-3, 50)))
    assert base.micro_batches == 1 and ft.accumulate(4)(base).micro_batches == 4
    assert ft.accumulate(4, streaming=True)(base).micro_batches == 1  # one micro-batch per call
    assert ft.optim.schedules.horizon(base.optimizer) == 50 and base.optimizer.schedule.total_steps == 50
    assert ft.optim.sgd(0.1).schedule == 0.1 and not ft.optim.sgd(0.1).per_param
    assert ft.optim.from_optax_style(lambda p: {"count": torch.zeros((), dtype=torch.int64)},
                                     lambda g, s, p: (g, s), learning_rate=0.5).schedule == 0.5
    assert {"micro_batches", "params_fields", "shards_state", "accessors", "schedule", "per_param"} <= declared()
    assert {"n", "shard", "decay"} <= carried({p: ast.parse(s) for p, s in sources().items()}) - declared()


@pytest.mark.parametrize("path, old, new, expected", [
    # the two reads issue 18 found, put back
    ("trainer/build.py", "n = base.micro_batches", "n = int(getattr(_named(base, 'accumulate'), 'n', 1))",
     "getattr(_named(base, 'accumulate'), 'n')"),
    ("trainer/build.py", 'mode = present.shard if isinstance(present, ShardedDataParallel) else "none"',
     'mode = getattr(present, "shard", "none")', "getattr(present, 'shard')"),
    # a probe for a capability no protocol class declares
    ("driver.py", "runner = step if isinstance(step, (Runner, DynamoRunner)) else None",
     "runner = step if isinstance(step, (Runner, DynamoRunner)) else getattr(step, \"fast_path\", None)",
     "getattr(step, 'fast_path')"),
    # the schedule stashed on the optimizer's learning_rate closure, read back by schedules.horizon
    ("optim/base.py", "        return lr_value(lr, opt_state.count, hyper_values(opt_state.hyper, defaults))\n\n"
     "    return learning_rate",
     "        return lr_value(lr, opt_state.count, hyper_values(opt_state.hyper, defaults))\n\n"
     "    learning_rate.schedule = lr\n    return learning_rate",
     "learning_rate.schedule = ...: an attribute stashed"),
    ("optim/schedules.py", "    return obj.schedule if isinstance(obj, Optimizer) else obj",
     "    learning_rate = getattr(obj, 'learning_rate', None)\n"
     "    return learning_rate.schedule if hasattr(learning_rate, 'schedule') else obj",
     "hasattr(learning_rate, 'schedule')"),
])
def test_the_checker_catches_a_planted_read(path, old, new, expected):
    src = sources()
    assert old in src[path], f"the plant's anchor moved in {path}"
    src[path] = src[path].replace(old, new)
    found = scan(src)
    assert len(found) == 1 and expected in found[0], found


def test_a_declared_optional_read_passes():
    """A read of a declared name (an optional field of the optimizer protocol) is not a leak."""
    src = sources()
    src["planted.py"] = "def f(step):\n    return getattr(step.optimizer, 'per_param', False)\n"
    assert scan(src) == []
