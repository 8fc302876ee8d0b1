"""A population: ``n`` runs of one step trained together by one (compiled) step, built with ``torch.func.vmap``.

``ft.population(n, batch=...)(step)`` turns ``step(state, batch)`` into a step over a *population state*: a
:class:`~functrain.TrainState` whose params, buffers, optimizer state and transform slots (loss scale, EMA,
accumulation windows, counters) carry a leading axis of ``n`` members. Each member trains as its own run: the
step is ``vmap`` of the member's step, so every transform keeps its meaning per member (``clip`` clips each
member by its own norm, an fp16 member's overflow skips only its update and backs off only its scale).

Two fields stay shared, by design: ``state.step`` (the count of calls: one call steps every member) and
``state.rng`` (one key; under ``vmap`` with ``randomness="different"`` every member draws its own numbers from
it). Both are what the host-side machinery (the RNG hand-over, ``ft.compile``'s runner, ``ft.run``) reads as one
value. :func:`member` gives member ``i`` as an ordinary state of the inner step.

``ft.data_parallel()`` composes: every rank holds every member, and the members' gradients are all-reduced in one
collective (:func:`_batch_collectives`). A sharded data-parallel step is refused.

Per-member hyper-parameters are the state's values with the member axis: ``ft.set_hyper(state, lr=lrs)`` with
``lrs`` of shape ``(n,)`` (weight decay, clip norm, EMA decay alike).

The law (tests/transforms/test_population.py): member ``i`` of a population equals a single run of the inner
step from member ``i``'s initial state and hyper-parameters, to float rounding, eager and compiled, on 1 and 2
processes. Random draws are the exception: a member's draws are its own but not those a single run with its seed
makes (vmap draws one batched tensor).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Sequence

import optree
import torch

from ..core import tree as T
from ..core.checks import check_batch
from ..core.eager import tracing
from ..core.rng import rng_init, with_rng
from ..core.state import TrainState
from ..core.step import Step
from ..core.transform import Transform
from ..core.validate import BadValue

__all__ = ["Population", "population", "member", "PopulationError"]

BATCHES = ("shared", "per_member")
RANDOMNESS = ("different", "same", "error")


class PopulationError(BadValue):
    """A step, a transform or a state that a population cannot take, named (a ``TypeError`` and a ``ValueError``).

    Example::

        >>> import functrain as ft
        >>> issubclass(ft.PopulationError, ValueError)
        True
    """


def _uses(t: Transform, hook: str) -> bool:
    return getattr(type(t), hook) is not getattr(Transform, hook)


def _refusal(t: Transform) -> str | None:
    """Why ``t`` cannot run inside ``vmap`` (``None``: it can). Decided from what a transform declares."""
    if t.shards_state:
        return (f"{t!r} shards the state over processes (shards_state=True), cutting flat buffers that a "
                f"population's member axis would cut across; a data-parallel population is replicated: "
                f"ft.data_parallel() (shard='none'), each rank holding every member")
    return None


def _talks(t: Transform) -> bool:
    """Whether ``t`` talks to other processes (a data-parallel transform: it implements ``reduce``, ``agree`` or
    ``rng_offset``)."""
    return any(_uses(t, hook) for hook in ("reduce", "agree", "rng_offset"))


_BATCHED_COLLECTIVES: list = []  # the torch.library that holds the rules below, once made (kept alive)


def _batch_collectives() -> None:
    """Give torch's functional all-reduce a ``vmap`` rule: the all-reduce of the batched tensor as it is.

    An all-reduce is elementwise over the ranks, so reducing the stacked ``(n, ...)`` gradients of every member in
    one collective is each member's own all-reduce: one collective per dtype for the whole population. torch has
    no such rule (its fallback refuses collectives); registered once, when the first population of a step with a
    data-parallel transform is made (a change to torch's dispatcher for this process: only ``vmap`` of these two
    ops is affected)."""
    if _BATCHED_COLLECTIVES:
        return
    import torch.distributed._functional_collectives  # noqa: F401 - defines the _c10d_functional ops

    lib = torch.library.Library("_c10d_functional", "FRAGMENT")

    def all_reduce(info: Any, in_dims: tuple, x: torch.Tensor, op: str, group: str) -> tuple:
        return torch.ops._c10d_functional.all_reduce(x, op, group), in_dims[0]

    def wait_tensor(info: Any, in_dims: tuple, x: torch.Tensor) -> tuple:
        return torch.ops._c10d_functional.wait_tensor(x), in_dims[0]

    def wrap(info: Any, in_dims: tuple, x: torch.Tensor) -> tuple:
        return torch.ops._c10d_functional._wrap_tensor_autograd(x), in_dims[0]

    rules = {"all_reduce": all_reduce, "wait_tensor": wait_tensor, "_wrap_tensor_autograd": wrap}
    for name, rule in rules.items():
        if hasattr(torch.ops._c10d_functional, name):
            torch.library.register_vmap(f"_c10d_functional::{name}", rule, lib=lib)
    _BATCHED_COLLECTIVES.append(lib)


class Population(Step):
    """``n`` members of ``step`` trained as one step (see the module docstring); made by :func:`population`.

    Attributes:
        inner: the member's step (a plain :class:`~functrain.Step`).
        n: how many members.
        batch: ``"shared"`` (every member sees the same batch) or ``"per_member"`` (every tensor of the batch has
            a leading axis of ``n``: member ``i`` sees ``batch[i]``).
        randomness: ``vmap``'s ``randomness``: ``"different"`` (each member its own draws), ``"same"`` (one draw
            shared by every member) or ``"error"`` (a random op in the step is refused).

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
        >>> pop = ft.population(3, batch="shared")(step)
        >>> state = pop.init(lambda seed: {"w": torch.full((2,), float(seed))}, seeds=[0, 1, 2])
        >>> state, metrics = pop(state, torch.ones(2))
        >>> metrics["loss"], ft.member(state, 2).params["w"]
        (tensor([0., 2., 4.]), tensor([1.9000, 1.9000]))
    """

    inner: Step
    n: int
    batch: str
    randomness: str

    def __init__(self, step: Step, n: int, *, batch: str, randomness: str = "different"):
        if isinstance(step, Population):
            raise PopulationError(f"population: {step!r} is a population already; a population of populations is "
                                  f"not supported (make one population of n * m members)")
        if not isinstance(step, Step):
            raise PopulationError(f"population takes a functrain Step (from ft.train_step); got "
                                  f"{type(step).__name__}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PopulationError(f"population: n must be an int >= 1 (the number of members); got {n!r}")
        if batch not in BATCHES:
            raise PopulationError(f"population: batch must be 'shared' (every member gets the same batch) or "
                                  f"'per_member' (each batch tensor has a leading axis of n); got {batch!r}")
        if randomness not in RANDOMNESS:
            raise PopulationError(f"population: randomness must be one of {', '.join(map(repr, RANDOMNESS))} "
                                  f"(torch.func.vmap's); got {randomness!r}")
        for t in step.transforms:
            why = _refusal(t)
            if why is not None:
                raise PopulationError(f"population: cannot vmap the step's transform {t.name!r}: {why}")
        super().__init__(step.loss_fn, step.optimizer, step.transforms)
        self.inner, self.n, self.batch, self.randomness = step, n, batch, randomness
        # a data-parallel step: its collectives run batched (one all-reduce for every member), and its eager
        # step takes the traced path inside the vmap (torch's functional collectives, not c10d's in-place ones)
        self._collective = any(_talks(t) for t in step.transforms)
        if self._collective:
            _batch_collectives()

    # -- building ---------------------------------------------------------------------------
    def with_transform(self, transform: Transform) -> "Population":
        """The population of the inner step with ``transform`` added: a transform applied to a population acts
        per member, wherever it is applied."""
        return Population(self.inner.with_transform(transform), self.n, batch=self.batch,
                          randomness=self.randomness)

    def __repr__(self) -> str:
        return f"population({self.n}, batch={self.batch!r})({self.inner!r})"

    # -- state ------------------------------------------------------------------------------
    def init(self, params: Any, buffers: Any = None, *, seeds: Iterable[int] | None = None, seed: int | None = 0,
             flat: bool | str = False) -> TrainState:
        """The population's initial state: member ``i`` is ``inner.init(params_i, buffers_i)``, stacked.

        ``params`` is one of:

        * an ``nn.Module``: each member is a copy of it re-initialised under ``torch.manual_seed(seeds[i])``
          (``reset_parameters()`` of every submodule that has one), then :func:`functrain.functionalize`\\ d;
        * a function ``make(seed) -> params`` or ``-> (params, buffers)``: member ``i`` is ``make(seeds[i])``;
        * a params tree (with ``buffers``): every member starts from a copy of it (a sweep over hyper-parameters
          from one initialisation).

        ``seeds`` (default ``range(n)``) are the members' initialisation seeds; ``seed`` the population's RNG
        key (``state.rng``, shared: see the module docstring; ``None``: torch's global RNG). ``flat`` is
        :meth:`functrain.Step.init`'s. To stack states made elsewhere (checkpoints, other runs) use :meth:`stack`.

        Example::

            >>> import torch, functrain as ft
            >>> model = torch.nn.Linear(3, 1)
            >>> apply_fn, _, _ = ft.functionalize(model)
            >>> loss = lambda p, b, x: apply_fn(p, b, x).pow(2).mean()
            >>> pop = ft.population(4, batch="shared")(ft.train_step(loss, ft.optim.adamw(1e-2)))
            >>> state = pop.init(model, seeds=[10, 11, 12, 13])
            >>> state.params["weight"].shape, bool((state.params["weight"][0] != state.params["weight"][1]).any())
            (torch.Size([4, 1, 3]), True)
        """
        seeds = list(range(self.n)) if seeds is None else [int(s) for s in seeds]
        if len(seeds) != self.n:
            raise PopulationError(f"population.init: {len(seeds)} seeds for a population of {self.n}; give one "
                                  f"seed per member")
        members = [self._member_init(params, buffers, s, flat) for s in seeds]
        return self.stack(members, seed=seed)

    def _member_init(self, params: Any, buffers: Any, seed: int, flat: bool | str) -> TrainState:
        if isinstance(params, torch.nn.Module):
            from ..core.module import functionalize  # (core; the module's own init, re-run under the seed)
            model = copy.deepcopy(params)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for m in model.modules():
                    reset = getattr(m, "reset_parameters", None)
                    if callable(reset):
                        reset()
            _, p, b = functionalize(model)
            return self.inner.init(p, b, seed=None, flat=flat)
        if callable(params) and not isinstance(params, (dict, list, tuple)):
            made = params(seed)
            if isinstance(made, tuple) and len(made) == 2 and not isinstance(made, TrainState):
                return self.inner.init(made[0], made[1], seed=None, flat=flat)
            return self.inner.init(made, buffers, seed=None, flat=flat)
        copied = T.tree_map(lambda x: x.clone() if torch.is_tensor(x) else x, (params, buffers))
        return self.inner.init(copied[0], copied[1], seed=None, flat=flat)

    def stack(self, states: Sequence[TrainState], *, seed: int | None | str = "first") -> TrainState:
        """``n`` states of the inner step (its ``init``, :func:`member`, a loaded checkpoint) as one population.

        Every state must have the inner step's structure and the same ``step`` count. ``seed``: the
        population's RNG key, ``"first"`` (default) the first state's, an int a new key, ``None`` none.

        Example::

            >>> import torch, functrain as ft
            >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
            >>> pop = ft.population(2, batch="shared")(step)
            >>> state = pop.stack([step.init({"w": torch.zeros(2)}), step.init({"w": torch.ones(2)})])
            >>> state.params["w"]
            tensor([[0., 0.],
                    [1., 1.]])
        """
        states = list(states)
        if len(states) != self.n:
            raise PopulationError(f"population.stack: {len(states)} states for a population of {self.n}")
        for i, s in enumerate(states):
            self.inner.check_state(s)
            if optree.tree_structure(_members_part(s)) != optree.tree_structure(_members_part(states[0])):
                raise PopulationError(f"population.stack: state {i} has another structure than state 0 "
                                      f"(different params, optimizer state or slots)")
        counts = {int(s.step) for s in states}  # (init-time: a host read per state is fine)
        if len(counts) != 1:
            raise PopulationError(f"population.stack: the states have taken different numbers of steps "
                                  f"({sorted(counts)}); a population's members step together")
        parts = [_members_part(s) for s in states]
        bad = [type(x).__name__ for x in optree.tree_leaves(parts[0]) if not torch.is_tensor(x)]
        if bad:
            raise PopulationError(f"population.stack: the state holds non-tensor leaves ({', '.join(bad)}); a "
                                  f"population stacks tensors only")
        stacked = optree.tree_map(lambda *xs: torch.stack(xs), *parts)
        if seed == "first":
            rng = states[0].rng
        else:
            rng = None if seed is None else rng_init(seed, states[0].step.device)
        return TrainState(*stacked[:3], step=states[0].step.clone(), rng=rng, slots=stacked[3])

    def check_state(self, state: Any) -> None:
        """:meth:`functrain.Step.check_state` of the inner step, and every member leaf's leading axis is ``n``.

        Example::

            >>> import torch, functrain as ft
            >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
            >>> ft.population(2, batch="shared")(step).check_state(step.init({"w": torch.ones(3)}))
            Traceback (most recent call last):
            ...
            functrain.transforms.population.PopulationError: population of 2: state leaf state.params['w'] has shape (3,); ...
        """
        self.inner.check_state(state)
        part = _members_part(state)
        for path, x in zip(optree.tree_paths(part), optree.tree_leaves(part)):
            if not torch.is_tensor(x) or x.dim() == 0 or x.shape[0] != self.n:
                where = _FIELDS[path[0]] + "".join(f"[{k!r}]" for k in path[1:])
                got = f"shape {tuple(x.shape)}" if torch.is_tensor(x) else f"a {type(x).__name__}"
                raise PopulationError(f"population of {self.n}: state leaf {where} has {got}; every member leaf "
                                      f"has a leading axis of {self.n} (a state from this population's init or "
                                      f"stack; ft.member(state, i) gives one member's ordinary state)")

    def _check_batch(self, batch: Any) -> None:
        check_batch(batch)
        if self.batch == "per_member":
            for path, x in zip(optree.tree_paths(batch), optree.tree_leaves(batch)):
                if torch.is_tensor(x) and (x.dim() == 0 or x.shape[0] != self.n):
                    raise PopulationError(f"population of {self.n} with batch='per_member': batch leaf {list(path)} "
                                          f"has shape {tuple(x.shape)}; each tensor needs a leading axis of "
                                          f"{self.n} (member i gets x[i]). Use batch='shared' to give every "
                                          f"member the same batch")

    # -- running ----------------------------------------------------------------------------
    def host_call(self, fn: Callable, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """The inner step's host work around ``fn`` (checks, the RNG hand-over), with the population's checks."""
        self.check_state(state)
        self._check_batch(batch)
        return with_rng(fn, state, batch, self.rng_offset())

    def apply(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        """The pure population step: ``vmap`` of the inner step's :meth:`~functrain.Step.apply` over the members.

        What ``ft.compile`` traces (``make_fx`` traces through ``vmap`` and ``grad`` to one graph)."""
        inner, count = self.inner, state.step
        # vmap over flat tensor lists (optree's flattening: a None in an optimizer state is no leaf, and the
        # batch's Python numbers stay shared)
        leaves, spec = optree.tree_flatten(_members_part(state))
        batch_leaves, batch_spec = optree.tree_flatten(batch)

        def one(leaves: list, batch_leaves: list) -> tuple:
            params, buffers, opt_state, slots = optree.tree_unflatten(spec, leaves)
            batch = optree.tree_unflatten(batch_spec, batch_leaves)
            with _ForeachAsLoops():
                new, metrics = inner.apply(TrainState(params, buffers, opt_state, count, None, slots), batch)
            out, out_spec = optree.tree_flatten((new.params, new.buffers, new.opt_state, new.slots))
            if out_spec != spec:
                raise PopulationError(f"population: the inner step returned a state of another structure than it "
                                      f"was given ({out_spec} != {spec})")
            return out, metrics

        per_member = self.batch == "per_member"
        batch_dims = [0 if per_member and torch.is_tensor(x) else None for x in batch_leaves]
        vmapped = torch.func.vmap(one, in_dims=(0, batch_dims), randomness=self.randomness)
        try:
            if self._collective and not tracing():
                from ..compiler.capture import _compiling  # (the flag a trace sets: the functional collectives)
                with _compiling():
                    out, metrics = vmapped(leaves, batch_leaves)
            else:
                out, metrics = vmapped(leaves, batch_leaves)
        except Exception as e:
            raise self._explain(e) from e
        params, buffers, opt_state, slots = optree.tree_unflatten(spec, out)
        return TrainState(params, buffers, opt_state, count + 1, state.rng, slots), metrics

    def _explain(self, error: Exception) -> Exception:
        """``error`` raised inside ``vmap``: named by the transform (or the loss function) whose code raised it,
        when the message is torch.func's (a host read, an in-place op on an unbatched tensor, ...)."""
        if isinstance(error, PopulationError) or "vmap" not in str(error) and "functorch" not in str(error):
            return error
        tb, culprit = error.__traceback__, None
        while tb is not None:  # the innermost frame that is a transform's method
            me = tb.tb_frame.f_locals.get("self")
            if isinstance(me, Transform) and me in self.inner.transforms:
                culprit = f"transform {me.name!r} ({type(me).__qualname__}.{tb.tb_frame.f_code.co_name})"
            tb = tb.tb_next
        what = culprit or "the step (its loss function or optimizer)"
        return PopulationError(f"population: {what} cannot run under torch.func.vmap: {error}. Every hook must be "
                               f"written as for a compiled step (tensor ops and torch.where, no .item(), no Python "
                               f"branch on a tensor, no in-place write into a tensor it did not make)")


class _ForeachAsLoops(torch.overrides.TorchFunctionMode):
    """``torch._foreach_*`` calls as loops of their per-tensor op, inside the population's ``vmap``.

    ``vmap`` has no batching rule for several foreach ops (``_foreach_norm``: "could not generate a fallback"),
    and where it falls back it runs the op once per member (in a traced graph: ``n`` copies). The per-tensor
    ops all batch; traced, inductor fuses them as it fuses a foreach op's own decomposition."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not name.startswith("_foreach_"):
            return func(*args, **kwargs)
        op = name[len("_foreach_"):]
        lists = [a for a in args if isinstance(a, (list, tuple))]
        n = len(lists[0]) if lists else 0
        columns = [a if isinstance(a, (list, tuple)) else [a] * n for a in args]
        rows = [_like_first(row) for row in zip(*columns)] if columns else [()] * n
        if op.endswith("_"):  # in place: computed out of place and copied in (vmap batches copy_, not addcmul_)
            out_of_place = getattr(torch, op[:-1], None)
            for row in rows:
                if out_of_place is None:
                    getattr(row[0], op)(*row[1:], **kwargs)
                else:
                    row[0].copy_(out_of_place(*row, **kwargs))
            return None
        if op == "norm":
            ord_ = kwargs.pop("ord", 2) if len(args) < 2 else None
            return [torch.linalg.vector_norm(row[0], row[1] if len(row) > 1 else ord_, **kwargs) for row in rows]
        fn = getattr(torch, op)
        return [fn(*row, **kwargs) for row in rows]


def _like_first(row: tuple) -> tuple:
    """A foreach op's scalar arguments given as 0-dim tensors (a hyper-parameter in the state: float64, and a
    member's own value under vmap) in the dtype of the tensor they scale, as the foreach op takes a scalar: the
    per-tensor ops (``lerp``, ``addcmul``) want one dtype."""
    first = row[0]
    if not torch.is_tensor(first):
        return row
    return tuple(x.to(first.dtype) if i and torch.is_tensor(x) and x.dim() == 0 and x.dtype != first.dtype
                 and x.is_floating_point() and first.is_floating_point() else x for i, x in enumerate(row))


_FIELDS = ("state.params", "state.buffers", "state.opt_state", "state.slots")


def _members_part(state: TrainState) -> tuple:
    """What has a member axis: ``(params, buffers, opt_state, slots)`` (``step`` and ``rng`` are shared)."""
    return (state.params, state.buffers, state.opt_state, state.slots)


def population(n: int, *, batch: str, randomness: str = "different") -> Callable[[Step], Population]:
    """``n`` runs of a step trained as one step: ``ft.population(n, batch=...)(step)`` is a :class:`Population`.

    Args:
        n: the number of members.
        batch: ``"shared"`` (each call's batch goes to every member) or ``"per_member"`` (every tensor in the
            batch has a leading axis of ``n``); no default: say which.
        randomness: ``torch.func.vmap``'s: ``"different"`` (default: each member draws its own dropout masks and
            noise), ``"same"``, or ``"error"``.

    Returns:
        A function ``step -> Population``; transforms applied before or after act per member alike.

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.clip(1.0)(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
        >>> pop = ft.population(8, batch="per_member")(step)
        >>> state = pop.init({"w": torch.zeros(2)})
        >>> state, metrics = ft.compile(pop)(state, torch.randn(8, 2))
        >>> metrics["loss"].shape, state.params["w"].shape
        (torch.Size([8]), torch.Size([8, 2]))
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PopulationError(f"population: n must be an int >= 1 (the number of members); got {n!r}")

    def wrap(step: Step) -> Population:
        return Population(step, n, batch=batch, randomness=randomness)

    return wrap


def member(state: TrainState, i: int) -> TrainState:
    """Member ``i`` of a population state as an ordinary state of the inner step (new tensors: train it alone,
    checkpoint it, export its weights). ``step`` and ``rng`` are the population's (shared).

    Example::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
        >>> state = ft.population(3, batch="shared")(step).init({"w": torch.zeros(2)})
        >>> one = ft.member(state, 1)
        >>> one.params["w"].shape, step(one, torch.ones(2))[1]["loss"]
        (torch.Size([2]), tensor(0.))
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"member: expected a population's TrainState; got {type(state).__name__}")
    leaves = optree.tree_leaves(state.params)
    n = leaves[0].shape[0] if leaves and torch.is_tensor(leaves[0]) and leaves[0].dim() else None
    if n is None:
        raise PopulationError("member: this state's params have no member axis: it is not a population's state")
    if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
        raise PopulationError(f"member: i must be an int in [0, {n}) (the population has {n} members); got {i!r}")
    params, buffers, opt_state, slots = optree.tree_map(lambda x: x[i].clone(), _members_part(state))
    return TrainState(params, buffers, opt_state, state.step.clone(), state.rng, slots)
