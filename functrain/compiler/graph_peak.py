"""The step's peak from its capture: the graph walked as inductor will run it (:func:`estimate_graph`, for
``ft.memory``: :mod:`functrain.compiler.estimate`).

Inductor does not run the captured graph op by op. What decides its memory, and what the walk follows:

1. composite ops (softmax, layer norm, GELU's backward, the losses) are decomposed into elementwise ops and
   reductions: each such op of the capture is traced alone (on fake tensors, no compile) through inductor's
   decomposition table, once per distinct op and shapes (kept for the next walk), and spliced in its place;
2. an elementwise value is computed inside each kernel that reads it, never stored, unless an extern kernel
   (a matmul, convolution, attention, collective: what inductor calls rather than generates) or the output
   reads it, or several kernels read it while it is costly (inductor's realize rules); reductions store their
   result, and so do concatenations and scatters, which are never fused with their readers;
3. stored values whose loops have the same size and that share data (one reads the other, or both read one
   buffer) are fused into one kernel, which runs once all its inputs exist: a value recomputed by ``ft.remat``
   and fused with the backward op that reads the same input is computed there, beside that op's output, not
   where the graph lists it (the old op-by-op walk missed this: 0.67-0.78x of the measured peak on MLP stacks
   with remat); a value read only inside its own kernel is never a buffer;
4. a convolution reads its input channels-last (inductor's layout optimization): each convolution (forward
   or backward) that reads an activation not made by a convolution reads a copy of its own, written with the
   value, which stays a buffer only if other kernels read it too.

5. a scatter onto a constant (the one-hot of a loss's backward) is elementwise (inductor's pattern
   ``scatter_upon_const_tensor``); a scatter into a zero fill that stays a buffer (an embedding's gradient) is
   filled by a kernel that reads nothing, which inductor runs with the first kernels: that buffer exists from the
   start of the step.

The walk then runs the kernels in dependency order (the one holding the earliest node first), each allocating
the buffers it stores and freeing those it reads last; graph inputs exist already and are never freed, a write
into an input (donation) allocates nothing, and graph outputs are never freed. Not modelled, and each only
lowers the real peak (so the walk errs high): inductor writing a kernel's output into a dying input's buffer,
and its reordering for peak memory. Dead code (a recomputed value nothing reads) is dropped as inductor drops
it. Where a decomposition fails, the capture itself is walked the same way (composite ops then count as extern).
The peak is then raised by 5% (``_MARGIN``: the walk read 0.96-1.11 of the allocator's peak; never under).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from .fx_tracing import FX_TRACING

__all__ = ["estimate_graph"]


def _round(nbytes: int, device: torch.device) -> int:
    if device.type == "cuda":
        return (nbytes + 511) // 512 * 512
    if nbytes >= 1 << 16:
        return (nbytes + 4095) // 4096 * 4096
    return (nbytes + 15) // 16 * 16


# A collective whose backend copies its input into a buffer of its own (outside the graph): that many more
# bytes while it runs. gloo's reduce-scatter allocates a whole-size buffer inside (sharding.py's note: +358 MiB
# of peak for a 190 MiB input); NCCL's collectives work in place.
_COLLECTIVES = {"reduce_scatter_tensor": 1.0, "all_reduce": 0.0, "all_gather_into_tensor": 0.0}


_aten = torch.ops.aten
_CONV = (_aten.convolution.default, _aten.convolution_backward.default)
_HEAVY = ("exp", "log", "sigmoid", "tanh")  # inductor on a CPU stores a reused value that computes one of these
# computed inside generated kernels though not tagged pointwise (inlined like elementwise ops), and stored
_INLINE = {"_to_copy", "full", "full_like", "scalar_tensor", "iota", "gather", "embedding", "index", "where",
           "lift_fresh_copy", "zeros_like", "ones_like", "empty_like", "constant_pad_nd", "slice_scatter",
           "select_scatter", "fill"}
_STORE = {"cat", "stack", "scatter", "scatter_add", "scatter_reduce", "index_put", "index_put_",
          "_unsafe_masked_index_put_accumulate", "index_add"}
_MAX_KERNEL = 64  # inductor's max_fusion_size
# The walk against the compiled step's allocator peak reads 0.96-1.11 on the shapes measured (docs/compiling.md):
# what it misses most (inductor storing parts of a layer norm's backward from the forward kernel) is a few percent
# under on wide attention blocks. The promise is never under, so the walk's peak is raised by this much.
_MARGIN = 1.05


def _args(n: Any) -> list:
    out: list = []
    torch.fx.map_arg((n.args, n.kwargs), out.append)
    return out


def _name(target: Any) -> str:
    return str(getattr(target, "__name__", target)).split(".")[0]


def _inductor_graph(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, frozenset]:
    """The capture with each op that inductor decomposes replaced by its decomposition (each new node's
    ``meta["ft_origin"]`` names the captured node it came from), and the ops inductor runs as extern kernels; the
    capture itself if that fails.

    Each op is decomposed on its own, by tracing that op alone on fake tensors of its arguments' shapes through
    inductor's decomposition table, and the small graph is kept (:data:`_DECOMPOSED`, keyed by the op and its
    arguments' shapes, dtypes and values): a step's graph repeats few distinct ops (layers, micro-batches), so a
    walk traces a few dozen small graphs instead of tracing the whole capture again, and the next estimate of a
    step of the same shapes (``fit_batch``'s probes, the Trainer's line) traces none. The result is the graph the
    whole retrace made (a decomposition reads only its own op's arguments)."""
    try:
        import torch._inductor.lowering as lowering  # (the decomposition table refers to it)
        from torch._inductor.decomposition import select_decomp_table

        extern = frozenset(lowering.needs_realized_inputs) | frozenset(getattr(lowering, "fallbacks", ()))
        table = select_decomp_table()
    except Exception:  # noqa: BLE001 - no inductor: the capture as it is, ops classified by their tags
        return gm, frozenset()
    try:
        return _decompose_graph(gm, table), extern
    except Exception:  # noqa: BLE001 - an op the decomposition cannot take (the capture's own classes are close)
        return gm, extern


# (op, its arguments' description) -> the op traced alone through inductor's decompositions (None: kept as it is)
_DECOMPOSED: dict = {}
_DECOMPOSED_MAX = 4096  # small graphs of a few nodes each; the oldest go first past this many


def _describe(x: Any) -> Any:
    """A hashable description of an argument: a tensor's shape, strides, dtype and device; a value as it is."""
    if isinstance(x, torch.fx.Node):
        v = x.meta.get("val")
        if isinstance(v, torch.Tensor):
            if any(not isinstance(d, int) for d in (*v.shape, *v.stride())):
                raise TypeError("symbolic shape")  # (the whole graph is walked undecomposed)
            return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, v.device.type, v.storage_offset())
        raise TypeError(f"an argument without a tensor value: {x}")
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_describe(a) for a in x))
    if isinstance(x, dict):
        return ("dict", *((k, _describe(a)) for k, a in sorted(x.items())))
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TypeError("symbolic value")
    hash(x)
    return (type(x).__name__, x)


