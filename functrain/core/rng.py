"""The RNG hand-over: each step draws its random numbers from ``state.rng``, on the host, without a sync.

``state.rng`` is ``{"key": int64 host tensor [seed, counter]}`` (or ``None``: the
step then uses torch's global generators as they are). :func:`with_rng` runs one
step the way a pure function of the state needs:

1. hash ``[seed, counter]`` into a step seed (splitmix64, twice);
2. seed the global generators of the state's devices with ``step seed + offset``
   (the offset is a transform's :meth:`~functrain.Transform.rng_offset`: the
   process's rank under data parallelism, so ranks draw different dropout masks
   while the key, and so every checkpoint, stays replicated);
3. run the step, restore the caller's generators, return the state with the
   counter advanced.

Eagerly the same goes for Python's ``random`` (its global instance seeded from the
step seed and restored after) and numpy's global functions (``np.random.rand``,
``np.random.normal``, ... draw, during the step, from a generator seeded from the step
seed; the caller's is not touched): a step that draws from them gives the same result
from the same state. (A numpy function bound before, ``from numpy.random import rand``,
still draws from numpy's own global generator.) A compiled step cannot draw from them:
the number drawn while the step is traced would be a constant of the graph, so
:func:`host_random_refused` (around the capture) raises :class:`HostRandomError` naming
the call. Randomness that compiles is drawn with torch ops (``torch.rand``,
``torch.randint``, ``torch.randn_like``, ``torch.bernoulli``), which come from the seeded
torch generators in both forms: a coin is ``torch.rand((), device=x.device) < p`` and a
branch on it a ``torch.where``. On the CPU the compiled step draws the eager step's very
numbers (its graphs compile with inductor's ``fallback_random``:
:func:`functrain.compiler.backend.make_backend`); on CUDA inductor's own generator draws
others, reproducibly. A transform's draws come from the same generator, after the loss's
(docs/randomness.md, "A transform's random numbers").

Example::

    >>> import torch
    >>> from functrain.core.rng import rng_init, with_rng
    >>> state_rng = rng_init(0, torch.device("cpu"))
    >>> state_rng["key"].tolist()
    [0, 0]
"""
from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .validate import BadValue, check_int
from .checks import rng_ok, rng_problem

__all__ = ["rng_init", "with_rng", "host_seed", "host_random_refused", "HostRandomError"]


def rng_init(seed: int, device: torch.device) -> dict:
    """The initial ``state.rng`` for ``seed``.

    The key is a host tensor whatever ``device`` is: it is read on the host every
    step, and a device tensor would make that read a sync.

    Args:
        seed: the stream's seed, an int in ``[0, 2**63)``.
        device: the state's device (accepted for the caller's symmetry; the key stays on the host).

    Returns:
        ``{"key": tensor([seed, 0])}``, an int64 CPU tensor ``[seed, counter]``.

    Raises:
        BadValue: ``seed`` is not an int in ``[0, 2**63)``.

    Example::

        >>> import torch
        >>> from functrain.core.rng import rng_init
        >>> rng_init(7, torch.device("cpu"))
        {'key': tensor([7, 0])}
    """
    check_int("seed", seed, minimum=0, maximum=2**63 - 1, what="an int in [0, 2**63) or None")
    return {"key": torch.tensor([int(seed), 0], dtype=torch.int64)}


