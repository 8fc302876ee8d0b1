"""Background compilation: the eager step from the first call, the compiled step once it is ready.

A compiled step equals its eager step by law, so a state made by one is a valid input
to the other, and a run need not wait for a compile. A :class:`BackgroundCompiler` is a
component its :class:`~functrain.compiler.runtime.Runner` owns and asks, for every call whose
graph is not compiled yet (:meth:`BackgroundCompiler.on_miss`); it answers with a decision the
runner acts on: :class:`Eager` (the eager step's result: the graph is not compiled yet, or will
not be) or :class:`Ready` (a traced capture and its compiled code: the runner installs it and
calls it). It writes nothing of the runner's: it reports into its own :class:`Progress`, which
the runner shows as its own. For a new input signature it

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
is killed: nothing of a run outlives it. Opt-in (``FUNCTRAIN_COMPILE_FINISH=1``): when ``ft.run``'s loop
completes (:meth:`BackgroundCompiler.finish_after_exit`), a compile still running at exit finishes after the
process has gone, into the caches the next run loads, and says so on stderr. Backends other
than inductor, whose code cannot travel between processes, compile on the training thread right
after the first eager call. The jobs themselves (worker, thread,
inline, cache hit) are :mod:`functrain.compiler.jobs`.

When compiling pays: for a run of known length (:meth:`BackgroundCompiler.expect`, which ``ft.run`` and the
Trainer call through their runner) a graph that is not in the caches is traced and held, and after
:data:`~functrain.compiler.policy.DECIDE_AFTER` timed eager steps the compile policy
(:func:`functrain.compiler.policy.decide`: the steps left, the measured eager step, this machine's history, its
cores and busy ranks) decides whether to start its compile; a rank that declines says ``DECLINED`` in the per-call
agreement, and then no rank compiles that signature (said once on stderr, with why). Without ``switch_at`` only,
and unless ``FUNCTRAIN_COMPILE_POLICY=always``; a run of unknown length compiles at once, as before.
"""
from __future__ import annotations

import sys
import time
import warnings
from typing import Any, Callable, NamedTuple

import optree
import torch

from ..core.state import TrainState
from .capture import Captured, importing as _importing, preload as _preload, wait_for_imports
from .jobs import (DECLINED, FAILED, READY, RUNNING, TIMEOUT_ENV, FailedJob, InlineJob, Job, LoadedJob, SharedJob,
                   ThreadJob, WorkerJob, _first, leads_at_once)
from .policy import DECIDE_AFTER, Decision
from .progress import Progress
from .settings import WorkerSettings

__all__ = ["BackgroundCompiler", "Eager", "Ready", "Progress", "WORKER_ENV", "TIMEOUT_ENV", "RUNNING", "READY",
           "FAILED"]

WORKER_ENV = "FUNCTRAIN_COMPILE_WORKER"


class Eager(NamedTuple):
    """A decision: this call ran the eager step (the graph is not compiled yet, or will not be); ``new``,
    ``metrics`` are its result; ``paused``: the call did compile work on the caller's thread (the trace)."""

    new: Any
    metrics: dict
    paused: bool


class Ready(NamedTuple):
    """A decision: the graph's code is ready: the runner installs ``capture`` with ``fn`` (``None``: it compiles
    it itself, now: a package, a graph that could not be sent) and calls it; ``paused``: this call did compile
    work (the load, a wait)."""

    capture: Captured
    fn: Any
    paused: bool