def _decomposition(n: torch.fx.Node, table: dict, fake_mode: Any) -> Any:
    """``n``'s op traced alone through ``table`` on fake arguments like its own: a GraphModule whose placeholders
    are ``n``'s tensor arguments in order, or ``None`` if the op is not decomposed (its trace is itself)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    key = (n.target, _describe(n.args), _describe(n.kwargs))
    if key in _DECOMPOSED:
        return _DECOMPOSED[key]
    tensors: list = []
    torch.fx.map_arg((n.args, n.kwargs), tensors.append)
    fakes = [fake_mode.from_tensor(a.meta["val"]) if fake_mode is not None else a.meta["val"] for a in tensors]

    def run(*xs: Any) -> Any:
        it = iter(xs)
        args, kwargs = torch.fx.map_arg((n.args, n.kwargs), lambda _: next(it))
        return n.target(*args, **kwargs)

    with FX_TRACING, (fake_mode if fake_mode is not None else contextlib.nullcontext()):
        sub = make_fx(run, decomposition_table=table)(*fakes)
    ops = [m for m in sub.graph.nodes if m.op == "call_function"]
    if len(ops) == 1 and ops[0].target is n.target:
        sub = None  # not decomposed
    if len(_DECOMPOSED) >= _DECOMPOSED_MAX:
        del _DECOMPOSED[next(iter(_DECOMPOSED))]
    _DECOMPOSED[key] = sub
    return sub


def _decompose_graph(gm: torch.fx.GraphModule, table: dict) -> torch.fx.GraphModule:
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    out = torch.fx.Graph()
    env: dict = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and _name(n.target) == "getitem" and isinstance(env.get(n.args[0]), list):
            env[n] = env[n.args[0]][n.args[1]]  # an output of a decomposed multi-output op
            continue
        sub = _decomposition(n, table, fake_mode) if (
            n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target in table) else None
        if sub is None:
            env[n] = out.node_copy(n, lambda a: env[a])
            env[n].meta.setdefault("ft_origin", n.name)
            continue
        tensors: list = []
        torch.fx.map_arg((n.args, n.kwargs), tensors.append)
        local: dict = {}
        it = iter(tensors)
        result: Any = None
        for m in sub.graph.nodes:
            if m.op == "placeholder":
                local[m] = env[next(it)]
            elif m.op == "output":
                result = torch.fx.map_arg(m.args[0], lambda a: local[a])
            else:
                local[m] = out.node_copy(m, lambda a: local[a])
                local[m].meta["ft_origin"] = n.name
        env[n] = list(result) if isinstance(result, (list, tuple)) else result
    return torch.fx.GraphModule(gm, out)


def _kind(n: Any, extern: frozenset) -> str:
    """How inductor treats node ``n``: ``input``, ``view`` (no storage of its own), ``write`` (into an existing
    buffer), ``inline`` (elementwise), ``store`` (a generated kernel that stores), ``extern``, ``item`` (an
    output of a multi-output op), ``list`` (a _foreach_ op: its elements are inline) or ``other``."""
    if n.op == "placeholder":
        return "input"
    if n.op != "call_function":
        return "other"
    op = n.target
    if _name(op) == "getitem":
        src = n.args[0]
        if _name(src.target).startswith("_foreach_"):
            return "inline"
        return "view" if _kind(src, extern) == "view" else "item"  # unbind's, split's elements are views
    if not isinstance(op, torch._ops.OpOverload):
        return "extern"
    rets = [r.alias_info for r in op._schema.returns]
    if any(a is not None and a.is_write for a in rets):
        return "write"
    if any(a is not None for a in rets) or _name(op) == "wait_tensor":
        return "view"
    if _name(op).startswith("_foreach_"):
        return "list"
    if op in extern:
        return "extern"
    if op is _aten.scatter.value and _scatter_on_constant(n):
        return "inline"
    if torch.Tag.pointwise in op.tags or _name(op) in _INLINE:
        return "inline"
    if torch.Tag.reduction in op.tags or _name(op) in _STORE:
        return "store"
    return "extern"


def _scatter_on_constant(n: Any) -> bool:
    """Whether ``scatter(full(...), dim, index, value)`` is one inductor computes elementwise (its joint-graph
    pattern ``scatter_upon_const_tensor``: ``where(index == arange, value, fill)``, what the losses' backward
    makes of a one-hot), under the pattern's own condition: the index spans the whole tensor but one element
    along ``dim``."""
    full, dim, index = n.args[0], n.args[1], n.args[2]
    if not (isinstance(full, torch.fx.Node) and full.target is _aten.full.default and isinstance(index, torch.fx.Node)):
        return False
    shape, sel = full.args[0], index.meta.get("val")
    if not isinstance(sel, torch.Tensor) or sel.dim() != len(shape):
        return False
    dim = dim + len(shape) if dim < 0 else dim
    return sel.shape[dim] == 1 and all(s >= f for i, (s, f) in enumerate(zip(sel.shape, shape)) if i != dim)


class _Graph:
    """The graph's nodes in order with their kinds, the storage each reads, and which values are stored."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device):
        g, extern = _inductor_graph(gm)
        nodes = list(g.graph.nodes)
        needed: set = set()  # dead code goes (inductor's and AOT's elimination)
        for n in reversed(nodes):
            if n.op in ("output", "placeholder") or n.users.keys() & needed or _kind(n, extern) == "write" or (
                    isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable):
                needed.add(n)
        self.nodes = [n for n in nodes if n in needed]
        self.kind = {n: _kind(n, extern) for n in self.nodes}
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.origin = {n.name: n for n in gm.graph.nodes}
        self.device = device
        self.stored: dict = {}  # node -> whether its value is a buffer
        self.loads: dict = {}   # node -> the buffers computing it reads (itself, if stored)
        self._stored()

    def base(self, n: Any) -> Any:
        while self.kind.get(n) in ("view", "write") and _args(n):  # (a write's result is its target)
            n = _args(n)[0]
        return n

    def readers(self, n: Any) -> list:
        """The nodes that read ``n``'s value, through views."""
        out = []
        for u in n.users:
            if self.kind.get(u) == "view":
                out.extend(self.readers(u))
            elif u in self.kind:
                out.append(u)
        return out

    def inputs(self, n: Any) -> list:
        """The storages ``n`` reads (an element of a _foreach_ list reads the same element of each list)."""
        if self.kind[n] == "inline" and _name(n.target) == "getitem":
            i = n.args[1]
            args = [a[i] if isinstance(a, (list, tuple)) and i < len(a) else a for a in n.args[0].args]
            return [self.base(a) for a in args if isinstance(a, torch.fx.Node) and a in self.kind]
        return [self.base(a) for a in _args(n) if a in self.kind]

    def _stored(self) -> None:
        cpu = self.device.type == "cpu"
        heavy, ops = {}, {}
        for n in self.nodes:
            k = self.kind[n]
            if k != "inline":
                self.stored[n] = k in ("input", "extern", "item", "store")
                self.loads[n] = frozenset([n])
                continue
            loads, hv, cnt = set(), any(_name(n.target).startswith(h) for h in _HEAVY), 1
            for a in self.inputs(n):
                if self.stored.get(a, True):
                    loads.add(a)
                else:
                    loads |= self.loads[a]
                    hv, cnt = hv or heavy.get(a, False), cnt + ops.get(a, 0)  # (a constant: neither)
            readers = self.readers(n)
            reused = len(set(readers)) > 1 and (len(loads) > 4 or cnt > (50 if cpu else 30) or (hv and cpu))
            stored = (reused or len(loads) > (12 if cpu else 8) or cnt > 100
                      or any(self.kind[u] in ("extern", "item") or u.op == "output" for u in readers))
            self.stored[n] = stored
            self.loads[n] = frozenset([n]) if stored else frozenset(loads)
            heavy[n], ops[n] = (False, 0) if stored else (hv, cnt)


