"""Repeated blocks traced once: a compiled step holds one graph per distinct block, called at every depth.

A transformer's 32 blocks are 32 copies of one computation, yet a step traced flat holds
32 copies of its forward and backward, and inductor passes over all of them: compile time
grows with depth. While ``ft.compile(step, reuse_blocks=True)`` (opt-in: the steady step ran 17-48 % slower
than the flat graph's in bench/depth.py) traces a step (:func:`reuse_blocks`), a module made
pure by :func:`functrain.functionalize` calls each of its *repeated blocks* through
``torch._higher_order_ops.invoke_subgraph`` (what ``torch.compiler.nested_compile_region``
asks Dynamo for): the first call of a block traces its graph, the others reuse it, and
AOTAutograd and inductor compile it once (its backward too, as a subgraph of its own). The
step stays one graph with no host sync; the numbers are the flat graph's.

Candidates (:func:`repeated_blocks`) are the children of one ``nn.ModuleList`` /
``nn.Sequential`` of one class with the same parameter and buffer names, shapes, dtypes and
devices, each a block with submodules of its own (not a lone layer: fusions across layers are
kept) and no hooks. Whether two calls share a graph is decided by what they compute, not by
their attributes (a ``layer_idx`` that only a cache reads must not split them, one that scales
the attention must): each call's forward is traced on its own first (a forward-only trace, a
fraction of the step's), and calls share the region when that graph's code and every input's
shape, stride, dtype, device and value are the same. That probe is made once per distinct set of the
block's attributes (private ones too, plain values by value, other objects by identity; blocks equal in
them compute the same), so blocks alike in everything are probed once, not once each. A call whose arguments are not plain
values runs inline. The grad stage differentiates with ``torch.autograd.grad`` while blocks are
reused (``invoke_subgraph`` has no ``torch.func`` rule). A step whose blocks cannot be traced
this way (an output that aliases an input, a tensor the block reads from outside its parameters
and arguments) is traced flat instead.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import weakref
from typing import Any, Callable, Iterator

import optree
import torch

__all__ = ["reuse_blocks", "active", "wanted", "repeated_blocks", "Blocks"]

_tls = threading.local()
_PLAIN = (type(None), bool, int, float, str)
_WITH_BLOCKS: "weakref.WeakSet[Blocks]" = weakref.WeakSet()  # functionalized modules that have repeated blocks


def wanted() -> bool:
    """Whether a module with repeated blocks was functionalized in this process (only then does a trace reuse
    blocks: the grad stage differentiates differently while it does)."""
    return bool(_WITH_BLOCKS)


def active() -> bool:
    """Whether repeated blocks are traced as reused regions now (inside :func:`reuse_blocks`, not inside a
    region's own trace)."""
    return getattr(_tls, "on", False) and not getattr(_tls, "inside", False)


@contextlib.contextmanager
def reuse_blocks(on: bool = True) -> Iterator[None]:
    """While a step is traced: the repeated blocks of functionalized modules are called as reused regions."""
    old = getattr(_tls, "on", False)
    _tls.on = on
    try:
        yield
    finally:
        _tls.on = old


@contextlib.contextmanager
def _inside() -> Iterator[None]:
    old = getattr(_tls, "inside", False)
    _tls.inside = True
    try:
        yield
    finally:
        _tls.inside = old


def _signature(module: torch.nn.Module) -> Any:
    """What two candidate blocks must share (their class and tensors' layout); ``None``: not a candidate
    (hooks anywhere in it). Whether they compute the same is checked on their traces (see the module)."""
    for m in module.modules():
        if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None)):
            return None
    tensors = tuple((n, tuple(x.shape), x.dtype, x.device.type, bool(x.requires_grad))
                    for n, x in [*module.named_parameters(remove_duplicate=False),
                                 *module.named_buffers(remove_duplicate=False)])
    return (type(module).__module__, type(module).__qualname__, tensors)


_MODULE_FIELDS = frozenset(vars(torch.nn.Module()))  # nn.Module's own bookkeeping (hooks: see _signature)


def _attributes(module: torch.nn.Module, ours: Any = None) -> tuple:
    """Every attribute of ``module`` and its submodules that is not ``nn.Module``'s own bookkeeping, private
    ones too (plain values by value, objects by identity): blocks equal in these compute the same, so one
    trace of one of them decides for all (no forward trace per block). ``ours``: the block's patched
    ``forward`` (:meth:`Blocks.patched`), left out."""
    out = []
    for path, m in module.named_modules():
        for name, value in sorted(vars(m).items()):
            if name in _MODULE_FIELDS or isinstance(value, (torch.nn.Module, torch.Tensor)) or value is ours:
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                out.append((path, name, value))
            else:
                out.append((path, name, "id", id(value)))
        out.append((path, type(m).__qualname__, m.training))
    return tuple(out)


def _probe(region: Callable, operands: list) -> str:
    """The code of ``region``'s forward alone, traced inside the step's trace (what a block's call computes)."""
    from torch._higher_order_ops.utils import reenter_make_fx

    with torch.no_grad():
        return reenter_make_fx(region)(*operands).code


