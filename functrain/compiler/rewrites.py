"""Rewrites of a traced step's graph before a backend compiles it: the same numbers, a graph that lowers and
runs better.

* :func:`reshape_views`: a ``view`` of a value nothing writes in place becomes a ``reshape`` (GPT-2, T5: issue 38);
* :func:`own_small_views`: a small output that is a view is the graph's own tensor (no view replayed by
  AOTAutograd at every call: issue 40);
* :func:`split_foreach_norms`: ``_foreach_norm`` as per-tensor norms (no call through Python from a C++ wrapper:
  issue 40).

The first two run on every capture (:func:`functrain.compiler.capture.trace`); the last on the backend's CPU graphs
and on packages whose graph holds collectives.
"""
from __future__ import annotations

import copy
import operator
from typing import Any

import torch

__all__ = ["reshape_views", "own_small_views", "split_foreach_norms", "OWN_VIEW_LIMIT"]


def reshape_views(gm: torch.fx.GraphModule) -> int:
    """Turn each ``aten.view`` of a value nothing writes in place into ``aten.reshape``; returns how many.

    Why: ``make_fx`` records the choice a composite op made for the strides it saw. ``matmul`` of a
    transposed key (``query @ key.transpose(-1, -2)``, every attention) reshapes its ``expand``: a ``view``
    where the traced strides allow one, else a copy. The backend traces the graph again with its own
    decompositions, and those need not give eager's strides: inductor's ``aten.cat`` of one non-empty
    tensor (transformers' key/value cache concatenates the new keys to an empty tensor) is a ``clone``
    keeping the input's stride order, where eager's ``cat`` is contiguous (torch 2.13 and 2.14). The
    recorded ``view`` then cannot be taken, and inductor fails with ``Cannot view a tensor with shape ...``
    (GPT-2, T5). ``reshape`` is that ``view`` wherever the view can be taken and a copy where it cannot,
    which is what eager's ``matmul`` would have chosen for those strides: the same numbers. It is exact
    only where no alias is observed, so a view whose base (or any view of it) is written in place by the
    graph is left as it is. Graphs the backend calls as regions (``invoke_subgraph``) are rewritten too.
    """
    count = 0
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            n = _reshape_views(module.graph)
            if n:
                module.recompile()
            count += n
    return count


def _reshape_views(graph: torch.fx.Graph) -> int:
    view, reshape = torch.ops.aten.view.default, torch.ops.aten.reshape.default
    root: dict = {}  # node -> the node whose storage it aliases (itself if it has its own)
    written: set = set()  # roots some op writes in place, or hands to an op whose effects are unknown

    def base(a: Any) -> Any:
        return root.get(a, a)

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem:  # an element of split/unbind: a view of its base
            root[node] = base(node.args[0])
            continue
        if not isinstance(target, torch._ops.OpOverload):  # a region, a higher-order op: whatever it gets
            for a in node.all_input_nodes:                # may be written
                written.add(base(a))
            continue
        schema = target._schema
        for i, arg in enumerate(schema.arguments):
            info = arg.alias_info
            if info is None:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                if isinstance(v, torch.fx.Node):
                    if info.is_write:
                        written.add(base(v))
                    if any(r.alias_info is not None for r in schema.returns):  # a view, or an in-place result
                        root[node] = base(v)
    views = [n for n in graph.nodes if n.op == "call_function" and n.target is view and base(n) not in written]
    for node in views:
        node.target = reshape
    return len(views)


OWN_VIEW_LIMIT = 4096
"""The most elements of a graph output that is a view which :func:`own_small_views` copies."""


def own_small_views(gm: torch.fx.GraphModule) -> int:
    """Give each small graph output that is a view (of an input or of an intermediate value: at most
    :data:`OWN_VIEW_LIMIT` elements) its own storage: an ``aten.clone`` of it as the graph returns it; returns how
    many.

    Why: AOTAutograd rebuilds an output that aliases an input or an intermediate at every call, outside the
    compiled code, by replaying the view on its base (its runtime wrapper's ``_alias_fn``). A metric that is a
    view of the state is common: every optimizer's ``lr`` metric is a view of the state's hyper-parameter
    tensor. That replay cost W1 ~15 us of a ~105 us compiled step (bench/README.md, issue 40). A clone of a few
    elements costs nothing that shows. It is taken just before the graph returns, after every write the graph
    makes (a write to the view's base shows in it, as in the replayed view): the values are the ones the
    replay gave, bit for bit. A larger view is left a view (a copy could cost more than the replay); an output
    that is an input itself (a leaf the step left unchanged) stays that tensor."""
    graph = gm.graph
    out = next((n for n in graph.nodes if n.op == "output"), None)
    if out is None:
        return 0
    owned: dict = {}

    def own(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(own(x) for x in a)
        if not _is_view(a):
            return a
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() > OWN_VIEW_LIMIT:
            return a
        if a not in owned:
            with graph.inserting_before(out):  # (its value as returned: after every write in the graph)
                c = graph.call_function(torch.ops.aten.clone.default, (a,))
            c.meta.update({k: v for k, v in a.meta.items() if k in ("val", "tensor_meta", "stack_trace")})
            owned[a] = c
        return owned[a]

    out.args = (own(out.args[0]),) + tuple(out.args[1:])
    if owned:
        gm.recompile()
    return len(owned)


def _is_view(node: Any) -> bool:
    """Whether an FX node's value is a view (its op's schema says its result aliases an argument; an element of
    a ``split``/``unbind``/``chunk`` too)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
        target = node.args[0].target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in target._schema.returns)


def split_foreach_norms(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with each ``_foreach_norm`` as one ``linalg_vector_norm`` per tensor (``clip``'s global
    norm, ``ft.tree.global_norm``). Inductor has no C shim for ``_foreach_norm``: a C++ wrapper (a CPU graph's, an
    AOTInductor package's) calls it through torch's proxy executor, a round trip through Python on every call
    (the W6-like step of bench/README.md, issue 40: 0.77x per call without it), which the GIL-free package
    runner (:class:`~functrain.compiler.package._FreeRunner`) does not have at all. Inductor compiles the
    per-tensor norms into its own kernels.

    Done on the graph itself (its results are read only by ``getitem``, as a traced graph's are), not by
    ``ExportedProgram.run_decompositions``, which traces the whole program again (1.6 s of the main job's
    2-rank package build). A graph without the op is returned as it is."""
    def norms(graph: torch.fx.Graph) -> list:
        return [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._foreach_norm.Scalar]
    if not norms(gm.graph):
        return gm
    graph = copy.deepcopy(gm.graph)
    for node in norms(graph):
        tensors = node.args[0]
        ord_ = node.args[1] if len(node.args) > 1 else node.kwargs.get("ord", 2)
        dtype = node.args[2] if len(node.args) > 2 else node.kwargs.get("dtype")
        users = list(node.users)
        if not all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                   for u in users):
            raise ValueError(f"a _foreach_norm whose results are read other than one by one ({users})")
        with graph.inserting_after(node):
            one = [graph.call_function(torch.ops.aten.linalg_vector_norm.default, (t, ord_),
                                       {"dtype": dtype} if dtype is not None else {}) for t in tensors]
        for u in users:
            u.replace_all_uses_with(one[u.args[1]])
            graph.erase_node(u)
        graph.erase_node(node)
    graph.lint()
    return torch.fx.GraphModule(gm, graph)