def _fuse(kernels: list, reads: dict, deps: dict, pos: dict, loop: dict) -> dict:
    """Inductor's fusion of generated kernels, greedily: pairs that share a buffer, the largest buffer first and
    then the closest pairs, are fused when their loops have the same size and no path leaves one and comes back
    (checked on the graph's own paths). Returns each kernel's group (its first member)."""
    index = {k: i for i, k in enumerate(kernels)}
    anc: dict = {}
    for k in kernels:  # in graph order: ancestors as bit masks over kernels
        m = 0
        for d in deps[k]:
            m |= anc[d] | (1 << index[d])
        anc[k] = m
    desc = {k: 0 for k in kernels}
    for k in reversed(kernels):
        for d in deps[k]:
            desc[d] |= desc[k] | (1 << index[k])
    group = {k: k for k in kernels}
    mask = {k: 1 << index[k] for k in kernels}
    size = {k: 1 for k in kernels}

    def find(k: Any) -> Any:
        while group[k] is not k:
            group[k] = group[group[k]]
            k = group[k]
        return k

    sharing: dict = {}
    for k in kernels:
        if loop[k] is not None:
            for b in (*reads[k], k):
                sharing.setdefault(b, []).append(k)
    pairs = []
    for b, ks in sharing.items():
        ks = sorted(set(ks), key=pos.__getitem__)
        nbytes = -_nbytes(b)
        for i, a in enumerate(ks):
            for c in ks[i + 1:i + 1 + _MAX_KERNEL]:  # (inductor's pairwise attempts per buffer)
                pairs.append((nbytes, pos[c] - pos[a], pos[a], a, c))
    pairs.sort(key=lambda p: p[:3])
    for *_, a, c in pairs:
        ra, rc = find(a), find(c)
        if ra is rc or loop[ra] != loop[rc] or size[ra] + size[rc] > _MAX_KERNEL:
            continue
        m = mask[ra] | mask[rc]
        if (anc[ra] | anc[rc]) & (desc[ra] | desc[rc]) & ~m:
            continue  # a path from the one through other kernels to the other: fusing them makes a cycle
        if pos[rc] < pos[ra]:
            ra, rc = rc, ra
        group[rc] = ra
        mask[ra], size[ra] = m, size[ra] + size[rc]
        anc[ra] = (anc[ra] | anc[rc]) & ~m
        desc[ra] = (desc[ra] | desc[rc]) & ~m
    return {k: find(k) for k in kernels}


