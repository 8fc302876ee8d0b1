"""One code path, eager shortcuts inside: the small interface a transform, an optimizer and the grad
stage call where the eager step can take a host shortcut.

A functrain step is written once for both eager calls and tracing (``torch.compile``,
functrain's ``make_fx`` capture): every decision on a tensor is a device-side select and
every scalar a tensor, so a trace never syncs. Eagerly, with the value already in host
memory, that costs tiny tensor ops (and whole-tensor selects) where Python arithmetic
gives the same numbers. The functions here are the only place that tells the two apart
(:func:`tracing` is the one test of ``torch.compiler.is_compiling()``); code written
against them has one path, right in both:

=============================  ==============================================  =====================================
call                           eagerly, when it is free and safe               traced, or a value not on the host
=============================  ==============================================  =====================================
``host_number(x)``             a 0-dim CPU tensor read as a Python number      ``x`` (the tensor)
``double(x)``                  a Python number as it is                        ``x.to(torch.float64)``
``as_tensor(x, like)``         a new tensor holding the number ``x``           ``x``
``per_step(*scalars)``         the scalars as they are                         each 0-dim tensor computed once per step
``select(pred, a, b)``         a host ``pred`` picks; only that branch runs    ``torch.where(pred, a, b)`` per leaf
``divide(x, d)``               ``x`` itself when ``d`` is the number 1         ``x / d``
``Sum``                        adds in place into tensors it made              out of place (one graph node per add)
``sub_scaled(p, d, s)``        ``p - s * d`` as ``add(alpha=-s)``              ``addcmul(p, d, s, value=-1)``
``sub_scaled_ratio(p,m,d,s)``  ``p - s * m / d`` as ``addcdiv(value=-s)``      ``p + (m * -s) / d``
``grad_with_aux(fn, leaves)``  ``torch.autograd.grad``                         ``torch.func.grad_and_value``
``TreespecCache()(tree)``      a ``{name: tensor}`` dict's cached treespec     ``optree.tree_flatten``
=============================  ==============================================  =====================================

"A value not on the host" is a tensor scalar: a traced or a device counter, a step under a
dispatch mode or a ``torch.func`` transform. Each shortcut gives what the general path gives:
the same bits where the ops are the same (a host select, in-place sums, an autograd gradient),
torch.optim's own Python-float scalar arithmetic for the optimizers (so eager fp32 updates are
bitwise ``torch.optim``'s), and the traced kernels are those of the general column.

Example, a transform hook written once (the EMA's decision: copy, blend or keep)::

    >>> import torch
    >>> from functrain.core.eager import host_number, select
    >>> ema, params = [torch.zeros(2)], [torch.ones(2)]
    >>> count = host_number(torch.tensor(3)) + 1      # eagerly a Python int: the choice is made on the host
    >>> [x.tolist() for x in select(count % 2 == 0, lambda: torch._foreach_lerp(ema, params, 0.5), ema)]
    [[0.5, 0.5]]
"""
from __future__ import annotations

from typing import Any, Callable

import optree
import torch

from . import regions

__all__ = ["tracing", "host_number", "double", "as_tensor", "per_step", "select", "lerp", "divide", "all_reduce_sum", "Sum",
           "sub_scaled", "sub_scaled_ratio", "grad_with_aux", "has_grad", "TreespecCache"]

Tensors = Any  # a tensor or a list of tensors


def tracing() -> bool:
    """Whether the code runs inside a trace (``torch.compile``/Dynamo, functrain's ``make_fx`` capture,
    which sets the same flag): the one place functrain asks. Shortcuts that would bake a value into the
    graph, or give it extra nodes, are off there."""
    return torch.compiler.is_compiling()


def host_number(x: Any) -> Any:
    """``x`` as a Python number when reading it is free and cannot end up baked into a trace, else ``x``.

    That is a plain 0-dim CPU tensor in eager code: not a fake, functional or
    batched tensor, not under ``torch.compile`` / ``make_fx`` (:func:`tracing`, a dispatch
    mode), not wrapped by a ``torch.func`` transform. Reading such a tensor is a host memory
    read, not a device sync, and ``.tolist()`` runs no aten op. The optimizers use it for the
    step counter and a scheduled lr: their scalar math (bias corrections, step size) is then
    Python floats, as in ``torch.optim``'s for-loop and foreach paths (the same numbers, and
    about ten tiny tensor ops fewer per update). Anything else stays a tensor: a traced or
    device-side counter keeps the sync-free tensor math.

    Example::

        >>> import torch
        >>> from functrain.core.eager import host_number
        >>> host_number(torch.tensor(3)), host_number(2.5)
        (3, 2.5)
    """
    if (type(x) is torch.Tensor and x.is_cpu and x.dim() == 0 and not tracing()
            and not torch._C._len_torch_dispatch_stack() and not torch._C._functorch.is_functorch_wrapped_tensor(x)):
        return x.tolist()
    return x