def _mix64(x: int) -> int:
    """splitmix64: a well-mixed 64-bit value from a counter."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def step_seed(seed: int, counter: int) -> int:
    """The seed of the step at ``counter`` of the stream ``seed`` (splitmix64 of both).

    Args:
        seed: the stream's seed (``state.rng["key"][0]``).
        counter: the step's counter (``state.rng["key"][1]``).

    Returns:
        An int in ``[0, 2**62)``, so that ``+ rank`` stays a valid torch seed.

    Example::

        >>> from functrain.core.rng import step_seed
        >>> step_seed(0, 0) == step_seed(0, 0) != step_seed(0, 1)
        True
    """
    return _mix64(_mix64(seed) ^ counter) >> 2


def _devices(state: Any) -> list[str]:
    device = state.step.device
    return ["cpu"] if device.type != "cuda" else ["cpu", str(device)]


def _get_rng(dev: str) -> torch.Tensor:
    return torch.get_rng_state() if dev == "cpu" else torch.cuda.get_rng_state(dev)


def _set_rng(dev: str, value: torch.Tensor) -> None:
    if dev == "cpu":
        torch.set_rng_state(value)
    else:
        torch.cuda.set_rng_state(value, dev)


def _seed_globals(devices: list[str], seed: int) -> None:
    for dev in devices:
        if dev == "cpu":
            torch.default_generator.manual_seed(seed)
        else:
            torch.cuda.default_generators[torch.device(dev).index or 0].manual_seed(seed)


def with_rng(fn: Callable, state: Any, batch: Any, rank: int = 0, host_generators: bool = True) -> tuple[Any, dict]:
    """Run ``fn(state, batch)`` drawing random numbers from ``state.rng`` (host side).

    ``state.rng["key"]`` is a host int64 tensor ``[seed, counter]``, the same on
    every process. Each step hashes it into a step seed (splitmix64), advances
    the counter (into the new state), seeds the global generators with
    ``step seed + rank``, runs, and restores the caller's generators. All of it is
    host work on host memory: no device sync, no torch op that reads a value.

    Args:
        fn: the step, ``fn(state, batch) -> (new_state, metrics)``; it is called with ``rng=None``.
        state: the state; with ``state.rng`` ``None`` (an unseeded step) ``fn`` runs as it is.
        batch: the batch, passed through.
        rank: the step's RNG offset (default 0): data-parallel ranks draw different dropout
            masks, yet the state stays replicated and a checkpoint holds everything.
        host_generators: ``True`` (default): Python's ``random`` is seeded and restored too, and
            numpy's global functions draw from a generator seeded for the step, so an eager step
            that draws from them gives the same result from the same state. A compiled graph
            cannot draw from them (see :func:`host_random_refused`): its caller passes ``False``
            and saves their cost (~15 microseconds, mostly Python's ``getstate``).

    Returns:
        ``(new_state, metrics)`` from ``fn``, with ``new_state.rng`` the key with its counter advanced.

    Raises:
        BadValue: ``state.rng`` is not a key this step made (the message says what is wrong).

    Example::

        >>> import torch, functrain as ft
        >>> from functrain.core.rng import with_rng
        >>> drop = lambda p, b, x: (p["w"] * torch.nn.functional.dropout(x, 0.5)).sum()
        >>> step = ft.train_step(drop, ft.optim.sgd(0.1))
        >>> state = step.init({"w": torch.ones(4)}, seed=0)
        >>> new, _ = with_rng(step.apply, state, torch.ones(4))
        >>> new.rng["key"].tolist()
        [0, 1]
    """
    rng = state.rng
    if rng is None:
        return fn(state, batch)
    if not rng_ok(rng):
        raise BadValue(f"the state does not match this step: {rng_problem(rng)}")
    seed, counter = rng["key"].tolist()  # a host tensor: read without a torch op (and so no sync)
    seed_now = step_seed(seed, counter)
    # Python's random: the same numbers on every rank (a branch on a draw takes the same path on every rank, so
    # compiled ranks run the same capture: functrain.compiler.host_draws); numpy's: per rank, as torch's
    saved_host = _seed_host(seed_now, seed_now + rank) if host_generators else None
    try:
        if not state.step.is_cuda:  # the common case, one generator: the general loop below, unrolled
            cpu = torch.default_generator
            saved_cpu = cpu.get_state()
            try:
                cpu.manual_seed(seed_now + rank)
                new_state, metrics = fn(state._replace(rng=None), batch)
            finally:
                cpu.set_state(saved_cpu)
        else:
            devices = _devices(state)
            saved = {dev: _get_rng(dev) for dev in devices}
            try:
                _seed_globals(devices, seed_now + rank)
                new_state, metrics = fn(state._replace(rng=None), batch)
            finally:
                for dev, value in saved.items():
                    _set_rng(dev, value)
    finally:
        if saved_host is not None:
            _restore_host(saved_host)
    # (from numpy: half the cost of torch.tensor([...]) for a two-element host tensor)
    key = torch.from_numpy(np.array((seed, counter + 1), dtype=np.int64))
    return new_state._replace(rng={"key": key}), metrics


# -- Python's and numpy's global generators -------------------------------------------------------
_NP = np.random.mtrand._rand  # the RandomState behind np.random.rand, np.random.normal, ...
# numpy's legacy functions (np.random.rand, normal, seed, ...) are bound methods of _NP. Saving and restoring its
# state costs ~100 us a step (get_state and set_state copy 624 words through Python objects), so during an eager
# step those names point at the methods of a generator of the step's own, seeded from the step seed (~2 us), and
# the caller's generator is not touched at all.
_NP_NAMES = tuple(sorted(name for name, fn in vars(np.random).items() if getattr(fn, "__self__", None) is _NP))
_NP_STEP = np.random.RandomState(0)
_NP_STEP_FNS = {name: getattr(_NP_STEP, name) for name in _NP_NAMES}


def host_seed(rng: dict | None) -> int | None:
    """The seed of Python's ``random`` for the step of ``rng`` (``state.rng``): the step seed, the same on every rank
    (``None`` for an unseeded state). Read from the host key: no device sync.

    Example::

        >>> import torch
        >>> from functrain.core.rng import host_seed, rng_init, step_seed
        >>> host_seed(rng_init(5, torch.device("cpu"))) == step_seed(5, 0)
        True
    """
    if rng is None:
        return None
    seed, counter = rng["key"].tolist()
    return step_seed(seed, counter)


def _seed_host(seed: int, np_seed: int) -> tuple:
    """Seed Python's ``random`` from ``seed`` and (for the step) numpy's global functions from ``np_seed``; return
    what to restore.

    Python's global instance is re-seeded (``from random import random`` binds its method, so it is the one
    to seed) and its state saved; the ``numpy.random`` functions are pointed at a generator seeded from
    ``np_seed`` (numpy's 32-bit seed: the 64 bits folded)."""
    saved = random.getstate()
    random.seed(seed)
    names = np.random.__dict__
    saved_np = {name: names.get(name) for name in _NP_NAMES}
    _NP_STEP.seed((np_seed ^ (np_seed >> 32)) & 0xFFFFFFFF)
    names.update(_NP_STEP_FNS)
    return saved, saved_np


def _restore_host(saved: tuple) -> None:
    random.setstate(saved[0])
    np.random.__dict__.update(saved[1])


class HostRandomError(RuntimeError):
    """A step drew from Python's ``random`` or numpy's global generator while being traced for compilation.

    A ``RuntimeError`` raised by :func:`functrain.compile` (through :func:`host_random_refused`):
    the number drawn once would be a constant of the compiled graph. Its message names the
    call, its caller and the way out (a torch op drawing from ``state.rng``, or an eager step).

    Example::

        >>> import random, functrain as ft
        >>> from functrain.core.rng import host_random_refused
        >>> try:
        ...     with host_random_refused("ft.compile"):
        ...         coin = random.random() < 0.5
        ... except ft.HostRandomError as e:
        ...     print(str(e).split(" at ")[0])
        ft.compile: the step called random.random() (Python's global generator)
    """

    unnamed = False  # Python's generator changed in a block run without the profile hook (name_calls=False)


_RANDOM_FILE = os.path.normcase(os.path.abspath(random.__file__))
_NOT_DRAWS = ("seed", "getstate", "setstate", "get_state", "set_state", "get_bit_generator", "set_bit_generator")


def _where(frame: Any) -> tuple[str, str, Any]:
    """(the API function called, ``file:line in function`` of its caller, the caller's code) for a frame inside
    ``random.py``."""
    api = "random"
    while frame is not None and os.path.normcase(os.path.abspath(frame.f_code.co_filename)) == _RANDOM_FILE:
        api, frame = frame.f_code.co_name, frame.f_back
    if frame is None:
        return api, "an unknown place", None
    return api, f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}", frame.f_code