def _nbytes(n: Any) -> int:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return v.untyped_storage().nbytes() if isinstance(v, torch.Tensor) else 0


def estimate_graph(gm: torch.fx.GraphModule, device: torch.device, backend: str | None = None) -> tuple[int, str]:
    """``(peak bytes, the op at the peak)`` a traced graph allocates above its inputs when inductor runs it: its
    kernels (inductor's decomposition, inlining and fusion, as this module's notes describe) walked in order.

    ``backend`` (a process group backend name, ``"gloo"``/``"nccl"``) adds the internal buffers of its
    collectives (see ``_COLLECTIVES``).

    Example::

        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> from functrain.compiler.estimate import estimate_graph
        >>> gm = make_fx(lambda x: (x @ x).sin().sum(), tracing_mode="fake")(torch.ones(1024, 1024))
        >>> peak, at = estimate_graph(gm, torch.device("cpu"))
        >>> peak // 2**20, at          # x @ x: 4 MiB; its sine is computed inside the sum (a scalar)
        (4, 'sum')
    """
    g = _Graph(gm, device)
    kind, pos = g.kind, g.pos
    # the kernels: each extern op, each stored value of a generated kernel, each write into a buffer
    kernels = [n for n in g.nodes if kind[n] in ("extern", "store", "write") or (kind[n] == "inline" and g.stored[n])]
    reads = {k: set().union(*(g.loads.get(a, ()) for a in g.inputs(k))) for k in kernels}
    producer = {k: k for k in kernels}
    for n in g.nodes:
        if kind[n] == "item":
            producer[n] = producer.get(n.args[0], n.args[0])
    deps = {k: {producer[b] for b in reads[k] if b in producer} - {k} for k in kernels}

    def loop(k: Any) -> Any:  # a generated kernel's loop size (None: never fused: extern, scatter, concatenation)
        if kind[k] == "extern" or _name(k.target) in _STORE:
            return None
        if kind[k] == "store" and torch.Tag.reduction in getattr(k.target, "tags", ()):
            return max((_numel(b) for b in reads[k]), default=_numel(k))
        return _numel(k)

    group = _fuse(kernels, reads, deps, pos, {k: loop(k) for k in kernels})
    members: dict = {}
    for k in kernels:
        members.setdefault(group[k], []).append(k)
    order = _schedule(members, {r: {group[d] for k in ms for d in deps[k]} - {r} for r, ms in members.items()}, pos)
    step = {r: i for i, r in enumerate(order)}
    outputs = {g.base(a) for n in g.nodes if n.op == "output" for a in _args(n)}
    # the buffers: stored values (an extern op's outputs, its items), each read by which kernels
    size = {n: _round(_nbytes(n), device) for n in g.nodes if kind[n] in ("extern", "item", "store")
            or (kind[n] == "inline" and g.stored[n])}
    reads = {k: set(bs) for k, bs in reads.items()}
    for b in {b for k in kernels if k.target in _CONV for b in reads[k]}:  # channels-last copies
        v = b.meta.get("val")
        convs = sorted((k for k in kernels if k.target in _CONV and b in reads[k]), key=pos.__getitem__)
        if isinstance(v, torch.Tensor) and v.dim() >= 4 and producer.get(b) not in convs and \
                getattr(producer.get(b), "target", None) not in _CONV:
            for k in convs:  # each convolution reads a copy of its own, made with the value (or at the first)
                copy = ("channels-last", b, k)
                size[copy], producer[copy] = _round(_nbytes(b), device), producer.get(b, convs[0])
                reads[k].discard(b)
                reads[k].add(copy)
    readers: dict = {}
    for k in kernels:
        for b in reads[k]:
            readers.setdefault(b, set()).add(group[k])
    makes: dict = {r: [] for r in order}  # per kernel: the buffers it allocates (not those read only inside it)
    for b, nbytes in size.items():
        r = group.get(producer.get(b))
        if r is not None and nbytes and (kind.get(b) in ("extern", "item") or b in outputs or isinstance(b, tuple)
                                         or not readers.get(b, set()) <= {r}):
            makes[r].append(b)
    for r in order[1:]:  # a scatter into a constant fill: inductor fills its buffer early (see _filled_early)
        early = [b for b in makes[r] if _filled_early(b)]
        makes[r] = [b for b in makes[r] if b not in early]
        makes[order[0]].extend(early)
    made = {b for bs in makes.values() for b in bs}
    frees: dict = {}
    for b, rs in readers.items():
        if b in made and b not in outputs:
            frees.setdefault(max(step[r] for r in rs), []).append(b)
    live = peak = 0
    peak_at = "inputs"
    for i, r in enumerate(order):
        new = sum(size[b] for b in makes[r])
        live += new
        extra = 0
        if backend == "gloo" and kind[r] == "extern":
            extra = int(_COLLECTIVES.get(_name(r.target), 0.0) * sum(_nbytes(a) for a in g.inputs(r)))
        if live + extra > peak:
            peak, peak_at = live + extra, _origin(g, max(members[r], key=lambda k: size.get(k, 0)))
        live -= sum(size[b] for b in frees.get(i, ()))
        live -= sum(size[b] for b in makes[r] if b not in readers and b not in outputs)  # read by no one
    return int(peak * _MARGIN), peak_at