def double(x: Any) -> Any:
    """``x`` as a double-precision scalar: a Python number as it is (Python arithmetic is double, as
    ``torch.optim``'s scalars are), a tensor as ``x.to(torch.float64)``.

    Example::

        >>> import torch
        >>> from functrain.core.eager import double
        >>> double(3), double(torch.tensor(3)).dtype
        (3, torch.float64)
    """
    return x.to(torch.float64) if isinstance(x, torch.Tensor) else x


def as_tensor(x: Any, like: torch.Tensor) -> torch.Tensor:
    """``x`` as a tensor: ``x`` itself when it is one, else a new 0-dim tensor of ``like``'s dtype and device
    (a counter decided on the host, stored back into the state).

    Example::

        >>> import torch
        >>> from functrain.core.eager import as_tensor
        >>> as_tensor(4, torch.tensor(3))
        tensor(4)
    """
    return x if isinstance(x, torch.Tensor) else like.new_full((), x)  # (new_full: one op, no lift)


def per_step(*scalars: Any) -> tuple:
    """The step's scalars (bias corrections, a scheduled lr), computed once per step in a traced step.

    Inductor inlines a 0-d computation into every elementwise kernel that reads it, so
    ``1 - beta ** step`` (two ``pow`` in double) would run once per vector of every
    parameter: the 1024x1024 Adam update of a medium MLP took ~2.5x its memory time.
    A reduction is always its own buffer, so each tensor scalar goes through one that
    returns it exactly (the max of two copies of itself). Eagerly, nothing changes.

    Example::

        >>> import torch
        >>> from functrain.core.eager import per_step
        >>> per_step(0.5, torch.tensor(2.0))
        (0.5, tensor(2.))
    """
    if not tracing():
        return scalars
    return tuple(torch.stack([x, x]).amax(0) if isinstance(x, torch.Tensor) and x.dim() == 0 else x
                 for x in scalars)


def select(pred: Any, a: Tensors | Callable[[], Tensors], b: Tensors | Callable[[], Tensors]) -> Tensors:
    """``a`` where ``pred`` holds, else ``b``: a tensor or a list of tensors, as new tensors.

    ``a`` and ``b`` are tensors (or lists of them), or functions of no arguments that
    compute them. When ``pred`` is a Python bool (a decision made on the host, from
    :func:`host_number` values) only the chosen branch is evaluated: a function's result
    is returned as it is (it made new tensors), given tensors are copied (so the result
    never shares memory with an input). When ``pred`` is a bool tensor both branches are
    evaluated and combined with ``torch.where``, leaf by leaf: no host sync.

    Example::

        >>> import torch
        >>> from functrain.core.eager import select
        >>> select(False, lambda: [torch.ones(1)], [torch.zeros(1)])
        [tensor([0.])]
        >>> select(torch.tensor(True), lambda: [torch.ones(1)], [torch.zeros(1)])
        [tensor([1.])]
    """
    if isinstance(pred, bool):
        chosen = a if pred else b
        if callable(chosen):
            return chosen()
        return chosen.clone() if isinstance(chosen, torch.Tensor) else [x.clone() for x in chosen]
    a = a() if callable(a) else a
    b = b() if callable(b) else b
    if isinstance(a, torch.Tensor):
        return torch.where(pred, a, b)
    return [torch.where(pred, x, y) for x, y in zip(a, b)]


def divide(x: torch.Tensor, d: Any) -> torch.Tensor:
    """``x / d``; eagerly ``x`` itself when ``d`` is the Python number 1 (dividing by 1 is a copy of a
    tensor the step made). Traced it stays a division, a fresh output the graph folds.

    Example::

        >>> import torch
        >>> from functrain.core.eager import divide
        >>> x = torch.tensor(3.0)
        >>> divide(x, 1.0) is x, divide(x, 2.0)
        (True, tensor(1.5000))
    """
    if isinstance(d, (int, float)) and d == 1 and not tracing():
        return x
    return x / d