class BackgroundCompiler:
    """Compiles a runner's graphs off the caller's thread; answers each call whose graph is not compiled yet.

    ``step``: the eager step; ``options``: the compiled step's :class:`~functrain.compiler.options.Options`
    (``switch_at``, the inductor arguments); ``settings``: its
    :class:`~functrain.compiler.settings.WorkerSettings`; ``backend``, ``packages``: the compiled step's; ``memory``:
    the runner's memory kind (an eager call of a donating runner retires its input state).

    Attributes:
        progress: where the compile stands (:class:`Progress`); the runner shows it as its own.
    """

    def __init__(self, step: Any, options: Any, settings: WorkerSettings, backend: Any, packages: Any,
                 memory: str):
        self.step = step
        self.backend, self.packages, self.memory = backend, packages, memory
        self.switch_at: int | None = options.switch_at
        self.inductor = {"mode": options.mode, "options": options.options, "donate": options.donate}
        self.settings = settings
        self.jobs: dict = {}  # signature key -> (Captured, Job)
        self.failed: set = set()
        self.progress = Progress(options.switch_at)
        self._known: tuple | None = None  # (the step tensor the last eager call returned, its host count)
        self._spare: WorkerJob | None = None  # a worker started before the trace, waiting for its job
        self._worker = settings.worker
        self._installed = 0  # graphs whose code this component handed to the runner
        # the compile policy (see "When compiling pays" above): without switch_at and unless forced
        self._decides = self.switch_at is None and settings.policy != "always"
        self.total: int | None = None  # the steps the caller's run has left (expect()), None: unknown
        self.decision: Decision | None = None  # this process's first decision (its inputs and words)
        self.declined: set = set()  # signatures every rank agreed not to compile in this run
        self._held: dict = {}  # signature key -> Captured traced and not in the caches, waiting for the decision
        self._decisions: dict = {}  # signature key -> this process's Decision
        self._done = 0  # eager calls made
        self._timed: list = []  # the eager calls' own seconds (after the first)
        self._history: Any = None
        self._kind_seen = "cpu:default"  # the kind of the graph that last switched (the history's key)
        if self._worker == "thread":
            warnings.warn(f"{WORKER_ENV}=thread: compiling in a thread of the training process, for comparison "
                          f"only: torch's compiler saves and restores the global random generator and patches "
                          f"nn.Module while it works, so eager steps that run meanwhile may draw other random "
                          f"numbers than the state's key gives", RuntimeWarning, stacklevel=5)
        # the compiler's imports (seconds of CPU) start now, unless the policy may decline this run's compile
        # from its first timed steps alone (a run of known length: see _bound), before anything is imported
        self._imported = not self._decides
        if self._imported:
            _preload()

    # -- the decision -----------------------------------------------------------------------------
    def on_miss(self, state: TrainState, batch: Any, s: Any, key: Any, graphs: Any) -> Eager | Ready:
        """What the runner does with a call whose graph (signature ``key``) is not compiled: see the module
        docstring. ``s``: the state without its RNG key; ``graphs``: the runner's
        :class:`~functrain.compiler.runtime.Graphs` (it traces, and holds what ``ft.memory`` traced)."""
        if key in self.failed or key in self.declined:
            return self._eager(state, batch)
        entry = self.jobs.get(key)
        at = self.switch_at
        # the trace starts once the compiler's modules are imported (a thread imports them: seconds the eager
        # steps do not wait for), so its call differs between processes: nothing collective may depend on it
        never = self._decides and self.settings.policy == "never"  # (declined before anything is traced)
        wait = not self._imported and not never and self._bound(key, state)  # (no import, no trace yet)
        start = None if entry is not None or key in self._held or never or wait or _importing() else \
            (lambda: self._start(s, state, batch, key, graphs))
        if start is not None and at is None:
            # the compiler is imported: trace before this call's eager step (the same work on this thread, in the
            # other order), so that code found in the caches (a second run, a step compiled ahead) runs this call
            start()
            entry = self.jobs.get(key)
            start = _traced  # (this call did compile work)
        if entry is None and self._decides and self._ready_to_decide(key):
            entry = self._decide(key)  # this process's decision: a job started, or None (declined)
        if entry is None:
            self._prepare()
        paused = False
        if at is not None and self._steps(state) < at:  # before the switch step: eager, the compile goes on
            if entry is not None:
                self._poll(entry[1])
            return self._eager(state, batch, start=start)
        if at is None:
            # every call until the switch, on every rank: is every rank's compiled code ready? (their MIN; a rank
            # whose policy declined says DECLINED, and then no rank compiles this signature)
            mine = (DECLINED if key in self._decisions else RUNNING) if entry is None else self._poll(entry[1])
            if mine == READY and start is _traced and not isinstance(entry[1], LoadedJob):
                mine = RUNNING  # compiled at this call's trace (not found in the caches): the switch is at the next
            status = self.step.agree(mine)
            if status == DECLINED:
                self._decline(key, entry)
                return self._eager(state, batch, paused=start is _traced)
            if status == RUNNING or (status == READY and entry is None):  # (READY without a job: cannot be)
                return self._eager(state, batch, start=start)
        else:  # at or past the switch step (a resumed run): compile now if need be, wait, agree once
            if entry is None:
                self._start(s, state, batch, key, graphs)
                entry = self.jobs[key]
            paused = self._poll(entry[1]) == RUNNING
            status = self.step.agree(entry[1].wait())
        if status == READY:
            return self._ready(key, *entry)
        self._give_up(key, entry[1] if entry is not None else None)  # some rank's compile failed
        return self._eager(state, batch, paused=paused)

    # -- the policy: when compiling pays ----------------------------------------------------------
    def expect(self, steps: int | None) -> None:
        """The caller's run has ``steps`` steps left (``None``: unknown): what the policy weighs a compile
        against (:mod:`functrain.compiler.policy`)."""
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 0):
            raise ValueError(f"expect: steps must be an int >= 0 or None; got {steps!r}")
        self.total = None if steps is None else self._done + steps

    def _bound(self, key: Any, state: TrainState) -> bool:
        """Before the compiler is imported (a run of known length under the policy, in a process that has not
        imported the compiler, on a machine whose history holds no compile of this kind: the caches hold no
        such graph): whether to wait. The first :data:`~functrain.compiler.policy.DECIDE_AFTER` timed eager
        calls are waited for; then the policy judges the compile without a trace, from the default's base cost
        (:meth:`~functrain.compiler.history.History.untraced`) and the measured step. A decline there is this
        process's decision (no import, no trace, no worker: the ranks agree on it at this call); otherwise the
        imports start now and the graph is traced and judged as usual. Returns ``True`` while waiting."""
        if key in self._decisions:
            return True
        bound = None
        if self.total is not None and not _compiler_imported():
            bound = self.history().untraced(self._state_kind(state))
        if bound is not None and len(self._timed) < DECIDE_AFTER:
            return True
        if bound is not None and not self._judge(key, None, bound=bound).compile:
            return True
        self._decisions.pop(key, None)  # (the bound's; the traced graph is judged again)
        self.decision = None
        self._imported = True
        _preload()
        return False

    def _state_kind(self, state: TrainState) -> str:
        from .history import kind_of
        leaves = [x for x in optree.tree_leaves(state) if isinstance(x, torch.Tensor)]
        device = leaves[0].device if leaves else None
        return kind_of(((None, None, None, device),), self.inductor["mode"])

    def _ready_to_decide(self, key: Any) -> bool:
        """Decide now? Once the graph is traced (and not in the caches), after :data:`~functrain.compiler.policy.
        DECIDE_AFTER` timed eager steps (at once when forced never, or when the run's length is unknown)."""
        if key in self._decisions:
            return False
        if self.settings.policy == "never":
            return True
        return key in self._held and (self.total is None or len(self._timed) >= DECIDE_AFTER)

    def _kind(self, cap: Captured | None) -> str:
        from .history import kind_of
        return kind_of(cap.metas if cap is not None else (), self.inductor["mode"])

    def history(self) -> Any:
        """This machine's compile history (:class:`~functrain.compiler.history.History`), read once."""
        if self._history is None:
            from .history import History
            self._history = History.beside_caches()
        return self._history

    def _decide(self, key: Any) -> tuple | None:
        """This process's decision for signature ``key`` (the inputs measured now); a compile decided is started
        now (the job entry), a decline returns ``None`` (the ranks agree on it at this call)."""
        cap = self._held.pop(key, None)
        d = self._judge(key, cap)
        if not d.compile:
            return None
        if leads_at_once() and self.decision is d:  # (said once: a later signature's compile is not)
            _console(f"functrain: {d.why}")
        job = self._job(cap)
        job.started = time.perf_counter()
        self.jobs[key] = (cap, job)
        self.progress.phase = "compiling"
        self.progress.worker_pid = getattr(job, "pid", None)
        return self.jobs[key]

    def _judge(self, key: Any, cap: Captured | None, bound: Any = None) -> Decision:
        """The policy's decision for signature ``key`` (traced as ``cap``), from the inputs measured now; kept.
        ``cap=None`` with ``bound`` (a history prediction): before a trace, from that lower bound."""
        import os
        from .policy import Inputs, decide

        nodes = len(cap.gm.graph.nodes) if cap is not None else 0
        if cap is not None:
            pred = self.history().predict(self._kind(cap), nodes)
            cpu_s, ratio, source = pred
        elif bound is not None:  # no graph yet: the cheapest compile a new machine predicts
            cpu_s, ratio, source = bound
        else:  # (forced never: nothing traced)
            cpu_s, ratio, source = 1.0, 1.0, "default"
        timed = sorted(self._timed)
        eager_s = timed[len(timed) // 2] if timed else 0.0
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        try:
            busy = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        except ValueError:
            busy = 1
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
        remaining = None if self.total is None else max(self.total - self._done, 0)
        d = decide(Inputs(remaining, eager_s, cpu_s, ratio, max(cores, 1), busy, load, self.settings.policy,
                          1.0, source))
        self._decisions[key] = d
        if self.decision is None:
            self.decision = d
        return d

    @property
    def eager_only(self) -> bool:
        """Whether this run compiles nothing: every rank agreed the policy's decline and nothing was compiled or
        loaded. The runner then calls :meth:`eager` straight away (no signature key, no decision per call): the
        decline is for the run, a later signature's too."""
        return bool(self.declined) and not self.jobs and not self._installed

    def eager(self, state: TrainState, batch: Any) -> Eager:
        """One eager call of a run that compiles nothing (:attr:`eager_only`)."""
        return self._eager(state, batch)

    def _decline(self, key: Any, entry: tuple | None) -> None:
        """Every rank agreed: this signature runs eagerly for the rest of this run (said once, with why)."""
        self.declined.add(key)
        if key not in self._decisions and key in self._held:  # another rank decided first: this one's numbers too
            self._judge(key, self._held[key])
        self._held.pop(key, None)
        if entry is not None:
            self.jobs.pop(key, None)
            entry[1].close()
        if self._spare is not None and not self.jobs:
            self._spare.close()
            self._spare = None
        p = self.progress
        p.worker_pid = None
        p.phase = "compiling" if self.jobs else ("compiled" if self._installed else "eager")
        mine = self._decisions.get(key)
        why = mine.why if mine is not None and not mine.compile else \
            "another process of this run decided that compiling would not pay; training eagerly"
        if len(self.declined) == 1 and leads_at_once():
            _console(f"functrain: {why}")

    def _record_compile(self, cap: Captured, job: Job) -> None:
        """The outcome of a compile this process's worker made: its CPU seconds, into this machine's history."""
        cpu_s = getattr(job, "cpu_s", None)
        if cpu_s is None and isinstance(job, SharedJob) and job.inner is not None:
            cpu_s = getattr(job.inner, "cpu_s", None)
        if cpu_s is not None and cap is not None and cpu_s > 0:
            self.history().add_compile(self._kind(cap), len(cap.gm.graph.nodes), cpu_s)

    def record_rates(self, eager_s: float | None, compiled_s: float | None) -> None:
        """The run's measured eager and compiled step times (seconds, ``None``: not measured), into this
        machine's history when both are known (by the machine's local rank 0 only)."""
        if eager_s and compiled_s and eager_s > 0 and compiled_s > 0 and leads_at_once():
            self.history().add_steps(self._kind_seen, eager_s, compiled_s)

    def _poll(self, job: Job) -> int:
        status = job.poll()
        if status == READY and self.progress.phase == "compiling":
            self.progress.phase = "ready"
        elif status == RUNNING:
            self.progress.worker_pid = getattr(job, "pid", None)  # (a follower that took the compile over)
        return status

    def _eager(self, state: TrainState, batch: Any, start: Callable[[], None] | None = None,
               paused: bool = False) -> Eager:
        t0 = time.perf_counter()
        new, metrics = self.step.host_call(self.step.apply, state, batch)
        self._done += 1
        if self._done > 1 and len(self._timed) < 64:  # (the first call pays one-time costs: not timed)
            self._timed.append(time.perf_counter() - t0)
        if start is not None:
            start()  # traced on the input state, before a donating runner retires it
            paused = True
        if self.memory != "fresh":
            # a donated state cannot be stepped again, eager or compiled: its step counter is emptied (the new
            # state never shares it: the step makes step + 1)
            state.step.set_()
        if self.switch_at is not None:
            known = self._known
            n = known[1] if known is not None and known[0] is state.step else None
            if n is not None:
                self._known = (new.step, n + 1)
        return Eager(new, metrics, paused)

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
    def _start(self, s: Any, state: TrainState, batch: Any, key: Any, graphs: Any) -> None:
        """Trace the graph here, then start compiling it where the code can be made."""
        t0 = time.perf_counter()
        wait_for_imports()  # (the trace waits for them too; counted here, in the pause)
        try:
            cap = graphs.take_pending(key) or graphs.trace(s, state, batch)  # (ft.memory traced it)
        except Exception as e:  # noqa: BLE001 - GraphBreakError (or what the step raises): train on eagerly
            if self._spare is not None:
                self._spare.close()
                self._spare = None
            job = FailedJob(f"{type(e).__name__}: {e}")
            self.jobs[key] = (None, job)
            p = self.progress  # failed here, now (the ranks agree on it at the next call)
            p.traced, p.reason, p.worker_pid = True, job.reason, None
            running = any(j.status == RUNNING for _, j in self.jobs.values())
            p.phase = "compiling" if running else ("compiled" if self._installed else "failed")
            self._say(job.reason)  # now: the ranks agree on it at the next call
            job.said = True
            return
        if self.packages is None:
            cap.inputs = None  # the first state's tensors: a worker needs only their metadata
        job = self._cached(cap)
        if job is None and self._decides:  # not in the caches: compiled only if the policy says it pays
            self._held[key] = cap
            self.progress.traced = True
            return
        job = job or self._job(cap)
        job.started = t0  # the compile time counts from the trace
        self.jobs[key] = (cap, job)
        self.progress.phase = "compiling"
        self.progress.traced = True
        self.progress.worker_pid = getattr(job, "pid", None)

    def _job(self, cap: Captured) -> Job:
        backend = self.backend
        if self.packages is not None:  # AOTInductor builds a package from the real inputs: at the switch
            return InlineJob(cap, backend, now=False)
        if not backend.shared:  # a backend other than inductor: its code cannot travel between processes
            return InlineJob(cap, backend)
        if self._worker == "thread":
            return ThreadJob(cap, backend, self.settings)
        from .graph_lock import GraphLock, graph_key
        from .backend import fake_inputs
        from .worker import job_payload
        lock = GraphLock(graph_key(cap.gm, fake_inputs(cap.metas)))
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
        backend = self.backend
        if not backend.shared or self.packages is not None or self._worker != "process":
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
        # (a run of known length starts no worker before the policy's decision)
        if self._spare is None and self._worker == "process" and self.backend.shared \
                and self.packages is None and leads_at_once() and (not self._decides or self.total is None):
            self._spare = WorkerJob(self.settings)
            self.progress.worker_pid = self._spare.pid
        if self.progress.phase == "eager" and (not self._decides or self.total is None):
            self.progress.phase = "compiling"

    def _ready(self, key: Any, cap: Captured, job: Job) -> Ready:
        """The switch: the graph's code (loaded from the caches a worker filled) for the runner to install."""
        del self.jobs[key]
        t0 = time.perf_counter()
        fn = job.code()
        if fn is None and self.packages is None and not isinstance(job, InlineJob):  # (inline: compiled by install)
            try:
                fn = self.backend.load(cap.gm, cap.metas)
            except Exception as e:  # noqa: BLE001 - a missing, corrupt or foreign entry: never used; rebuilt
                warnings.warn(f"ft.compile: the background compile's code did not load here ({type(e).__name__}: "
                              f"{_first(e)}); compiling the step on the training thread (the steps wait)",
                              RuntimeWarning, stacklevel=5)
                fn = None
        for note in job.notes:  # (a damaged cache entry the compile set aside and rebuilt)
            warnings.warn(f"ft.compile: {note}", RuntimeWarning, stacklevel=5)
        source = job.source if fn is not None else "here"
        self._kind_seen = self._kind(cap)
        if source == "worker":
            self._record_compile(cap, job)
        p = self.progress
        if p.compile_s is None:  # the compile's own time: to its code being ready, plus loading it here
            p.compile_s = ((job.finished or t0) - job.started) + (time.perf_counter() - t0)
            p.worker_s = job.seconds if source == "worker" else None
            p.source = source
        p.worker_pid = None
        self._installed += 1
        p.phase = "compiling" if self.jobs else "compiled"
        return Ready(cap, fn, True)

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
        p.phase = "compiling" if self.jobs else ("compiled" if self._installed else "failed")
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
        return entry[0] if entry is not None else self._held.get(key)

    def close(self) -> None:
        """Stop every compile still running; their signatures run eagerly from now on (said by no warning:
        the caller asked for it)."""
        for key, (_, job) in list(self.jobs.items()):
            job.close()
            self.failed.add(key)
        self.jobs.clear()
        self._held.clear()
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        p = self.progress
        p.worker_pid = None
        if p.phase in ("compiling", "ready"):
            p.phase, p.reason = ("compiled" if self._installed else "failed"), "stopped by close()"


def _compiler_imported() -> bool:
    """Whether this process has imported the compiler already (another step compiled here, a precompile): then
    a trace costs no imports and is how a graph in the caches is found."""
    return "torch._inductor.compile_fx" in sys.modules


def _traced() -> None:
    """(the trace of this call was made already)"""


def _console(line: str) -> None:
    import sys
    print(line, file=sys.stderr, flush=True)