_FILLS = {"full", "zeros", "new_zeros", "full_like", "zeros_like", "new_full"}


def _filled_early(b: Any) -> bool:
    """Whether buffer ``b`` is a scatter into a constant fill (an embedding's gradient: zeros, then the rows
    added in): inductor writes the fill as a kernel of its own that reads nothing, and runs (or fuses) it with
    the first kernels, so the buffer exists from the start of the step (measured: a remat-ed transformer block's
    token-embedding gradient allocated in the forward pass's second kernel). The walk allocates it at the start."""
    if not isinstance(b, torch.fx.Node) or _name(b.target) not in _STORE or not b.args:
        return False
    base = b.args[0]
    return isinstance(base, torch.fx.Node) and base.op == "call_function" and _name(base.target) in _FILLS


def _numel(n: Any) -> int:
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return v.numel() if isinstance(v, torch.Tensor) else 0


def _origin(g: _Graph, n: Any) -> str:
    """The name of the captured op ``n`` comes from (``gelu_backward``, not the ``mul`` it was decomposed into)."""
    node = g.origin.get(n.meta.get("ft_origin"))
    return _name((node if node is not None and node.op == "call_function" else n).target)


def _schedule(members: dict, deps: dict, pos: dict) -> list:
    """Kernels in dependency order, the one holding the earliest node first (inductor's topological sort)."""
    first = {r: min(pos[k] for k in ms) for r, ms in members.items()}
    order, seen = [], set()
    for root in sorted(members, key=first.__getitem__):
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(sorted(deps[root], key=first.__getitem__)))]
        while stack:
            r, todo = stack[-1]
            d = next((d for d in todo if d not in seen), None)
            if d is None:
                stack.pop()
                order.append(r)
            else:
                seen.add(d)
                stack.append((d, iter(sorted(deps[d], key=first.__getitem__))))
    return order

