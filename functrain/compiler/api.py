"""``ft.compile``: the whole step compiled as one graph, called like the step.

:func:`compile` checks its choices once (:class:`~functrain.compiler.options.Options`, and the
worker's :class:`~functrain.compiler.settings.WorkerSettings`) and builds a :class:`CompiledStep`:
immutable, it holds the step, those choices, the backend and the compiled graphs (one
:class:`~functrain.compiler.runtime.Graphs` per memory kind, shared by its runners like a JIT's cache).
A call runs on a **runner**, made by one explicit call, :meth:`CompiledStep.runner`, that says what the
caller wants (donation, background compilation) and owned by that caller: the direct path
(:class:`~functrain.compiler.runtime.Runner`: trace once per input signature, call the compiled code on
flat leaves) or the Dynamo path (:class:`~functrain.compiler.runtime.DynamoRunner`). A plain call of the
compiled step uses the step's own runner. Donation, recycled buffers, CUDA graphs and packages are
properties of the captures, never branches here.
"""
from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Any

from ..core.state import TrainState
from ..core.step import Step
from . import cache
from .background import BackgroundCompiler
from .backend import make_backend
from .errors import GraphBreakError
from .options import Options
from .progress import Progress
from .policy import FORCES as POLICIES
from .dynamo_runner import DynamoRunner
from .runtime import Graphs, Runner
from .settings import WorkerSettings

__all__ = ["compile", "CompiledStep", "GraphBreakError"]