def all_reduce_sum(flat: torch.Tensor, group: Any) -> torch.Tensor:
    """``flat`` (a buffer the caller made, not shared) summed over the ranks of ``group``. Traced: torch's functional
    all-reduce, a node of the graph. Eagerly: c10d's all-reduce of ``flat`` in place, the same sum by the same
    backend, returned; torch's eager functional all-reduce imports Dynamo and inductor at its first call
    (``torch._disable_dynamo``: seconds of an eager run's first step, for a compiler it never uses)."""
    if tracing():
        from torch.distributed import _functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(flat, "sum", group))
    import torch.distributed as dist

    dist.all_reduce(flat, dist.ReduceOp.SUM, group=group)
    return flat


class Sum:
    """A running sum of trees of tensors of one structure (the micro-batches' gradients of one step).

    ``s = Sum(); s.add(tree); ...; s.value`` is the leafwise sum, added in the order given.
    The first tree is kept as it is; eagerly the second add makes new tensors (never writing
    the first tree's, which a caller may still hold) and later adds write into those in place,
    an accumulator this step owns; traced, every add is out of place (one ``_foreach_add`` per
    add). The same additions in the same order either way: the same bits.

    Example::

        >>> import torch
        >>> from functrain.core.eager import Sum
        >>> s = Sum()
        >>> for g in ({"w": torch.ones(2)}, {"w": torch.ones(2)}, {"w": torch.ones(2)}):
        ...     s.add(g)
        >>> s.value
        {'w': tensor([3., 3.])}
    """

    __slots__ = ("_leaves", "_spec", "_owned")

    def __init__(self) -> None:
        self._leaves: list | None = None
        self._spec: Any = None
        self._owned = False  # _leaves are tensors this sum made (eagerly written in place)

    def add(self, tree: Any) -> None:
        """Add ``tree`` (the structure of the first one added) to the sum."""
        if self._leaves is None:
            self._leaves, self._spec = optree.tree_flatten(tree)
            return
        leaves = self._spec.flatten_up_to(tree)
        if not leaves:
            return
        if self._owned:
            torch._foreach_add_(self._leaves, leaves)
        else:
            self._leaves = torch._foreach_add(self._leaves, leaves)
            self._owned = not tracing()

    @property
    def value(self) -> Any:
        """The sum so far (``None`` before the first :meth:`add`)."""
        return None if self._leaves is None else optree.tree_unflatten(self._spec, self._leaves)


def lerp(start: list[torch.Tensor], end: list[torch.Tensor], weight: Any) -> list[torch.Tensor]:
    """``start + weight * (end - start)`` leafwise, new tensors (a moment's or an average's update).

    ``weight`` a Python number: ``torch._foreach_lerp``, ``torch.optim``'s arithmetic. A tensor, or a list of
    one tensor per leaf (a state's hyper-parameter, traced or on a device): eagerly ``_foreach_lerp`` with one
    weight per leaf (one kernel launch for all leaves); traced (:func:`tracing`), ``torch.lerp`` leaf by leaf, the
    same formula: inductor has no lowering for ``_foreach_lerp``'s list-of-weights overload and runs it as a
    fallback kernel, whose inputs and outputs are buffers of their own (AdamW's compiled step held one more
    parameter-sized buffer at its peak, and took 27 kernels instead of 16), and which torch's C++ wrapper can only
    call through Python.

    Example::

        >>> import torch
        >>> from functrain.core.eager import lerp
        >>> a, b = [torch.zeros(2)], [torch.ones(2)]
        >>> [x.tolist() for x in lerp(a, b, 0.25)], [x.tolist() for x in lerp(a, b, torch.tensor(0.25))]
        ([[0.25, 0.25]], [[0.25, 0.25]])
    """
    if isinstance(weight, torch.Tensor):
        weight = [weight] * len(start)
    if isinstance(weight, (list, tuple)) and tracing():
        return [torch.lerp(s, e, w) for s, e, w in zip(start, end, weight)]
    return torch._foreach_lerp(start, end, weight)


