"""A module built on no device (the meta device), and its initialisation replayed one submodule at a time.

A module built under ``with ft.init_empty(seed=0):`` (or ``with torch.device("meta"):``) holds tensors with shapes
and dtypes but no memory. :func:`functrain.functionalize` gives its params and buffers as such meta tensors and
keeps a record of where each comes from (:class:`EmptyModule`, found again by :func:`empty_source`), so that a
params-sharded ``step.init`` (``data_parallel(shard="params")``) makes only this rank's shard of them.

How a module's initialisation is replayed (:meth:`EmptyModule.materialise`): each module that holds tensors itself
(its own parameters and buffers, not its children's), in ``model.modules()`` order, gets real empty tensors on the
device, its ``reset_parameters()`` runs on them, the caller keeps what it needs of them (a rank: the elements in its
slice), and they are dropped before the next module's. So at most one module's own tensors exist at a time, and the
global generator is drawn as a normal build draws it when that build initialises each module's tensors with the
module's ``reset_parameters()`` in module order: what the ``torch.nn`` layers (``Linear``, ``Conv*``,
``Embedding``, the norms) do in their ``__init__``, for a model made of them. The promise, exactly: the tensors equal
(bitwise) those of the same model built normally on the device after ``torch.manual_seed(seed)`` (``seed`` of
``init_empty``), or, without a seed, from the global generator as it is when the replay starts, as long as

* every module that holds tensors itself has a ``reset_parameters()`` that sets all of them (refused by name
  otherwise: one that leaves a floating tensor unset is found, its tensors being NaN beforehand), reads and writes
  no other module's tensors (refused: they are still meta while it runs), and draws as the module's ``__init__``
  drew;
* the normal build initialises the modules in ``model.modules()`` order: a module's own tensors before those of the
  modules registered after it (a parent holding tensors whose ``__init__`` draws for them only after building its
  children, or a model-wide ``model.apply(init_fn)`` after construction, is not replayed; Hugging Face models, whose
  ``post_init`` re-initialises every weight, are refused by name);
* weights tied after construction keep the first module's initialisation (the later module still draws for its own,
  as it did in the normal build, and that draw is dropped).

The caller's global generators are left as they were (a normal build would have advanced them).
"""
from __future__ import annotations

import contextlib
import math
import sys
import weakref
from typing import Any, Callable, Iterator

import optree
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from .validate import path_str

__all__ = ["EmptyModule", "empty_source", "init_empty"]


class Build:
    """One ``ft.init_empty`` block: the seed and device its modules' tensors are made with."""

    __slots__ = ("seed", "device")

    def __init__(self, seed: int | None, device: torch.device | None):
        self.seed, self.device = seed, device


# a meta parameter or buffer registered on a module inside an init_empty block -> that block
_BUILDS: Any = WeakIdKeyDictionary()
# a meta tensor that ft.functionalize gave -> (its EmptyModule, its name in the module)
_OWNERS: Any = WeakIdKeyDictionary()


@contextlib.contextmanager
def init_empty(seed: int | None = None, device: Any = None) -> Iterator[None]:
    """Build modules on no device: inside the block, ``torch.nn`` modules are made on the meta device (shapes and
    dtypes, no memory, no random draws), as under ``with torch.device("meta"):``.

    A params-sharded ``step.init`` (``ft.data_parallel(shard="params")``) then makes only this rank's shard of the
    params, with each module's own ``reset_parameters()``, equal (bitwise) to the model built normally on
    ``device`` after ``torch.manual_seed(seed)`` (see :mod:`functrain.core.empty` for the exact promise). The
    whole model never exists on any rank.

    Args:
        seed: the seed a normal build would have been preceded by (``torch.manual_seed(seed)``); ``None`` (the
            default): rank 0's global generator as it is when ``step.init`` runs (the plain
            ``with torch.device("meta"):`` case).
        device: where the shards are made (default ``None``: ``ft.distributed.device()``, the rank's GPU or the CPU).

    Raises:
        ValueError: a ``seed`` that is not an int in ``[0, 2**63)``, or a ``device`` that is the meta device.

    Example::

        >>> import torch, functrain as ft
        >>> with ft.init_empty(seed=0):
        ...     model = torch.nn.Linear(1024, 1024)
        >>> model.weight.is_meta
        True
    """
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
        raise ValueError(f"init_empty: seed must be an int in [0, 2**63) or None; got {seed!r}")
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type == "meta":
        raise ValueError("init_empty: device is where the shards are made; the meta device holds no values. "
                         "Give a real device (\"cpu\", \"cuda:0\") or None for ft.distributed.device()")
    build = Build(seed, dev)

    def record(module: torch.nn.Module, name: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            _BUILDS[tensor] = build

    from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                         register_module_parameter_registration_hook)

    handles = [register_module_parameter_registration_hook(record), register_module_buffer_registration_hook(record)]
    try:
        with torch.device("meta"):
            yield
    finally:
        for h in handles:
            h.remove()


