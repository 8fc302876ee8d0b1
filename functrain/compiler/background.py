"""Background compilation: the eager step from the first call, the compiled step once it is ready.

State: one table, input signature -> :class:`Record` (its capture, its job, this process's decision and an
explicit status: ``waiting`` (seen, not traced yet) -> ``held`` (traced, waiting for the policy) -> ``compiling``
-> ``ready`` (installed in the runner) | ``failed`` | ``declined``); the compile budget (:class:`~functrain.
compiler.budget.Budget`); the worker pool (:class:`~functrain.compiler.jobs.WorkerPool`). :meth:`BackgroundCompiler.
on_miss` dispatches on a record's status; the :class:`Progress` the runner shows is written by one method
(:meth:`BackgroundCompiler._report`), from the records.

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
:data:`~functrain.compiler.policy.DECIDE_AFTER` timed eager steps each rank's compile budget
(:class:`~functrain.compiler.budget.Budget`: the steps left, the measured eager step, this machine's history, its
cores and busy ranks) gives its numbers to the per-call agreement; once every rank that waits for a decision has
given them, every rank decides from the same combined numbers (:func:`functrain.compiler.policy.combine`: the
slowest step, the dearest compile): one decision, the same on every rank and in every rank's metrics, said once
on stderr by the run's first rank. A decline is for every rank: no rank compiles that signature. Without
``switch_at`` only, and unless ``FUNCTRAIN_COMPILE_POLICY=always``; a run of unknown length compiles at once, as
before.
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings
from typing import Any

from ..core.state import TrainState
from .budget import Budget
from .capture import Captured, importing as _importing, preload as _preload, wait_for_imports
from .jobs import (DECLINED, FAILED, READY, RUNNING, TIMEOUT_ENV, FailedJob, InlineJob, Job, LoadedJob, SharedJob,
                   ThreadJob, WorkerJob, WorkerPool, _first, leads_at_once)
from .policy import VOTE_SIZE, Decision, from_vote, vote
from .progress import Progress
from .records import COMPILING, DECLINED_, GAVE_UP, HELD, INSTALLED, WAITING, Eager, Ready, Record
from .settings import WorkerSettings

__all__ = ["BackgroundCompiler", "Progress", "WORKER_ENV", "TIMEOUT_ENV", "RUNNING", "READY", "FAILED"]

WORKER_ENV = "FUNCTRAIN_COMPILE_WORKER"
_BALLOT = 4  # a ballot's fields before the policy's vote (see BackgroundCompiler._ballot)


class BackgroundCompiler:
    """Compiles a runner's graphs off the caller's thread; answers each call whose graph is not compiled yet.

    ``step``: the eager step; ``options``: the compiled step's :class:`~functrain.compiler.options.Options`
    (``switch_at``, the inductor arguments); ``settings``: its
    :class:`~functrain.compiler.settings.WorkerSettings`; ``backend``, ``packages``: the compiled step's; ``memory``:
    the runner's memory kind (an eager call of a donating runner retires its input state); ``defer_imports``: the
    compiler's imports wait for a call that misses (a runner that may start warm: ``package=True``).

    Attributes:
        progress: where the compile stands (:class:`Progress`); the runner shows it as its own.
        records: ``{signature key: Record}``.
        budget: the run's compile :class:`~functrain.compiler.budget.Budget`.
    """

    def __init__(self, step: Any, options: Any, settings: WorkerSettings, backend: Any, packages: Any,
                 memory: str, defer_imports: bool = False):
        self.step, self.backend, self.packages, self.memory, self.settings = step, backend, packages, memory, settings
        self.switch_at: int | None = options.switch_at
        self.inductor = {"mode": options.mode, "options": options.options, "donate": options.donate}
        self.records: dict[Any, Record] = {}
        self.budget = Budget(settings.policy, options.mode)
        self.pool = WorkerPool(settings)
        self.progress = Progress(options.switch_at)
        self._known: tuple | None = None  # (the step tensor the last eager call returned, its host count)
        # the compile policy (see "When compiling pays" above): without switch_at and unless forced
        self._decides = self.switch_at is None and settings.policy != "always"
        self._prepared = False  # a compile is on its way (what the phase says before any record compiles)
        self._stopped = False  # close() stopped a compile
        if settings.worker == "thread":
            warnings.warn(f"{WORKER_ENV}=thread: compiling in a thread of the training process, for comparison "
                          f"only: torch's compiler saves and restores the global random generator and patches "
                          f"nn.Module while it works, so eager steps that run meanwhile may draw other random "
                          f"numbers than the state's key gives", RuntimeWarning, stacklevel=5)
        # the compiler's imports (seconds of CPU) start now (defer_imports: at the first call that misses, which a
        # warm start never makes), unless the policy may decline this run's compile from its first timed steps
        # alone (a run of known length: see _may_trace), before anything is imported
        self._imported = not self._decides
        if self._imported and not defer_imports:
            _preload()

    # -- the decision: a dispatch on the signature's record ---------------------------------------
    def on_miss(self, state: TrainState, batch: Any, s: Any, key: Any, graphs: Any) -> Eager | Ready:
        """What the runner does with a call whose graph (signature ``key``) is not compiled: see the module
        docstring. ``s``: the state without its RNG key; ``graphs``: the runner's
        :class:`~functrain.compiler.runtime.Graphs` (it traces, and holds what ``ft.memory`` traced)."""
        rec = self.records.get(key) or self.records.setdefault(key, Record(key))
        if rec.status in (GAVE_UP, DECLINED_):
            return self._eager(state, batch)
        if self._imported:
            _preload()  # (once per process)
        decision = self._dispatch(rec, state, batch, s, graphs)
        self._report()
        return decision

    def _dispatch(self, rec: Record, state: TrainState, batch: Any, s: Any, graphs: Any) -> Eager | Ready:
        polled = rec.status == COMPILING  # (a job from an earlier call: polled before the switch step)
        traced = after = False
        if rec.status == WAITING and self._may_trace(rec, state):
            if self.switch_at is None:  # trace before this call's eager step, so that code in the caches runs now
                self._trace(rec, s, state, batch, graphs)
                traced = True
            else:
                after = True  # traced after this call's eager step, on its input state
        if rec.status != COMPILING:
            self._prepare()
        if self.switch_at is None:
            return self._agree(rec, state, batch, traced)
        if self._steps(state) < self.switch_at:  # before the switch step: eager, the compile goes on
            if polled:
                rec.job.poll()
            return self._eager(state, batch, trace=(rec, s, graphs) if after else None)
        return self._switch_step(rec, s, state, batch, graphs)

    def _agree(self, rec: Record, state: TrainState, batch: Any, traced: bool) -> Eager | Ready:
        """Switch when ready: every call until the switch, on every rank, is every rank's compiled code ready?
        (their MIN; a rank whose compile failed says FAILED, and then no rank compiles this signature). The same
        collective carries the compile policy's votes (:meth:`_ballot`): once every rank that waits for a decision
        has its numbers, every rank decides from the same combined numbers (:meth:`_decided`)."""
        if rec.status == COMPILING:
            mine = rec.job.poll()
            if mine == READY and traced and not isinstance(rec.job, LoadedJob):
                mine = RUNNING  # compiled at this call's trace (not found in the caches): the switch is at the next
        else:
            mine = DECLINED if rec.decision is not None and not rec.decision.compile else RUNNING
        agreed = self.step.agree(self._ballot(rec, state, mine))
        status = int(agreed[0])
        if status in (RUNNING, READY) and agreed[1] < 0 and agreed[2] > 0:  # a rank asks; every one has its numbers
            self._decided(rec, from_vote(agreed[_BALLOT:]), final=agreed[3] > 0)
            if rec.status == DECLINED_:
                return self._eager(state, batch, paused=traced)
            status = min(status, RUNNING)  # (a compile decided now: nothing to switch to at this call)
        if status == DECLINED:
            self._decline(rec)
            return self._eager(state, batch, paused=traced)
        if status == RUNNING or (status == READY and rec.status != COMPILING):  # (READY without a job: cannot be)
            return self._eager(state, batch, paused=traced)
        if status == READY:
            return self._ready(rec)
        self._give_up(rec)  # some rank's compile failed
        return self._eager(state, batch)

    def _ballot(self, rec: Record, state: TrainState, mine: int) -> tuple:
        """This rank's part of a call's agreement: its status (MIN), whether it waits for the policy's decision on
        this signature (negated: MAX), whether it has its numbers, whether they are of a traced graph (MIN: not
        asking counts as both), then its :func:`~functrain.compiler.policy.vote` (``inf``: none to give)."""
        asks = self._decides and rec.status in (WAITING, HELD) and rec.decision is None
        inputs = self._inputs(rec, state) if asks else None
        numbers = vote(inputs) if inputs is not None else (math.inf,) * VOTE_SIZE
        return (float(mine), -float(asks), float(inputs is not None or not asks),
                float(rec.status == HELD or self.settings.policy == "never" or not asks)) + numbers

    def _inputs(self, rec: Record, state: TrainState) -> Any:
        """This rank's numbers for the policy's decision on a signature waiting for one, or ``None`` while it has
        none yet: a held (traced) graph's after :data:`~functrain.compiler.policy.DECIDE_AFTER` timed eager steps
        (at once when the run's length is unknown, or forced never); before anything is imported, the history's
        cheapest prediction of an untraced graph (:meth:`_untraced`), after the same timed steps."""
        if self.settings.policy == "never":
            return self.budget.inputs(None)
        if rec.status == HELD:
            return self.budget.inputs(rec.capture) if self.budget.measured else None
        bound = None if self._imported else self._untraced(state)
        if bound is None or self.budget.waits(bound):
            return None  # (traced soon: the compiler's imports are under way; or more steps to time)
        return self.budget.inputs(None, bound=bound)

    def _decided(self, rec: Record, inputs: Any, final: bool) -> None:
        """Every rank decides from the run's ``inputs`` (combined over its ranks): the same decision on each. A
        decline is for every rank (the one whose code is in the caches too); a compile starts this rank's (a held
        graph); ``final`` is false when some rank judged its graph untraced: then a compile decided starts the
        untraced ranks' imports and trace, and the traced graphs are judged again. Said once, by the run's first
        rank."""
        d = self.budget.decide(inputs, final=final)
        if not d.compile:
            self._decline(rec, d)
            return
        if not final:
            if rec.status == WAITING and not self._imported:
                self._imported = True
                _preload()
            return
        if rec.status == HELD:
            rec.decision = d
            if speaks() and self.budget.decision is d:  # (said once: a later signature's compile is not)
                _console(f"functrain: {d.why}")
            self._compile(rec, self._job(rec.capture), time.perf_counter())

    def _switch_step(self, rec: Record, s: Any, state: TrainState, batch: Any, graphs: Any) -> Eager | Ready:
        """At or past the switch step (a resumed run too): compile now if need be, wait, agree once."""
        if rec.status != COMPILING:
            self._trace(rec, s, state, batch, graphs)
        paused = rec.job.poll() == RUNNING
        if self.step.agree(rec.job.wait()) == READY:
            return self._ready(rec)
        self._give_up(rec)
        return self._eager(state, batch, paused=paused)

    # -- the policy: when compiling pays (the budget answers) -------------------------------------
    def expect(self, steps: int | None) -> None:
        """The caller's run has ``steps`` steps left (``None``: unknown): what the policy weighs a compile
        against (:mod:`functrain.compiler.policy`)."""
        self.budget.expect(steps)

    @property
    def decision(self) -> Decision | None:
        """This process's first decision (its inputs and words), or ``None``."""
        return self.budget.decision

    @property
    def declined(self) -> set:
        """The signatures every rank agreed not to compile in this run."""
        return {k for k, r in self.records.items() if r.status == DECLINED_}

    def _may_trace(self, rec: Record, state: TrainState) -> bool:
        """Whether a waiting signature is traced now: not while the compiler's modules are imported by a thread
        (seconds the eager steps do not wait for: the trace's call differs between processes, so nothing collective
        may depend on it), nor while the policy may still decline it untraced (:meth:`_untraced`), nor ever under
        the forced ``never``."""
        if self._decides and self.settings.policy == "never":
            return False
        if not self._imported:
            if self._untraced(state) is not None:  # judged untraced first (the ranks agree on it, see _agree)
                return False
            self._imported = True
            _preload()
        return not _importing()

    def _untraced(self, state: TrainState) -> Any:
        """Before the compiler is imported (a run of known length under the policy, in a process that has not
        imported the compiler, on a machine whose history holds no compile of this kind: the caches hold no such
        graph): the history's cheapest prediction of this graph's compile, which the policy judges after
        :data:`~functrain.compiler.policy.DECIDE_AFTER` timed eager calls, with no import, no trace, no worker;
        ``None``: trace it and judge the graph."""
        return self.budget.untraced(state, _compiler_imported()) if self._decides else None

    @property
    def eager_only(self) -> bool:
        """Whether this run compiles nothing: every rank agreed the policy's decline and nothing was compiled or
        loaded. The runner then calls :meth:`eager` straight away (no signature key, no decision per call): the
        decline is for the run, a later signature's too."""
        statuses = {r.status for r in self.records.values()}
        return DECLINED_ in statuses and COMPILING not in statuses and INSTALLED not in statuses

    def eager(self, state: TrainState, batch: Any) -> Eager:
        """One eager call of a run that compiles nothing (:attr:`eager_only`)."""
        return self._eager(state, batch)

    def _decline(self, rec: Record, decision: Decision | None = None) -> None:
        """Every rank agreed (``decision``: the policy's, the same on every rank): this signature runs eagerly for
        the rest of this run (said once, with why, by the run's first rank)."""
        if decision is not None:
            rec.decision = decision
        mine = rec.decision
        if rec.job is not None:
            rec.job.close()
        rec.status, rec.job, rec.capture = DECLINED_, None, None
        if not self._compiling():
            self.pool.release()
        self._prepared = False
        self._report()
        why = mine.why if mine is not None and not mine.compile else \
            "another process of this run decided that compiling would not pay; training eagerly"
        if len(self.declined) == 1 and speaks():
            _console(f"functrain: {why}")

    def record_rates(self, eager_s: float | None, compiled_s: float | None) -> None:
        """The run's measured eager and compiled step times (seconds, ``None``: not measured), into this
        machine's history when both are known (by the machine's local rank 0 only)."""
        self.budget.record_rates(eager_s, compiled_s, leads_at_once())

    def _eager(self, state: TrainState, batch: Any, trace: tuple | None = None, paused: bool = False) -> Eager:
        t0 = time.perf_counter()
        new, metrics = self.step.host_call(self.step.apply, state, batch)
        self.budget.eager_call(time.perf_counter() - t0)
        self.progress.eager_calls += 1  # (the runner's progress: written here only)
        if trace is not None:  # traced on the input state, before a donating runner retires it
            rec, s, graphs = trace
            self._trace(rec, s, state, batch, graphs)
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
    def _trace(self, rec: Record, s: Any, state: TrainState, batch: Any, graphs: Any) -> None:
        """Trace the graph here, then start compiling it where the code can be made (or hold it for the policy)."""
        t0 = time.perf_counter()
        wait_for_imports()  # (the trace waits for them too; counted here, in the pause)
        self.progress.traced = True
        try:
            cap = graphs.take_pending(rec.key) or graphs.trace(s, state, batch)
        except Exception as e:  # noqa: BLE001 - GraphBreakError (or what the step raises): train on eagerly
            self.pool.release()
            job = FailedJob(f"{type(e).__name__}: {e}")
            self._compile(rec, job, t0)  # failed here, now (the ranks agree on it at the next call)
            self.progress.reason = job.reason
            self._say(job.reason)
            job.said = True
            return
        if self.packages is None:
            cap.inputs = None  # the first state's tensors: a worker needs only their metadata
        rec.capture = cap
        job = self._cached(cap)
        if job is None and self._decides:  # not in the caches: compiled only if the policy says it pays
            rec.status = HELD
            return
        self._compile(rec, job or self._job(cap), t0)

    def _compile(self, rec: Record, job: Job, started: float) -> None:
        rec.status, rec.job = COMPILING, job
        job.started = started  # the compile time counts from the trace
        self._report()

    def _job(self, cap: Captured) -> Job:
        backend = self.backend
        if self.packages is not None:  # AOTInductor builds a package from the real inputs: at the switch
            return InlineJob(cap, backend, now=False)
        if not backend.shared:  # a backend other than inductor: its code cannot travel between processes
            return InlineJob(cap, backend)
        if self.settings.worker == "thread":
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
            self.pool.release()
            # compiled on the training thread at the switch, which every rank reaches at the same call: compiling
            # it now would block this rank alone while its peers wait in a collective (past their timeout)
            warnings.warn(f"ft.compile: this step's graph cannot be sent to a compile worker ({type(e).__name__}: "
                          f"{_first(e)}); compiling it on the training thread at the switch (the steps wait)",
                          RuntimeWarning, stacklevel=5)
            return InlineJob(cap, backend, now=False)
        return SharedJob(lock, cap, backend, self.pool, payload, lead=leads_at_once(), grace=self.settings.follow_s,
                         timeout=self.settings.timeout)

    def _cached(self, cap: Captured) -> Job | None:
        """The graph's code loaded from the caches if an earlier process compiled it (a second run, a resume, a
        rank that another rank's worker served): ready at once, no worker. ``None`` on a miss (which costs the
        cache keys' hashing: nothing is traced or compiled here)."""
        backend = self.backend
        if not backend.shared or self.packages is not None or self.settings.worker != "process":
            return None
        try:
            fn = backend.load(cap.gm, cap.metas)
        except Exception:  # noqa: BLE001 - not cached (or not loadable): the worker compiles it
            return None
        self.pool.release()
        return LoadedJob(fn)

    def _prepare(self) -> None:
        """Before the eager calls that lead to a compile: the worker process starts (importing torch and
        inductor while this process runs the step and traces it)."""
        if self._decides and self.budget.total is not None:  # (no worker before the policy's decision)
            return
        if self.settings.worker == "process" and self.backend.shared and self.packages is None and leads_at_once():
            self.pool.warm()
        self._prepared = True

    def _ready(self, rec: Record) -> Ready:
        """The switch: the graph's code (loaded from the caches a worker filled) for the runner to install."""
        cap, job = rec.capture, rec.job
        rec.status, rec.job = INSTALLED, None
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
        self.budget.switched(cap)
        if source == "worker":  # the compile's CPU seconds, into this machine's history
            inner = job.inner if isinstance(job, SharedJob) else None
            self.budget.record_compile(cap, job.cpu_s if job.cpu_s is not None else getattr(inner, "cpu_s", None))
        p = self.progress
        if p.compile_s is None:  # the compile's own time: to its code being ready, plus loading it here
            p.compile_s = ((job.finished or t0) - job.started) + (time.perf_counter() - t0)
            p.worker_s = job.seconds if source == "worker" else None
            p.source = source
        self._report()
        return Ready(cap, fn, True)

    def found(self, key: Any) -> None:
        """Signature ``key``'s graph was compiled by another runner of the step (the graphs are the step's): this
        runner calls it from now on, its record is ready."""
        rec = self.records.get(key) or self.records.setdefault(key, Record(key))
        if rec.status != INSTALLED:
            if rec.job is not None:
                rec.job.close()
            rec.status, rec.job = INSTALLED, None
            self._report()

    def _give_up(self, rec: Record) -> None:
        """The ranks agreed that a graph will not compile: eager for good for that signature, said once."""
        job = rec.job
        rec.status, rec.job = GAVE_UP, None
        if job is not None:
            job.close()
        if not self._compiling():
            self.pool.release()
        reason = job.reason if job is not None and job.status == FAILED else \
            "another process's compile of this step failed"
        self.progress.reason = reason
        self._report()
        if job is None or not job.said:
            self._say(reason)

    def _say(self, reason: str) -> None:
        warnings.warn(f"ft.compile: training on with the eager step; the background compile failed: {reason}",
                      RuntimeWarning, stacklevel=5)

    def _compiling(self) -> list[Record]:
        return [r for r in self.records.values() if r.status == COMPILING]

    def _report(self) -> None:
        """The one writer of :attr:`progress`'s phase and worker: from the records. ``ready``: a compile's code is
        ready here, the switch waits (``switch_at``, the other processes); ``compiling``: one runs (or is on its
        way); ``compiled``: a graph's code was installed; ``failed``: a compile failed (and none was installed);
        ``eager``: nothing compiles."""
        compiling = self._compiling()
        statuses = {r.status for r in self.records.values()}
        running = [r.job for r in compiling if r.job.status == RUNNING]
        if any(r.job.status == READY for r in compiling):
            phase = "ready"
        elif running:
            phase = "compiling"
        elif INSTALLED in statuses:
            phase = "compiled"
        elif GAVE_UP in statuses or compiling or self._stopped:
            phase = "failed"
        elif self._prepared and DECLINED_ not in statuses:
            phase = "compiling"
        else:
            phase = "eager"
        p = self.progress
        p.phase = phase
        pids = [getattr(j, "pid", None) for j in running]
        p.worker_pid = next((pid for pid in pids if pid is not None), None) if running else self.pool.spare_pid
        p.workers = self.pool.given

    def finish_after_exit(self, finish: bool = True) -> None:
        """The run ended normally: compiles still running at exit finish after it (into the caches a later run
        loads), unless ``FUNCTRAIN_COMPILE_FINISH=0``; a worker waiting for a graph is stopped now.
        ``finish=False`` takes that back (a run stopped by a signal: its workers die with it)."""
        for rec in self._compiling():
            if isinstance(rec.job, (WorkerJob, SharedJob)):
                rec.job.finish_after_exit(finish)
        self.pool.finish_after_exit()

    def traced(self, key: Any) -> Captured | None:
        """The capture a compile job for signature ``key`` was started from (as traced: nothing compiled it
        here yet), or ``None``: what :func:`functrain.memory` estimates without tracing again."""
        rec = self.records.get(key)
        return rec.capture if rec is not None and rec.status in (HELD, COMPILING) else None

    def close(self) -> None:
        """Stop every compile still running; their signatures run eagerly from now on (said by no warning:
        the caller asked for it)."""
        for rec in self.records.values():
            if rec.status in (COMPILING, HELD):
                if rec.job is not None:
                    rec.job.close()
                rec.status, rec.job = GAVE_UP if rec.status == COMPILING else WAITING, None
                if rec.status == WAITING:
                    rec.capture = None
        self.pool.release()
        if self.progress.phase in ("compiling", "ready"):
            self._stopped, self._prepared = True, False
            self.progress.reason = "stopped by close()"
        self._report()


def _compiler_imported() -> bool:
    """Whether this process has imported the compiler already (another step compiled here, a precompile): then
    a trace costs no imports and is how a graph in the caches is found."""
    return "torch._inductor.compile_fx" in sys.modules


def speaks() -> bool:
    """Whether this process says the run's compile decisions on the console: the run's first rank (``RANK`` 0, or
    a process that is not one of several ranks). Every rank decides the same (see ``_agree``); one says it."""
    return os.environ.get("RANK", "0").strip() in ("", "0")


def _console(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