def repeated_blocks(module: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """Groups (2 or more) of identical blocks among the children of each ``ModuleList`` / ``Sequential`` in
    ``module``, outermost first (a group's own descendants are not searched)."""
    groups: list[list[torch.nn.Module]] = []

    def visit(m: torch.nn.Module) -> None:
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            by_sig: dict = {}
            for child in m.children():
                if any(True for _ in child.children()) and any(True for _ in child.parameters()):
                    sig = _signature(child)
                    if sig is not None:
                        by_sig.setdefault(sig, []).append(child)
            found = [g for g in by_sig.values() if len(g) >= 2]
            if found:
                groups.extend(found)
                grouped = {id(c) for g in found for c in g}
                for child in m.children():
                    if id(child) not in grouped:
                        visit(child)
                return
        for child in m.children():
            visit(child)

    visit(module)
    return groups


class Blocks:
    """The repeated blocks of one module and, while a step is traced with :func:`reuse_blocks`, their calls
    through ``invoke_subgraph``. :meth:`patched` installs the per-block call for the duration of a call."""

    def __init__(self, module: torch.nn.Module):
        self.groups = repeated_blocks(module)
        self._keys = {}  # id(block) -> (hash of its group's signature, the block)
        for group in self.groups:
            key = hashlib.sha256(repr(_signature(group[0])).encode()).hexdigest()[:16]
            for block in group:
                self._keys[id(block)] = (key, block)
        self._idents: dict = {}  # (block attributes, call) -> region identifier, known without a probe trace
        self._outs: dict = {}  # region identifier -> [output treespec, its non-tensor leaves]
        if self.groups:
            _WITH_BLOCKS.add(self)

    def __bool__(self) -> bool:
        return bool(self.groups)

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        """Each repeated block's ``forward`` goes through :meth:`call` (restored afterwards)."""
        patched = []
        try:
            for key, block in self._keys.values():
                if "forward" in vars(block):  # someone else's instance override: leave that block alone
                    continue
                original = block.forward
                block.forward = self._forward(key, block, original)
                patched.append(block)
            yield
        finally:
            for block in patched:
                del block.forward

    def _forward(self, key: str, block: torch.nn.Module, original: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not active():
                return original(*args, **kwargs)
            return self.call(key, block, original, args, kwargs)

        return forward

    def call(self, key: str, block: torch.nn.Module, original: Callable, args: tuple, kwargs: dict) -> Any:
        """``block(*args, **kwargs)`` as ``invoke_subgraph(region, identifier, *tensors)``."""
        from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
        from torch.func import functional_call

        leaves, spec = optree.tree_flatten((args, kwargs), none_is_leaf=True)
        if not all(torch.is_tensor(x) or isinstance(x, _PLAIN) for x in leaves):
            return original(*args, **kwargs)  # an argument we cannot key on: inline
        structure: list = []  # (output treespec, its non-tensor leaves), as the region's trace found them
        names = [n for n, _ in block.named_parameters(remove_duplicate=False)] + \
                [n for n, _ in block.named_buffers(remove_duplicate=False)]
        own = [t for _, t in block.named_parameters(remove_duplicate=False)] + \
              [t for _, t in block.named_buffers(remove_duplicate=False)]
        positions = [i for i, x in enumerate(leaves) if torch.is_tensor(x)]
        consts = [(i, x) for i, x in enumerate(leaves) if not torch.is_tensor(x)]
        operands = [*own, *(leaves[i] for i in positions)]
        n_own = len(own)

        def region(*xs: torch.Tensor) -> tuple:
            full = list(leaves)
            for i, t in zip(positions, xs[n_own:]):
                full[i] = t
            a, kw = optree.tree_unflatten(spec, full)
            with _inside():
                out = functional_call(block, dict(zip(names, xs[:n_own])), a, kw, tie_weights=False, strict=False)
            out_leaves, out_spec = optree.tree_flatten(out, none_is_leaf=True)
            structure[:] = [out_spec, [(j, x) for j, x in enumerate(out_leaves) if not torch.is_tensor(x)]]
            return tuple(x for x in out_leaves if torch.is_tensor(x))

        metas = [(tuple(t.shape), t.stride(), str(t.dtype), str(t.device), t.requires_grad) for t in operands]
        call = (key, str(spec), repr(consts), repr(metas))
        known = (_attributes(block, vars(block).get("forward")), call)
        ident = self._idents.get(known)
        if ident is None:
            # what this call computes: its forward alone, traced (blocks that compute the same share a region,
            # whatever attributes their computation does not read); once per distinct set of attributes
            ident = "functrain_block_" + hashlib.sha256(repr((call, _probe(region, operands))).encode()).hexdigest()[:24]
            self._idents[known] = ident
        tensors = invoke_subgraph(region, ident, *operands)
        if structure:  # the region was traced in this call (probe or first use): keep what it returns
            self._outs[ident] = structure
        out_spec, others = self._outs[ident]
        fixed = dict(others)
        it = iter(tensors)
        out_leaves = [fixed[j] if j in fixed else next(it) for j in range(out_spec.num_leaves)]
        return optree.tree_unflatten(out_spec, out_leaves)