@contextlib.contextmanager
def host_random_refused(what: str = "ft.compile", name_calls: bool = True,
                        recorded_by: frozenset = frozenset()) -> Iterator[None]:
    """Refuse draws from Python's ``random`` and numpy's global generator while the block (a trace) runs.

    A number drawn while a step is traced is baked into the graph as a constant: every
    compiled call would reuse it (a coin flipped once, for ever). So while the block runs
    the draws of this thread are recorded, and at the end :class:`HostRandomError` names
    the first one, its caller and the way out:

    * Python's ``random``: a profile hook sees every call into the global instance's C
      methods, also through names bound before (``from random import random``, as
      denoising-diffusion-pytorch's ``p_losses`` calls it);
    * numpy: numpy's generator methods are Cython functions, which profile hooks do not
      see, so the ``numpy.random`` functions (``rand``, ``normal``, ...) are wrapped for
      the block, and a change of the generator's state with no wrapped call (a name
      bound before) is refused without the name.

    Both generators are restored to their state before the block, so tracing leaves no
    trace in them. If another profiler is active the hook is not installed and a change
    of Python's generator state is refused without the call's name. An exception raised
    by the block itself passes through unchanged.

    The profile hook runs at every Python call of the block: it doubles the time of a
    trace (measured on denoising-diffusion-pytorch's Unet: 2.4 s without, 4.8 s with).
    ``name_calls=False`` leaves it out and refuses a changed Python generator by its
    state alone; the error then has ``unnamed = True``, and the caller can run the block
    again with the hook to name the call (what :func:`functrain.compile`'s trace does).

    Args:
        what: who traces, the start of the error message (default ``"ft.compile"``).
        name_calls: install the profile hook that names a call into Python's ``random``
            (default ``True``); without it a draw is still refused, without the name.
        recorded_by: code objects whose calls into Python's ``random`` are not refused: a trace that records
            its draws (:mod:`functrain.compiler.host_draws`, which restores the generator and refuses, unnamed,
            a draw it did not record; an unnamed :class:`HostRandomError` the block raises is replaced by the
            named one when the hook saw the call).

    Returns:
        A context manager (it yields ``None``).

    Raises:
        HostRandomError: at the end of the block, when it drew from either generator.

    Example::

        >>> import random
        >>> from functrain.core.rng import host_random_refused
        >>> with host_random_refused("a trace"):
        ...     x = random.random()
        Traceback (most recent call last):
        ...
        functrain.core.rng.HostRandomError: a trace: the step called random.random() (Python's global generator) ...
    """
    saved = (random.getstate(), _NP.get_state())
    calls: list = []
    py_gen = random._inst
    me = threading.get_ident()

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and not calls and getattr(arg, "__self__", None) is py_gen:
            api, where, caller = _where(frame)
            if api not in _NOT_DRAWS and caller not in recorded_by:
                calls.append((f"random.{api}()", "Python's global generator", where))

    def recording(name: str, fn: Callable) -> Callable:
        def draw(*args: Any, **kwargs: Any) -> Any:
            if not calls and threading.get_ident() == me:
                frame = sys._getframe(1)
                calls.append((f"numpy.random.{name}()", "numpy's global generator",
                              f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"))
            return fn(*args, **kwargs)
        return draw

    module = np.random
    wrapped = {name: fn for name, fn in vars(module).items() if name not in _NOT_DRAWS and (
        getattr(fn, "__self__", None) is _NP or getattr(fn, "__self__", None) is _NP_STEP)}
    hooked = name_calls and sys.getprofile() is None
    for name, fn in wrapped.items():
        setattr(module, name, recording(name, fn))
    if hooked:
        sys.setprofile(hook)
    unnamed: HostRandomError | None = None
    try:
        try:
            yield
        except HostRandomError as e:  # (a recording trace's unnamed refusal: named below if the hook saw it)
            if not e.unnamed:
                raise
            unnamed = e
    finally:
        if hooked:
            sys.setprofile(None)
        for name, fn in wrapped.items():
            setattr(module, name, fn)
        changed_py = not hooked and random.getstate() != saved[0]
        changed_np = not _same_np_state(_NP.get_state(), saved[1])
        random.setstate(saved[0])
        _NP.set_state(saved[1])
    if unnamed is not None and not calls:
        raise unnamed
    if calls or changed_py or changed_np:
        if calls:
            call, which, where = calls[0]
            head = f"the step called {call} ({which}) at {where}"
        elif changed_py:
            why = "a profiler is active" if name_calls else "calls were not watched"
            head = f"Python's random generator changed ({why}, so the call is not known)"
        else:
            head = "numpy's global generator changed (a numpy.random function bound before, e.g. from " \
                   "numpy.random import rand, or another thread)"
        error = HostRandomError(
            f"{what}: {head} while being captured: the number drawn once there would be a constant of the "
            f"compiled graph, the same at every step. Draw random numbers with torch ops instead (e.g. a coin: "
            f"torch.rand((), device=x.device) < 0.5, used through torch.where): they come from state.rng and "
            f"compile. Or run this step eagerly (ft.TrainConfig(compile=False), or the step without ft.compile): "
            f"eager steps seed Python's random and numpy's global generator from state.rng")
        error.unnamed = bool(changed_py and not calls and not name_calls)  # the hook would name the call
        raise error


def _same_np_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])