def sub_scaled(p: list[torch.Tensor], d: list[torch.Tensor], s: Any) -> list[torch.Tensor]:
    """``p - s * d`` leafwise, new tensors (an optimizer's step ``p - lr * d``).

    ``s`` a Python number: ``_foreach_add(p, d, alpha=-s)``, ``torch.optim``'s
    ``p.add(d, alpha=-lr)``. ``s`` a tensor: ``_foreach_addcmul(p, d, [s], value=-1)``,
    ``p + (-1 * d) * s``, which rounds once like the fused ``add(alpha=)`` (a separate mul
    then add would round twice).

    Example::

        >>> import torch
        >>> from functrain.core.eager import sub_scaled
        >>> p, d = [torch.ones(2)], [torch.ones(2)]
        >>> [x.tolist() for x in sub_scaled(p, d, 0.25)], [x.tolist() for x in sub_scaled(p, d, torch.tensor(0.25))]
        ([[0.75, 0.75]], [[0.75, 0.75]])
    """
    if isinstance(s, torch.Tensor):
        return torch._foreach_addcmul(p, d, [s] * len(d), value=-1)
    return torch._foreach_add(p, d, alpha=-s)


def sub_scaled_ratio(p: list[torch.Tensor], m: list[torch.Tensor], d: list[torch.Tensor], s: Any,
                     owned: bool = False) -> list[torch.Tensor]:
    """``p - s * m / d`` leafwise (Adam's step ``p - step_size * exp_avg / denom``).

    ``s`` a Python number: ``addcdiv(p, m, d, value=-s)``, ``torch.optim``'s
    ``param.addcdiv_(exp_avg, denom, value=-step_size)``; with ``owned`` (``p`` are tensors
    this update made, e.g. decayed params) written into ``p`` in place. ``s`` a tensor
    (``addcdiv`` takes a number only): ``p + (m * -s) / d``, new tensors.

    Example::

        >>> import torch
        >>> from functrain.core.eager import sub_scaled_ratio
        >>> p, m, d = [torch.ones(1)], [torch.ones(1)], [torch.full((1,), 4.0)]
        >>> [x.tolist() for x in sub_scaled_ratio(p, m, d, 2.0)]
        [[0.5]]
        >>> [x.tolist() for x in sub_scaled_ratio(p, m, d, torch.tensor(2.0))]
        [[0.5]]
    """
    if isinstance(s, torch.Tensor):
        delta = torch._foreach_mul(m, -s)
        torch._foreach_div_(delta, d)
        return torch._foreach_add(p, delta)
    if owned:
        torch._foreach_addcdiv_(p, m, d, value=-s)
        return p
    return torch._foreach_addcdiv(p, m, d, value=-s)


def grad_with_aux(fn: Callable[..., tuple[torch.Tensor, Any]], leaves: list[torch.Tensor],
                  *args: Any) -> tuple[list[torch.Tensor], Any]:
    """``(gradients of the objective w.r.t. leaves, aux)`` for ``fn(leaves, *args) -> (objective, aux)``.

    ``aux`` is a tree of tensors, returned detached. Eagerly ``torch.autograd.grad`` (the same
    math as ``torch.func`` at a third of its per-call Python cost; a leaf the objective does
    not use gets a zero gradient); traced, or inside a ``torch.func`` transform (``vmap``: an
    ``ft.population``), ``torch.func.grad_and_value``, which composes with Dynamo and with vmap.

    Example::

        >>> import torch
        >>> from functrain.core.eager import grad_with_aux
        >>> grad_with_aux(lambda ls, x: ((ls[0] * x).sum(), {"n": x.sum()}), [torch.ones(2)], torch.tensor([3.0, 4.0]))
        ([tensor([3., 4.])], {'n': tensor(7.)})
    """
    # traced: torch.func composes with Dynamo; but a trace that reuses repeated blocks (invoke_subgraph, which has
    # no torch.func rule) differentiates with torch.autograd.grad below, which make_fx traces as well
    # and under a torch.func transform (a population's vmap): autograd cannot mark its wrapped tensors
    if (tracing() and not regions.active()) or torch._C._functorch.peek_interpreter_stack() is not None:
        grads, (_, aux) = torch.func.grad_and_value(fn, has_aux=True)(leaves, *args)
        return list(grads), aux
    live = [p.detach().requires_grad_(True) for p in leaves]
    if torch.is_grad_enabled():
        objective, aux = fn(live, *args)
        grads = _autograd(objective, live)
    else:
        with torch.enable_grad():
            objective, aux = fn(live, *args)
            grads = _autograd(objective, live)
    if not all(map(torch.is_tensor, grads)):  # an unused leaf: a zero gradient
        if _reentrant_in_graph(objective):  # ... unless torch's reentrant checkpoint hid it from autograd.grad
            raise RuntimeError(_REENTRANT_MSG)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves, grads)]
    if has_grad(aux):
        aux = optree.tree_map(lambda t: t.detach() if torch.is_tensor(t) else t, aux)
    return list(grads), aux