class _Touches(TorchFunctionMode):
    """Sees whether a torch function reads or writes a meta tensor: while one module's reset_parameters runs, only
    its own tensors are real, so a meta one belongs to another module. (A function mode, not a dispatch mode: on
    torch 2.13 a TorchDispatchMode kept every tensor it saw alive, the whole model's worth.)"""

    def __init__(self) -> None:
        super().__init__()
        self.touched = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(isinstance(x, torch.Tensor) and x.is_meta for x in optree.tree_leaves((args, kwargs))):
            self.touched = True
        return func(*args, **kwargs)


def _unset(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor like ``t`` filled with what no initialiser leaves: NaN, or an integer type's least value."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(math.nan)
    if t.dtype != torch.bool:
        return t.fill_(torch.iinfo(t.dtype).min)
    return t


def _still_unset(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).min).all())


class EmptyModule:
    """What :func:`functrain.functionalize` records of a module whose tensors are on the meta device: the module
    (weakly), and the seed and device of the ``ft.init_empty`` block it was built in (``None``, ``None`` for a
    plain ``torch.device("meta")`` build). :meth:`materialise` replays its initialisation."""

    __slots__ = ("_module", "seed", "device", "__weakref__")

    def __init__(self, module: torch.nn.Module, seed: int | None, device: torch.device | None):
        self._module = weakref.ref(module)
        self.seed, self.device = seed, device

    @classmethod
    def record(cls, module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> "EmptyModule | None":
        """The record of ``module`` when any of its tensors is meta (``None`` otherwise), with each meta tensor of
        ``tensors`` (functionalize's detached ``{name: tensor}``, params and buffers) noted as coming from it."""
        own = [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]
        if not any(t.is_meta for t in own):
            return None
        builds = {id(b): b for b in (_BUILDS.get(t) for t in own if t.is_meta) if b is not None}
        if len(builds) > 1:
            raise ValueError(f"functionalize: {type(module).__name__} was built in {len(builds)} ft.init_empty "
                             f"blocks (with seeds {sorted(str(b.seed) for b in builds.values())}): one block, one "
                             f"seed, builds one model")
        build = next(iter(builds.values()), None)
        made = cls(module, None if build is None else build.seed, None if build is None else build.device)
        for name, t in tensors.items():
            if t.is_meta:
                _OWNERS[t] = (made, name)
        return made

    @property
    def module(self) -> torch.nn.Module:
        """The module (raises when it was deleted: the replay needs its ``reset_parameters``)."""
        module = self._module()
        if module is None:
            raise RuntimeError("the module these meta params were functionalized from was deleted: its "
                               "initialisation cannot be replayed; keep the model (or apply_fn) alive until "
                               "step.init has run")
        return module

    def owners(self) -> list[tuple[str, torch.nn.Module]]:
        """The modules that hold tensors themselves, in ``model.modules()`` order, checked: a ``ValueError`` names
        every one that cannot be replayed and says what to do."""
        root = self.module
        hf = sys.modules.get("transformers")
        if hf is not None and isinstance(root, hf.PreTrainedModel):
            raise ValueError(f"{type(root).__name__} is a Hugging Face model: its post_init() re-initialises every "
                             f"weight (_init_weights) after the modules are built, which functrain does not replay "
                             f"from the meta device. Build it normally and shard it (data_parallel(shard='params') "
                             f"with real params), or load its pretrained weights")
        out, bad = [], []
        for prefix, m in root.named_modules():
            held = [n for n, t in m._parameters.items() if t is not None]
            held += [n for n, t in m._buffers.items() if t is not None]
            if not held:
                continue
            if not callable(getattr(type(m), "reset_parameters", None)):
                bad.append(f"{prefix or '(the root)'} ({type(m).__name__}, holding {held})")
            out.append((prefix, m))
        if bad:
            raise ValueError(
                f"cannot initialise a model built on the meta device one module at a time: these modules hold "
                f"tensors themselves but have no reset_parameters(): {'; '.join(bad)}. Give each such class a "
                f"reset_parameters() that initialises the tensors it holds itself (not its children's), drawing as "
                f"its __init__ does, and call it at the end of __init__ (as torch.nn.Linear does); or build the model "
                f"normally and shard it (data_parallel(shard='params') with real params)")
        return out

    def materialise(self, keep: Callable[[str, torch.Tensor], None], device: torch.device,
                    rng_state: list[torch.Tensor] | None = None) -> None:
        """Replay the module's initialisation on ``device``, one module at a time, calling ``keep(name, tensor)``
        for each of its tensors (``name`` as ``named_parameters()`` / ``named_buffers()`` give it: a tied tensor
        once, from its first module) right after its module's ``reset_parameters()``; the tensor is dropped after
        (``keep`` copies what it needs). The module itself stays on the meta device.

        The global generators draw from ``torch.manual_seed(self.seed)``, or from ``rng_state`` (the CPU
        generator's state, then ``device``'s when it is a GPU) without a seed, and are restored after."""
        owners = self.owners()
        gpus = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        with torch.random.fork_rng(devices=gpus):
            if self.seed is not None:
                torch.manual_seed(self.seed)
            elif rng_state is not None:
                torch.set_rng_state(rng_state[0])
                if gpus:
                    torch.cuda.set_rng_state(rng_state[1], gpus[0])
            done: set[int] = set()
            for prefix, m in owners:
                self._reset_one(prefix, m, device, done, keep)

    @staticmethod
    def _reset_one(prefix: str, m: torch.nn.Module, device: torch.device, done: set[int],
                   keep: Callable[[str, torch.Tensor], None]) -> None:
        saved = (dict(m._parameters), dict(m._buffers))
        real: dict[str, torch.Tensor] = {}
        try:
            for table in (m._parameters, m._buffers):
                for n, t in list(table.items()):
                    if t is None:
                        continue
                    if not t.is_meta:
                        raise ValueError(f"{prefix}.{n} ({type(m).__name__}) is not on the meta device while other "
                                         f"tensors of the model are: build the whole model under ft.init_empty() "
                                         f"(or torch.device('meta')), or all of it normally")
                    x = _unset(torch.empty(t.shape, dtype=t.dtype, device=device))
                    if isinstance(t, torch.nn.Parameter):
                        x = torch.nn.Parameter(x, requires_grad=t.requires_grad)
                    table[n] = real[n] = x
            touches = _Touches()
            with torch.no_grad(), touches:
                m.reset_parameters()
            where = f"{prefix or '(the root)'} ({type(m).__name__})"
            if touches.touched:
                raise ValueError(f"{where}: its reset_parameters() reads or writes a tensor of another module, which "
                                 f"is still on the meta device while this module's are made: a replay one module "
                                 f"at a time would lose that. Initialise each module's tensors in its own "
                                 f"reset_parameters(), or build the model normally and shard it")
            for n, x in real.items():
                first = id(saved[0].get(n, saved[1].get(n)))
                if first in done:  # a tensor tied to an earlier module: its first initialisation stands
                    continue
                if _still_unset(x):
                    raise ValueError(f"{where}: reset_parameters() left {n!r} unset; it must set every tensor "
                                     f"the module holds itself (compute a buffer such as a rotary table there "
                                     f"too), or build the model normally and shard it")
                done.add(first)
                keep(f"{prefix}.{n}" if prefix else n, x.detach())
        finally:
            m._parameters.clear()
            m._parameters.update(saved[0])
            m._buffers.clear()
            m._buffers.update(saved[1])


def empty_source(tree: Any, what: str = "params") -> tuple[EmptyModule, list[str]] | None:
    """The :class:`EmptyModule` that the meta tensors of ``tree`` come from and their names in it, in pytree order
    (``None`` when no leaf is meta). Raises ``ValueError`` naming the leaf when ``tree`` mixes meta and real
    tensors, holds a meta tensor that ``ft.functionalize`` did not give, or comes from two modules."""
    leaves = optree.tree_leaves(tree)
    paths = [path_str(p) for p in optree.tree_paths(tree)]
    meta = [torch.is_tensor(x) and x.is_meta for x in leaves]
    if not any(meta):
        return None
    if not all(meta):
        real = paths[meta.index(False)]
        raise ValueError(f"{what} mix tensors on the meta device with real ones ({real!r} is real): build the whole "
                         f"model under ft.init_empty() (or torch.device('meta')) or all of it normally")
    found, names = None, []
    for path, x in zip(paths, leaves):
        owner = _OWNERS.get(x)
        if owner is None:
            raise ValueError(f"{what} leaf {path!r} is on the meta device but was not given by ft.functionalize of a "
                             f"module built there, so nothing says how to initialise it: pass the tensors "
                             f"ft.functionalize(model) returns")
        if found is not None and owner[0] is not found:
            raise ValueError(f"{what} come from two modules built on the meta device ({path!r} is from the second): "
                             f"functionalize the one model and pass its params")
        found = owner[0]
        names.append(owner[1])
    return found, names