class CompiledStep:
    """A :class:`~functrain.Step` compiled whole by :func:`compile`; call it like the step.

    Immutable: what it holds is set when it is made. A call runs on a runner (:meth:`runner`); a plain call
    ``cstep(state, batch)`` on the step's own runner.

    Attributes:
        step:      the eager step it compiles.
        options:   the :class:`~functrain.compiler.options.Options` it was made with.
        settings:  the compile worker's :class:`~functrain.compiler.settings.WorkerSettings` (read once).
        compiles:  how many graphs the backend has built for it (for all its runners) so far: a recompile shows up
                   as an increase after the first call.
        donate:    whether calls donate the input state's storage.
        cache_dir: the inductor cache folder in use when ``cache_dir=`` was given, else ``None``.

    Args:
        step: the :class:`~functrain.Step` to compile.
        options: the checked options (what :func:`compile` builds from its arguments), or ``None`` to build them from
            ``**kwargs`` (the arguments of :func:`compile` after ``step``).
        settings: the compile worker's :class:`~functrain.compiler.settings.WorkerSettings`, or ``None`` to read
            and check the ``FUNCTRAIN_COMPILE_*`` variables now (a bad value is refused here, naming it).

    Example::

        >>> import torch, functrain as ft
        >>> cstep = ft.compile(ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1)))
        >>> isinstance(cstep, ft.CompiledStep), cstep.compiles, cstep.donate
        (True, 0, False)
    """

    __slots__ = ("step", "options", "settings", "donate", "cache_dir", "_backend", "_packages", "_warm", "_later",
                 "_graphs",
                 "_own", "_twin", "_runners", "_made", "__weakref__")

    def __init__(self, step: Step, options: Options | None = None, settings: WorkerSettings | None = None,
                 **kwargs: Any):
        if not isinstance(step, Step):
            raise TypeError(f"ft.compile takes a functrain Step (from ft.train_step); got {type(step).__name__}")
        options = Options(**kwargs) if options is None else options
        settings = WorkerSettings.from_env() if settings is None else settings
        set_ = object.__setattr__
        set_(self, "step", step)
        set_(self, "options", options)
        set_(self, "settings", settings)
        set_(self, "donate", options.donate)
        # checked before anything compiles or loads (None: inductor's own folder, the Trainer's default)
        folder = cache.use_cache_dir(options.cache_dir)
        set_(self, "cache_dir", None if options.cache_dir is None else folder)
        set_(self, "_backend", make_backend(options, settings.lock_timeout))
        packages = warm = later = None
        if options.package:
            from .later import PackageLater
            from .package import Packages
            from .warm import WarmStarts
            from .trust import private_home
            # (without cache_dir: functrain's private folder, inductor's caches where they are)
            folder = private_home() if options.cache_dir is None else os.fspath(options.cache_dir)
            packages = Packages(folder, settings.lock_timeout)
            warm = WarmStarts(packages, {"cuda_graphs": options.cuda_graphs})
            later = PackageLater(folder, settings, settings.lock_timeout)  # (after a background compile)
        set_(self, "_packages", packages)
        set_(self, "_warm", warm)
        set_(self, "_later", later)
        set_(self, "_graphs", {})  # memory kind -> Graphs (the compiled graphs, filled as runners compile)
        set_(self, "_runners", weakref.WeakSet())  # every runner made: close() and finish_after_exit() reach them
        # (a runner, weakly; its progress and rate meter, plain values): what .progress reads, ft.run's runner included
        # once ft.run has returned and its runner is gone
        set_(self, "_made", [])
        # a donating runner of a step on the Dynamo path may take the direct path (CUDA graphs need donation): a
        # compiled step of its own, made at the first such runner
        set_(self, "_twin", [])
        set_(self, "_own", self.runner(donate=self.donate, background=options.in_background(False)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"CompiledStep is immutable: {name!r} cannot be set (ft.compile again to change it)")

    # -- runners -------------------------------------------------------------------------------------
    def runner(self, *, donate: bool = False, background: bool | None = None) -> Runner | DynamoRunner:
        """A new runner of this step, owned by the caller: what ``ft.run`` and the Trainer call (``donate=True,
        background=True``), what a benchmark times.

        Args:
            donate: the runner owns the states it is given and writes each new state into the input's buffers
                (the input cannot be stepped again; the other leaves of the input state *are* the new state's).
                On a step compiled with ``donate=True`` every runner donates so.
            background: compile off the caller's thread, eager calls meanwhile, where ``ft.compile`` left it open
                (``background=None``); ``None`` here: as the step was compiled (a direct call waits). A step
                compiled with ``background=`` or ``switch_at=`` given keeps its choice. Never on the Dynamo path.

        Example::

            run = cstep.runner(donate=True, background=True)   # what ft.run does
            state = ft.tree.tree_map(torch.clone, state)         # own it
            for batch in loader:
                state, metrics = run(state, batch)
            run.progress.phase, run.rates.rate("compiled")
        """
        if donate and self.options.path != "direct" and not self.donate:
            return self._donating_twin().runner(donate=True, background=background)
        if self.options.path != "direct":
            made: Any = DynamoRunner(self.step, self.options, self._backend)
        else:
            memory = ("donate" if self.donate else "owned") if donate else ("donate" if self.donate else "fresh")
            bg = self.options.in_background(False if background is None else background)
            graphs = self._graphs_of(memory)
            # a background compile builds no package on its way (it compiles where the steps do not wait, into
            # inductor's caches; the package for the next run comes after: Graphs.later); a blocking compile (the
            # first call, precompile) does, and every runner looks up warm entries
            made = Runner(graphs, BackgroundCompiler(self.step, self.options, self.settings, self._backend,
                                                     None, memory, defer_imports=self._warm is not None)
                          if bg else None)
        self._runners.add(made)
        called = [m for m in self._made if m[2].path is not None]
        last = max(called, key=lambda m: m[2].last) if called else None
        self._made[:] = [m for m in self._made if m[0]() is not None or m is last]  # (the gone ones but the last)
        self._made.append((weakref.ref(made), made.progress, made.rates))
        return made

    def _donating_twin(self) -> "CompiledStep":
        if not self._twin:
            self._twin.append(CompiledStep(self.step, self.options.replace(donate=True), self.settings))
        return self._twin[0]

    def _graphs_of(self, memory: str) -> Graphs:
        graphs = self._graphs.get(memory)
        if graphs is None:
            graphs = self._graphs[memory] = Graphs(
                self.step, self._backend, memory=memory, packages=self._packages, warm=self._warm, later=self._later,
                cuda_graphs=self.options.cuda_graphs, reuse_blocks=self.options.reuse_blocks,
                draw_captures=self.settings.draw_captures)
        return graphs

    def direct(self, donate: bool) -> Graphs | None:
        """The graphs of the direct path that a donating runner (``donate=True``: ``ft.run``'s) or a plain call
        (``False``) uses, or ``None`` (the Dynamo path, or a donating step asked for an undonated call): where
        :func:`functrain.memory` keeps its trace for the first call to compile."""
        if self.options.path != "direct":
            return self._donating_twin().direct(True) if donate and not self.donate else None
        if donate:
            return self._graphs_of("donate" if self.donate else "owned")
        return None if self.donate else self._graphs_of("fresh")

    @property
    def background(self) -> bool:
        """Whether plain calls of this step compile in the background (``ft.compile(background=True)`` or
        ``switch_at=``); :meth:`runner` may choose otherwise for its caller."""
        return self.options.in_background(False)

    @property
    def progress(self) -> Progress:
        """Where the compile of the runner that last trained this step stands: ``ft.run``'s, the Trainer's, a runner
        of the caller's, or the step's own (its plain calls; before any call, that one).

        Example::

            state = ft.run(cstep, state, loader, num_steps=1000)
            cstep.progress.phase            # 'compiled': ft.run's runner trained the step compiled
        """
        made = [*self._made, *(self._twin[0]._made if self._twin else ())]
        called = [(rates.last, progress) for _, progress, rates in made if rates.path is not None]
        return max(called, key=lambda c: c[0])[1] if called else self._own.progress

    def close(self) -> None:
        """Stop this step's background compiles that still run, in every runner made from it (their workers are
        killed); their signatures then run eagerly. A package still being built for the next run
        (``package=True``: :mod:`functrain.compiler.later`) is stopped too."""
        for r in list(self._runners):
            r.close()
        if self._later is not None:
            self._later.close()

    def wait_for_packages(self) -> int:
        """Wait until the packages being built for the next run have been written (``package=True`` with a
        background compile: once a background compile's code is installed, a worker builds the graph's package
        and its warm entry, so that the next run is compiled from its first step; :mod:`functrain.compiler.later`),
        each bounded by ``FUNCTRAIN_COMPILE_TIMEOUT``. Returns how many were written in all (0 without
        ``package=True``). A caller that wants its next run warm calls it before it exits; otherwise a build still
        running is stopped at exit (or left to finish with ``FUNCTRAIN_COMPILE_FINISH=1``)."""
        return self._later.wait() if self._later is not None else 0

    def finish_after_exit(self, finish: bool = True) -> None:
        """Choose whether background compiles of this step's runners that still run when the process exits
        finish after it (into the caches the next run loads) or are killed with it.

        ``ft.run`` asks for it (for its runner) when its loop returns normally; the Trainer takes it back when a
        signal stopped the run. Only with ``FUNCTRAIN_COMPILE_FINISH=1`` (opt-in) does a compile finish after exit;
        by default every one is killed at exit whatever was chosen. A worker that has no graph yet is stopped now
        (it would only wait).

        Args:
            finish: ``True``: let them finish after exit (one line on stderr says so); ``False``: kill them at
                exit.

        Example::

            cstep = ft.compile(step)
            state = ft.run(cstep, state, loader, num_steps=10)   # (ft.run already called finish_after_exit())
            cstep.finish_after_exit(False)                        # this process's compiles end with it after all
        """
        for r in list(self._runners):
            r.finish_after_exit(finish)
        if self._later is not None:
            self._later.finish_after_exit(finish)

    def precompile(self, state: TrainState, batch: Any, *, donate: bool = True, quiet: bool = False) -> float:
        """Compile ahead: trace the step for ``(state, batch)`` and compile it now into the compile caches (and this
        step's graphs), without stepping (its CPU seconds go into this machine's compile history,
        :mod:`functrain.compiler.history`); a later process tracing the same graph (the run itself) loads it at its
        first trace (its first call, once the compiler is imported) and runs compiled from then on. Says what it
        does on stderr, then the time it took (``quiet=True``: silent). Returns the seconds (0 when this process had compiled it already).

        ``donate``: for the donating runners that ``ft.run`` and the Trainer use (the default), or (``False``)
        for plain calls of the step: their graphs differ. The shape of JAX's ``jit(f).lower(x).compile()``.

        Example::

            cstep = ft.compile(step)
            cstep.precompile(state, batch)    # "functrain: compiled ahead in 41.2 s ..."; then exit, or train
        """
        import sys

        folder = cache.inductor_dir()
        if not quiet:
            print(f"functrain: compiling the step ahead into {folder} (trace, then compile; nothing is stepped) ...",
                  file=sys.stderr, flush=True)
        made = self.runner(donate=donate, background=False)
        if isinstance(made, DynamoRunner):
            raise ValueError("precompile: the Dynamo path (fullgraph=False, dynamic=True, capture='dynamo' or extra "
                             "torch.compile arguments) compiles at its first call; precompile needs the direct path "
                             "(capture='auto' or 'direct')")
        from .history import History, cpu_seconds, kind_of
        from .jobs import leads_at_once

        cpu0 = cpu_seconds()
        written = self._warm.written if self._warm is not None else 0
        inductor = {"mode": self.options.mode, "options": self.options.options, "donate": self.options.donate}
        # (compiled in a worker the caller waits for: its compilers die with this process, however it dies)
        seconds, nodes, metas, worker_cpu = made.precompile(state, batch, self.settings, inductor)
        if seconds > 0 and leads_at_once():  # the compile's outcome, for the compile policy
            History.beside_caches().add_compile(kind_of(metas, self.options.mode), nodes,
                                                cpu_seconds() - cpu0 + worker_cpu)
        if not quiet:
            then = ("a later run of this step runs it from its first step, loaded before any trace (a package in "
                    f"{self._packages.folder})" if self._warm is not None and self._warm.written > written else
                    "a run of this step loads it from the caches at its first trace and runs compiled from then on")
            print(f"functrain: compiled ahead in {seconds:.1f} s; {then}", file=sys.stderr, flush=True)
        return seconds

    @property
    def compiles(self) -> int:
        """Graphs the backend has built for this step, for all its runners (a recompile shows as an increase)."""
        twin = self._twin[0].compiles if self._twin else 0  # (a Dynamo-path step's donating twin)
        return self._backend.count + twin

    def init(self, params: Any, buffers: Any = None, **kwargs: Any) -> TrainState:
        """Same as :meth:`Step.init`."""
        return self.step.init(params, buffers, **kwargs)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        return self._own(state, batch)

    def __repr__(self) -> str:
        return f"compile({self.step!r}, donate={self.donate})"


def compile(step: Step, *, donate: bool = False, fullgraph: bool = True, capture: str = "auto",
            cache_dir: str | os.PathLike | None = None, package: bool = False, background: bool | None = None,
            switch_at: int | None = None, reuse_blocks: bool = False, policy: str | None = None,
            **torch_compile_kwargs: Any) -> CompiledStep:
    """Compile the whole step with ``torch.compile`` (``fullgraph=True`` by default).

    The result is called like the step and gives the same results (to float
    rounding). Steps of the same shapes never recompile: the step counter and
    every per-step value are tensors. ``donate=True`` lets the new state reuse
    the input state's storage (peak memory near one state, as JAX's donation);
    the input state is invalid afterwards and passing it to a step raises.
    Other keyword arguments go to ``torch.compile`` (``mode``, ``options``,
    ``dynamic``, ``backend``).

    How it runs: by default (``capture="auto"``) the step is traced once per input
    signature over the flat leaves of ``(state, batch)`` and the backend's code is
    called directly on them (:mod:`functrain.compiler.runtime`): no Dynamo frame per call,
    only functrain's check that the state's structure and every leaf's shape, stride, dtype
    and device match the capture (a change compiles again and counts in ``compiles``).
    Python values the step reads (closures, globals) are constants of the capture, as
    under ``jax.jit``. ``fullgraph=False``, ``dynamic=True`` or extra ``torch.compile``
    arguments use ``torch.compile`` per call instead, and ``capture="dynamo"`` asks for
    that path explicitly (``"direct"`` insists on the direct one; ``"flat"`` is its old name).

    ``mode="reduce-overhead"`` (CUDA graphs): with ``donate=True`` (or through
    :meth:`CompiledStep.donating`, as ``ft.run`` calls it) the direct path replays the
    compiled step as one CUDA graph on the donated state's buffers, the batch copied in
    (:mod:`functrain.compiler.cudagraph`); a step it cannot graph (a CPU state, random numbers)
    warns and runs without. Undonated, it is inductor's CUDA graphs on the Dynamo path.

    A later process that traces the same graph (a resumed run, a second run, another
    rank) reuses AOTAutograd's and inductor's on-disk caches, keyed by torch on the graph,
    shapes, dtypes, devices, config and version (a changed loss is a new key, compiled
    afresh). ``cache_dir`` puts them in ``cache_dir/inductor`` (a folder of this user's,
    not world-writable; inductor's folder is process-wide, so the first one a process
    compiles with stays; default: ``TORCHINDUCTOR_CACHE_DIR`` or inductor's own). Ranks
    of one machine starting together compile each graph once: the first takes a lock
    on it, the others wait and load its entry. See :mod:`functrain.compiler.cache`.
    ``package=True`` compiles each graph ahead of time into a package instead (AOTInductor), kept
    in ``cache_dir/packages`` (without ``cache_dir``: functrain's private folder, ``~/.cache/functrain``
    or ``FUNCTRAIN_CACHE_DIR``), with a warm entry keyed before any trace: a later process runs
    it from its first call without tracing or importing the compiler, checked against the eager
    step at that call (:mod:`functrain.compiler.warm`). A package is built by a blocking compile
    (a direct call, :meth:`CompiledStep.precompile`); a background compile compiles into inductor's
    caches, where the steps need not wait, and once its code is installed another worker builds the
    package for the next run (:mod:`functrain.compiler.later`, :meth:`CompiledStep.wait_for_packages`).

    **Background compilation** (:mod:`functrain.compiler.background`): with ``background=True``
    the first call returns the eager step's result at once while the graph compiles in a worker
    process; calls run eagerly (the same math: compiled == eager to float rounding) until the
    compiled code is ready, then switch at a call boundary, and every later call runs compiled.
    Data-parallel ranks switch at the same call. When that happens depends on the machine, so the
    last bits of a run do too; ``switch_at=N`` is the reproducible form: calls whose input state
    has taken fewer than ``N`` steps run eagerly, the call at ``N`` waits for the compile if it is
    late (a resumed run replays the same switch). A step that will not compile trains on eagerly
    after one warning. ``background=False`` compiles in the first call, which waits for it.
    The default (``None``) leaves it to the caller: a direct call of the compiled step waits
    (what a benchmark or a timed loop expects), while :func:`functrain.run` and
    :class:`functrain.Trainer` compile in the background.

    **Repeated blocks** (``reuse_blocks=True``, opt-in, :mod:`functrain.core.regions`): the layers
    of a module made pure by :func:`functrain.functionalize` that compute the same (a transformer's
    blocks) are traced once and compiled once, as one region the graph calls at every depth
    (``torch.compiler.nested_compile_region``'s mechanism); the numbers are the flat graph's. It
    cuts a deep model's compile (a 32-layer LM: 0.67x the flat compile) but its steady step ran
    17-48 % slower than the flat graph's (no fusion across blocks), so it is off by default.

    Args:
        step: the :class:`~functrain.Step` to compile.
        donate: write the new state into the input state's buffers (the input is invalid after).
        fullgraph: refuse graph breaks (``False``: allow them, on the Dynamo path).
        capture: ``"auto"``, ``"direct"`` or ``"dynamo"`` (see above).
        cache_dir: a folder for the compile caches and packages.
        package: compile ahead of time into packages in ``cache_dir`` (without it: functrain's private folder),
            and run a later process's step from its first call (a warm start).
        background: compile off the training thread, eager calls meanwhile (``None``: the caller decides).
        switch_at: with background compilation, switch at this step count (waiting for the compile there).
        reuse_blocks: trace each repeated block (a transformer's layers) once, reuse it at every depth
            (default ``False``: the flat graph, the faster step).
        policy: whether a background compile of a run of known length waits for the compile policy's
            decision (``"auto"``), always compiles (``"always"``) or never does (``"never"``: the step runs
            eagerly); ``None``: ``FUNCTRAIN_COMPILE_POLICY`` (default ``"auto"``). See
            :mod:`functrain.compiler.policy`.
        **torch_compile_kwargs: ``backend``, ``mode``, ``options``, ``dynamic`` and any other
            ``torch.compile`` argument.

    Returns:
        A :class:`CompiledStep`, called like ``step``.

    Example::

        import functrain as ft
        cstep = ft.compile(step)            # first call compiles (seconds), later calls are fast
        state, metrics = cstep(state, batch)
        cstep.compiles                      # 1
        cstep = ft.compile(step, cache_dir="runs/a/compile_cache")   # a resumed run loads, not compiles
        cstep = ft.compile(step, background=True)   # eager calls until the compiled code is ready

    As a doctest (the ``aot_eager`` backend: eager kernels, no C++ compile)::

        >>> import torch, functrain as ft
        >>> step = ft.train_step(lambda p, b, x: (p["w"] * x).pow(2).sum(), ft.optim.sgd(0.1))
        >>> cstep = ft.compile(step, backend="aot_eager")
        >>> state = step.init({"w": torch.ones(3)})
        >>> new, _ = cstep(state, torch.ones(3))
        >>> ref, _ = step(state, torch.ones(3))
        >>> cstep.compiles, bool(torch.allclose(new.params["w"], ref.params["w"]))
        (1, True)
    """
    named = {k: torch_compile_kwargs.pop(k) for k in ("backend", "mode", "options", "dynamic")
             if k in torch_compile_kwargs}
    options = Options(donate=donate, fullgraph=fullgraph, capture=capture, cache_dir=cache_dir, package=package,
                      background=background, switch_at=switch_at, reuse_blocks=reuse_blocks,
                      extra=torch_compile_kwargs, **named)
    settings = WorkerSettings.from_env()
    if policy is not None:
        if policy not in POLICIES:
            raise ValueError(f"ft.compile: policy must be one of {', '.join(map(repr, POLICIES))} or None (the "
                             f"FUNCTRAIN_COMPILE_POLICY setting); got {policy!r}")
        settings = dataclasses.replace(settings, policy=policy)
    return CompiledStep(step, options, settings)