_REENTRANT_MSG = ("the loss calls torch.utils.checkpoint.checkpoint(use_reentrant=True), which only runs under "
                  "loss.backward(): its parameters get no gradient from torch.autograd.grad (functrain's eager "
                  "gradient) and it cannot run under torch.func (the compiled step's). Mark the block with "
                  "ft.remat(module) or call ft.remat(fn)(*args) instead: the same recomputation, eager and compiled")


def _autograd(objective: torch.Tensor, live: list) -> tuple:
    try:
        return torch.autograd.grad(objective, live, allow_unused=True)
    except RuntimeError as e:
        if "with .grad()" in str(e) and "checkpoint" in str(e).lower():  # torch's reentrant checkpoint refuses
            raise RuntimeError(_REENTRANT_MSG) from e
        raise


def _reentrant_in_graph(objective: torch.Tensor) -> bool:
    """Whether the autograd graph of ``objective`` holds torch's reentrant checkpoint (a walk of the graph, done
    only when some leaf got no gradient)."""
    seen: set = set()
    todo = [objective.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def has_grad(tree: Any) -> bool:
    """Does a tensor in ``tree`` require grad? (dicts are walked directly: the grad stage's ``out``)"""
    if isinstance(tree, torch.Tensor):
        return tree.requires_grad
    if type(tree) is dict:
        for v in tree.values():
            if isinstance(v, torch.Tensor):
                if v.requires_grad:
                    return True
            elif isinstance(v, float) or (type(v) is dict and not v):
                continue
            elif has_grad(v):
                return True
        return False
    if tree is None or isinstance(tree, (float, int)):
        return False
    return any(t.requires_grad for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor))


class TreespecCache:
    """``optree.tree_flatten`` with a cached treespec, for trees that are, call after call, one
    ``{key: tensor}`` dict (the params as ``ft.functionalize`` gives them).

    ``optree.tree_flatten`` of such a dict costs about ten times what reading its values in
    the cached order does. The first call (and any call whose tree is not a plain dict of
    tensors with the same keys in the same insertion order) flattens with optree and
    remembers the spec; the next ones read the values in the spec's order. The result is
    exactly optree's: the same leaves and a spec equal to the one ``tree_flatten`` would
    return, so unflattening gives the same dict, key order included. While tracing it is
    plain ``optree.tree_flatten``.

    Example::

        >>> import torch
        >>> from functrain.core.eager import TreespecCache
        >>> flatten = TreespecCache()
        >>> leaves, spec = flatten({"b": torch.ones(1), "a": torch.zeros(1)})
        >>> [float(x) for x in leaves], spec   # optree's order: sorted keys
        ([0.0, 1.0], PyTreeSpec({'a': *, 'b': *}))
        >>> leaves, _ = flatten({"b": torch.ones(1) * 2, "a": torch.zeros(1)})   # the cached spec
        >>> [float(x) for x in leaves]
        [0.0, 2.0]
    """

    __slots__ = ("_known",)

    GRAPH_CACHE = True  # a memo: what it holds is not the step's structure (functrain.compiler.prekey)

    def __init__(self) -> None:
        # (spec, insertion order of the dict it came from, optree's leaf order): one attribute, so
        # that a step called from two threads never reads a half-updated cache
        self._known: tuple | None = None

    def __call__(self, tree: Any) -> tuple[list, Any]:
        if tracing():  # traced: plain optree, no cache for Dynamo to guard on
            return optree.tree_flatten(tree)
        known = self._known
        if type(tree) is dict and known is not None and list(tree) == known[1]:
            leaves = [tree[k] for k in known[2]]
            if all(isinstance(x, torch.Tensor) for x in leaves):
                return leaves, known[0]
        leaves, spec = optree.tree_flatten(tree)
        # flat: the root dict's children are its leaves (a one-leaf sub-dict would add a node)
        if (type(tree) is dict and spec.num_leaves == len(tree) and spec.num_nodes == len(tree) + 1
                and all(isinstance(x, torch.Tensor) for x in leaves)):
            self._known = (spec, list(tree), spec.entries())
        return leaves, spec
