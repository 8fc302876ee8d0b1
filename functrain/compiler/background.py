"""Background compilation: the eager step from the first call, the compiled step once it is ready.

A compiled step equals its eager step by law, so a state made by one is a valid input
to the other, and a run need not wait for a compile. :class:`Background` is the
``fallback`` of a :class:`~functrain.compiler.runtime.DirectCall`: it runs every call whose
graph is not compiled yet, so the per-call path itself is unchanged. For a new input
signature it

1. runs the eager step (``step.host_call(step.apply, ...)``, the same host work as ``Step.__call__``);
2. traces the graph on the training thread (``make_fx``, as a blocking compile would: the
   trace sets ``torch.compiler.is_compiling()``, a process-wide flag, and patches ``nn.Module``
   while it runs, so it must not overlap an eager step; it is the short part of a compile);
3. hands the graph to a **worker process** (:mod:`functrain.compiler.worker`) that compiles it
   at a lower priority into AOTAutograd's and inductor's on-disk caches, unless another process
   of the machine is compiling it: one process per machine compiles a graph, the one that holds
   the graph's machine-wide lock (:class:`~functrain.compiler.jobs.SharedJob`: local rank 0 takes
   it at once); the others start no worker, and load its code once the lock is free;
4. keeps running the eager step, call after call, until the switch: then loads the worker's
   entries on the training thread with code generation refused
   (:meth:`~functrain.compiler.backend.CountingBackend.load`: a miss, a corrupt or foreign entry
   is an error, never a silent compile), installs the capture, and from that call on every call
   of that signature runs the compiled code.

Why a process and not a thread: torch's compiler is not safe to run beside eager code in
one process. AOTAutograd and inductor save and restore the global random generator around
their work (``preserve_rng_state``: an eager step drawing dropout masks meanwhile would have
its generator rewound in the middle), their traces set the process-wide ``is_compiling``
flag and patch ``torch.nn.Module.__call__``, and their Python work holds the GIL against the
eager step's. A worker shares none of it; its cost is its start (importing torch) and one
cache load (a second or so) on the training thread at the switch. ``FUNCTRAIN_COMPILE_WORKER=
thread`` compiles in a thread instead, for comparison (it warns once: see above).

When to switch (the ``switch_at`` option of :func:`functrain.compile`):

* ``None`` (switch when ready): at every call until the switch, the processes that run the
  step agree on whether every one of them has its compiled code (:meth:`functrain.Step.agree`:
  one MIN all-reduce of a host int for a data-parallel step, nothing on one process), so
  replicated ranks switch at the same step and their collectives stay matched. The last bits of
  the run depend on when that was (eager and compiled agree to float rounding, not bitwise).
* ``switch_at=N``: calls whose input state has taken fewer than ``N`` steps run eagerly; the
  call at ``N`` waits for the compile if it is late, and the ranks agree once. ``state.step``
  is in every checkpoint, so a resumed run replays the same switch: bit-exact resume holds.

Faults: a step that is not one graph (a graph break) warns once with ``GraphBreakError``'s
text and trains on eagerly; so does a worker that fails (its error and the tail of its log), dies
(the signal) or runs past ``FUNCTRAIN_COMPILE_TIMEOUT`` seconds (default 3600; it is killed).
A worker is its own process group, killed with its compiler children when its job ends early,
when the step is garbage-collected and at exit, and it dies with the training process if that
is killed. One exception: when ``ft.run``'s loop completes (:meth:`Background.finish_after_exit`),
a compile still running at exit finishes after the process has gone, into the caches the next
run loads, and says so on stderr (``FUNCTRAIN_COMPILE_FINISH=0``: killed too). A run shorter than
its compile would otherwise never start compiled, however often it is repeated. Backends other
than inductor, whose code cannot travel between processes, compile on the training thread right
after the first eager call. The jobs themselves (worker, thread,
inline, cache hit) are :mod:`functrain.compiler.jobs`.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import optree
import torch

from ..core.state import TrainState
from .backend import compile_captured
from .capture import Captured, importing as _importing, preload as _preload, wait_for_imports
from .jobs import (FAILED, READY, RUNNING, TIMEOUT_ENV, FailedJob, InlineJob, Job, LoadedJob, SharedJob, ThreadJob,
                   WorkerJob, _first, leads_at_once)
from .settings import WorkerSettings

__all__ = ["Background", "Progress", "WORKER_ENV", "TIMEOUT_ENV", "RUNNING", "READY", "FAILED"]

WORKER_ENV = "FUNCTRAIN_COMPILE_WORKER"


class Progress:
    """Where a background-compiled call path stands (host values, read by ``ft.run``'s bar and the Trainer).

    Attributes:
        phase:       ``"eager"`` (nothing compiling yet), ``"compiling"``, ``"ready"`` (this process's compiled
                     code is ready: the switch waits for ``switch_at`` or for the other processes), ``"compiled"``
                     (a compiled graph runs) or ``"failed"`` (the compile failed: eager for good; ``reason``).
        eager_calls: calls that ran the eager step.
        compile_s:   seconds from the start of the first graph's trace to its code being loaded here.
        worker_s:    of which the worker's own compile (``None`` without a worker).
        worker_pid:  the running worker's process id, or ``None``.
        source:      where the first graph's code came from: ``"worker"`` (this process's worker compiled it),
                     ``"peer"`` (another process on this machine was compiling it: this one waited for it and
                     loaded its code), ``"cache"`` (an earlier process had: loaded at the first trace),
                     ``"thread"``, ``"here"``
                     (compiled on the training thread: another backend, a package, or a failed load); ``None``
                     before.
        switch_at:   the step count at which the compiled code takes over (``None``: when it is ready).
        workers:     compile workers this process gave a graph to (one machine compiles each graph once: a
                     process that follows another's compile starts none).
        traced:      whether the first graph has been traced (or its trace failed): until then ``ft.memory`` of
                     this call path would trace it itself, waiting for the compiler's imports.
        reason:      why the compile failed, or ``None``.
    """

    __slots__ = ("phase", "eager_calls", "compile_s", "worker_s", "worker_pid", "reason", "switch_at", "source",
                 "workers", "traced")

    def __init__(self, switch_at: int | None = None) -> None:
        self.switch_at = switch_at
        self.phase = "eager"
        self.eager_calls = 0
        self.compile_s: float | None = None
        self.worker_s: float | None = None
        self.worker_pid: int | None = None
        self.reason: str | None = None
        self.source: str | None = None
        self.workers = 0
        self.traced = False

    def __repr__(self) -> str:
        return (f"Progress(phase={self.phase!r}, eager_calls={self.eager_calls}, compile_s={self.compile_s}, "
                f"reason={self.reason!r})")


def _unaliased(state: Any) -> Any:
    """``state`` with no two tensor leaves sharing storage (a duplicate is cloned): what a donating graph, which
    writes every leaf in place, needs of the state it takes over from the eager step."""
    leaves, spec = optree.tree_flatten(state)
    seen: set = set()
    changed = False
    for i, x in enumerate(leaves):
        if torch.is_tensor(x) and x.numel():
            ptr = (x.device, x.untyped_storage().data_ptr())
            if ptr in seen:
                leaves[i] = x.clone()
                changed = True
            else:
                seen.add(ptr)
    return optree.tree_unflatten(spec, leaves) if changed else state


# -- the fallback of a DirectCall -------------------------------------------------------------------
class Background:
    """Runs the calls of ``direct`` (a :class:`~functrain.compiler.runtime.DirectCall`) whose graph is not
    compiled yet, and compiles each such graph off the training thread (see the module docstring).

    ``options``: the compiled step's :class:`~functrain.compiler.options.Options` (``switch_at``, the inductor
    arguments); ``settings``: its :class:`~functrain.compiler.settings.WorkerSettings` (read and checked by
    ``ft.compile``). Installs itself as ``direct.fallback`` and its :class:`Progress` as ``direct.progress``.
    """

    def __init__(self, direct: Any, options: Any, settings: WorkerSettings):
        self.direct = direct
        self.step = direct.step
        self.switch_at: int | None = options.switch_at
        self.inductor = {"mode": options.mode, "options": options.options, "donate": options.donate}
        self.jobs: dict = {}  # signature key -> (Captured, Job)
        self.failed: set = set()
        self.progress = Progress(options.switch_at)
        self._known: tuple | None = None  # (the step tensor the last eager call returned, its host count)
        self._spare: WorkerJob | None = None  # a worker started before the trace, waiting for its job
        self.settings = settings
        self._worker = settings.worker
        if self._worker == "thread":
            warnings.warn(f"{WORKER_ENV}=thread: compiling in a thread of the training process, for comparison "
                          f"only: torch's compiler saves and restores the global random generator and patches "
                          f"nn.Module while it works, so eager steps that run meanwhile may draw other random "
                          f"numbers than the state's key gives", RuntimeWarning, stacklevel=4)
        direct.fallback = self
        direct.progress = self.progress
        _preload()

    # -- the call -------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch: Any, s: Any, key: Any) -> tuple[TrainState, dict]:
        if key in self.failed:
            return self._eager(state, batch)
        entry = self.jobs.get(key)
        at = self.switch_at
        # the trace starts once the compiler's modules are imported (a thread imports them: seconds the eager
        # steps do not wait for), so its call differs between processes: nothing collective may depend on it
        start = None if entry is not None or _importing() else (lambda: self._start(s, state, batch, key))
        if entry is None:
            self._prepare()
        if at is not None and self._steps(state) < at:  # before the switch step: eager, the compile goes on
            if entry is not None:
                self._poll(entry[1])
            return self._eager(state, batch, start=start)
        if at is None:
            # every call until the switch, on every rank: is every rank's compiled code ready? (their MIN)
            status = self.step.agree(RUNNING if entry is None else self._poll(entry[1]))
            if status == RUNNING or (status == READY and entry is None):  # (READY without a job: cannot be)
                return self._eager(state, batch, start=start)
        else:  # at or past the switch step (a resumed run): compile now if need be, wait, agree once
            if entry is None:
                self._start(s, state, batch, key)
                entry = self.jobs[key]
            if self._poll(entry[1]) == RUNNING:
                self.direct.pauses += 1
            status = self.step.agree(entry[1].wait())
        if status == READY:
            cap, job = entry
            self._install(key, cap, job)
            if self.direct.memory != "fresh":
                state = _unaliased(state)
            return self.direct(state, batch)
        self._give_up(key, entry[1] if entry is not None else None)  # some rank's compile failed
        return self._eager(state, batch)

    def _poll(self, job: Job) -> int:
        status = job.poll()
        if status == READY and self.progress.phase == "compiling":
            self.progress.phase = "ready"
        elif status == RUNNING:
            self.progress.worker_pid = getattr(job, "pid", None)  # (a follower that took the compile over)
        return status

    def _eager(self, state: TrainState, batch: Any, start: Callable[[], None] | None = None) -> tuple:
        new, metrics = self.step.host_call(self.step.apply, state, batch)
        if start is not None:
            start()  # traced on the input state, before a donating path retires it
        if self.direct.memory != "fresh":
            # a donated state cannot be stepped again, eager or compiled: its step counter is emptied (the new
            # state never shares it: the step makes step + 1)
            state.step.set_()
        self.progress.eager_calls += 1
        if self.switch_at is not None:
            known = self._known
            n = known[1] if known is not None and known[0] is state.step else None
            if n is not None:
                self._known = (new.step, n + 1)
        return new, metrics

    def _steps(self, state: TrainState) -> int:
        """The state's step count on the host: known without a read when it is the state the last eager call
        returned, else read once (a device sync on a GPU; only with ``switch_at``)."""
        known = self._known
        if known is not None and known[0] is state.step:
            return known[1]
        n = int(state.step)
        self._known = (state.step, n)
        return n

    # -- compiling --------------------------------------------------------------------------------
    def _start(self, s: Any, state: TrainState, batch: Any, key: Any) -> None:
        """Trace the graph here, then start compiling it where the code can be made."""
        self.direct.pauses += 1
        t0 = time.perf_counter()
        wait_for_imports()  # (the trace waits for them too; counted here, in the pause)
        try:
            cap = self.direct.pending.pop(key, None) or self.direct.trace(s, state, batch)  # (ft.memory traced it)
        except Exception as e:  # noqa: BLE001 - GraphBreakError (or what the step raises): train on eagerly
            if self._spare is not None:
                self._spare.close()
                self._spare = None
            job = FailedJob(f"{type(e).__name__}: {e}")
            self.jobs[key] = (None, job)
            p = self.progress  # failed here, now (the ranks agree on it at the next call)
            p.traced, p.reason, p.worker_pid = True, job.reason, None
            running = any(j.status == RUNNING for _, j in self.jobs.values())
            p.phase = "compiling" if running else ("compiled" if self.direct.captures else "failed")
            self._say(job.reason)  # now: the ranks agree on it at the next call
            job.said = True
            return
        if self.direct.packages is None:
            cap.inputs = None  # the first state's tensors: a worker needs only their metadata
        job = self._cached(cap) or self._job(cap)
        job.started = t0  # the compile time counts from the trace
        self.jobs[key] = (cap, job)
        self.progress.phase = "compiling"
        self.progress.traced = True
        self.progress.worker_pid = getattr(job, "pid", None)

    def _job(self, cap: Captured) -> Job:
        backend = self.direct.backend
        if self.direct.packages is not None:  # AOTInductor builds a package from the real inputs: at the switch
            return InlineJob(cap, backend, now=False)
        if not backend.shared:  # a backend other than inductor: its code cannot travel between processes
            return InlineJob(cap, backend)
        if self._worker == "thread":
            return ThreadJob(cap, backend, self.settings)
        from . import cache
        from .backend import fake_inputs
        from .worker import job_payload
        lock = cache.GraphLock(cache.graph_key(cap.gm, fake_inputs(cap.metas)))
        try:
            payload = job_payload(cap.gm, cap.metas, self.inductor, lock=lock.key if lock.usable else None,
                                  lock_timeout=self.settings.lock_timeout)
        except Exception as e:  # noqa: BLE001 - a graph torch cannot serialize: compile it here instead
            lock.close()
            if self._spare is not None:
                self._spare.close()
                self._spare = None
            # compiled on the training thread at the switch, which every rank reaches at the same call: compiling
            # it now would block this rank alone while its peers wait in a collective (past their timeout)
            warnings.warn(f"ft.compile: this step's graph cannot be sent to a compile worker ({type(e).__name__}: "
                          f"{_first(e)}); compiling it on the training thread at the switch (the steps wait)",
                          RuntimeWarning, stacklevel=5)
            return InlineJob(cap, backend, now=False)

        def start(key: str) -> Job:  # this process leads: its worker compiles the graph, under the lock it holds
            worker, self._spare = self._spare, None
            worker = worker if worker is not None else WorkerJob(self.settings)
            self.progress.workers += 1
            worker.send(payload)
            return worker

        def load() -> Any:  # another process compiled it: its code, from the caches
            return backend.load(cap.gm, cap.metas)

        job = SharedJob(lock, load, start, lead=leads_at_once(), grace=self.settings.follow_s,
                        timeout=self.settings.timeout)
        if job.inner is None and self._spare is not None:  # another process compiles it: no worker here
            self._spare.close()
            self._spare = None
        return job

    def _cached(self, cap: Captured) -> Job | None:
        """The graph's code loaded from the caches if an earlier process compiled it (a second run, a resume, a
        rank that another rank's worker served): ready at once, no worker. ``None`` on a miss (which costs the
        cache keys' hashing: nothing is traced or compiled here)."""
        backend = self.direct.backend
        if not backend.shared or self.direct.packages is not None or self._worker != "process":
            return None
        try:
            fn = backend.load(cap.gm, cap.metas)
        except Exception:  # noqa: BLE001 - not cached (or not loadable): the worker compiles it
            return None
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        return LoadedJob(fn)

    def _prepare(self) -> None:
        """Before the eager calls that lead to a compile: the worker process starts (importing torch and
        inductor while this process runs the step and traces it)."""
        if self._spare is None and self._worker == "process" and self.direct.backend.shared \
                and self.direct.packages is None and leads_at_once():
            self._spare = WorkerJob(self.settings)
            self.progress.worker_pid = self._spare.pid
        if self.progress.phase == "eager":
            self.progress.phase = "compiling"

    def _install(self, key: Any, cap: Captured, job: Job) -> None:
        """The switch: the graph's code (loaded from the caches a worker filled) becomes the capture's."""
        del self.jobs[key]
        self.direct.pauses += 1
        d = self.direct
        t0 = time.perf_counter()
        fn = job.code()
        if fn is None and d.packages is None and not isinstance(job, InlineJob):  # (inline: compiled just below)
            try:
                fn = d.backend.load(cap.gm, cap.metas)
            except Exception as e:  # noqa: BLE001 - a missing, corrupt or foreign entry: never used; rebuilt
                warnings.warn(f"ft.compile: the background compile's code did not load here ({type(e).__name__}: "
                              f"{_first(e)}); compiling the step on the training thread (the steps wait)",
                              RuntimeWarning, stacklevel=4)
                fn = None
        for note in job.notes:  # (a damaged cache entry the compile set aside and rebuilt)
            warnings.warn(f"ft.compile: {note}", RuntimeWarning, stacklevel=4)
        source = job.source if fn is not None else "here"
        compile_captured(cap, d.backend, packages=d.packages, cuda_graphs=d.cuda_graphs, fn=fn)
        d.captures[key] = cap
        p = self.progress
        if p.compile_s is None:  # the compile's own time: to its code being ready, plus loading it here
            p.compile_s = ((job.finished or t0) - job.started) + (time.perf_counter() - t0)
            p.worker_s = job.seconds if source == "worker" else None
            p.source = source
        p.worker_pid = None
        p.phase = "compiling" if self.jobs else "compiled"

    def _give_up(self, key: Any, job: Job | None) -> None:
        """The ranks agreed that a graph will not compile: eager for good for that signature, said once."""
        self.jobs.pop(key, None)
        self.failed.add(key)
        if job is not None:
            job.close()
        if self._spare is not None and not self.jobs:
            self._spare.close()
            self._spare = None
        reason = job.reason if job is not None and job.status == FAILED else \
            "another process's compile of this step failed"
        p = self.progress
        p.reason, p.worker_pid = reason, None
        p.phase = "compiling" if self.jobs else ("compiled" if self.direct.captures else "failed")
        if job is None or not job.said:
            self._say(reason)

    def _say(self, reason: str) -> None:
        warnings.warn(f"ft.compile: training on with the eager step; the background compile failed: {reason}",
                      RuntimeWarning, stacklevel=5)

    def finish_after_exit(self, finish: bool = True) -> None:
        """The run ended normally: compiles still running at exit finish after it (into the caches a later run
        loads), unless ``FUNCTRAIN_COMPILE_FINISH=0``; a worker waiting for a graph is stopped now.
        ``finish=False`` takes that back (a run stopped by a signal: its workers die with it)."""
        for _, job in self.jobs.values():
            if isinstance(job, (WorkerJob, SharedJob)):
                job.finish_after_exit(finish)
        if self._spare is not None:
            self._spare.close()
            self._spare = None

    def traced(self, key: Any) -> Captured | None:
        """The capture a compile job for signature ``key`` was started from (as traced: nothing compiled it
        here yet), or ``None``: what :func:`functrain.memory` estimates without tracing again."""
        entry = self.jobs.get(key)
        return entry[0] if entry is not None else None

    def close(self) -> None:
        """Stop every compile still running; their signatures run eagerly from now on (said by no warning:
        the caller asked for it)."""
        for key, (_, job) in list(self.jobs.items()):
            job.close()
            self.failed.add(key)
        self.jobs.clear()
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        p = self.progress
        p.worker_pid = None
        if p.phase in ("compiling", "ready"):
            p.phase, p.reason = ("compiled" if self.direct.captures else "failed"), "stopped by close()"
