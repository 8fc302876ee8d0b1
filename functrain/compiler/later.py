"""Packages for the next run, built by a background worker after the run's own compile (issue 40).

A run whose step compiled in the background (``ft.compile(..., package=True)`` with a background runner: the
Trainer's default) trains on the code a worker compiled into inductor's caches: nobody waits for a package there.
A later process would then trace its step and load those caches (seconds, the compiler imported) instead of
starting from its first step. So once that code is installed, :class:`PackageLater` starts one more worker
process (niced, as the compile's) that builds the graph's AOTInductor package into the package folder and writes
its warm entry (:mod:`functrain.compiler.warm`): the next run of the step is compiled from its first call, without
a trace. The training thread does not wait for it and calls nothing of it per step.

Within the run's life: the worker is killed with its compiler children when the run's process exits, is
SIGKILLed, or closes the step, unless the run ended normally and ``FUNCTRAIN_COMPILE_FINISH=1`` lets background
compiles finish after it (:func:`functrain.compiler.jobs.outlives`, the same rule). One worker per machine: only
the process that leads compiles (local rank 0), once per warm key; a key whose entry is there already is left
alone. :meth:`PackageLater.wait` waits for the builds (what a caller that wants the next run warm does before it
exits).
"""
from __future__ import annotations

import os
from typing import Any

from .jobs import READY, RUNNING, WorkerJob, leads_at_once
from .settings import WorkerSettings

__all__ = ["PackageLater"]


class PackageLater:
    """The package builds for the next run of one compiled step (see the module docstring).

    ``folder``: the packages' root (``Packages(folder)``'s argument); ``settings``: the workers' (timeout, nice).

    Attributes:
        started: builds started; ``built``: builds that wrote their package and warm entry; ``failed``: the
            reasons of builds that did not (a graph AOTInductor cannot take, a killed worker).
    """

    def __init__(self, folder: str, settings: WorkerSettings, lock_timeout: float = 600.0):
        self.folder = folder
        self.settings = settings
        self.lock_timeout = lock_timeout
        self.started = 0
        self.built = 0
        self.failed: list[str] = []
        self._jobs: dict[str, WorkerJob] = {}
        self._ended: set[str] = set()  # the keys whose build ended and was counted
        self._unsent: set[str] = set()  # the keys whose graph could not be sent to a worker

    def start(self, gm: Any, metas: tuple, prekey: str | None, plan: dict | None, files: tuple[str, str]) -> bool:
        """Build the package of graph ``gm`` over inputs of ``metas`` in a worker, and its warm entry under
        ``prekey`` with the output ``plan`` (:meth:`~functrain.compiler.warm.WarmStarts.plan`); ``files``: the
        entry's path and its refusal's (:meth:`~functrain.compiler.warm.WarmStarts.refusal`): a build is not
        started when either exists. ``False``: not started (not this process's to build, or nothing to key)."""
        if prekey is None or plan is None or prekey in self._jobs or not leads_at_once():
            return False
        if any(os.path.exists(f) for f in files):
            return False  # (there already; or an earlier build found it cannot be packaged: worker._package)
        from .worker import job_payload

        try:
            payload = job_payload(gm, metas, {}, package={
                "folder": self.folder, "prekey": prekey, "plan": plan, "lock_timeout": self.lock_timeout})
        except Exception as e:  # noqa: BLE001 - a graph torch cannot serialize: no package for the next run
            self.failed.append(f"its graph cannot be sent to a worker ({type(e).__name__}: {e})")
            self._unsent.add(prekey)
            return False
        job = WorkerJob(self.settings)
        job.send(payload)
        self._jobs[prekey] = job
        self.started += 1
        return True

    def poll(self) -> int:
        """Look at every build (counting those that ended in ``built`` or ``failed``); how many still run."""
        return sum(self._poll(k) == RUNNING for k in list(self._jobs))

    def wait(self) -> int:
        """Block until every build has ended (each bounded by the workers' timeout); the number that wrote their
        package and entry, in all."""
        for key in list(self._jobs):
            self._jobs[key].wait()
            self._poll(key)
        return self.built

    def ended_without(self, prekey: str) -> bool:
        """Whether this process's build for ``prekey`` ended without writing its package (failed, killed, or its
        graph could not be sent); ``False`` while it runs, after it wrote it, or when this process built none."""
        if prekey in self._unsent:
            return True
        return prekey in self._jobs and self._poll(prekey) not in (RUNNING, READY)

    def _poll(self, key: str) -> int:
        status = self._jobs[key].poll()
        if status != RUNNING and key not in self._ended:
            self._ended.add(key)
            if status == READY:
                self.built += 1
            else:
                self.failed.append(self._jobs[key].reason or "the worker ended without an answer")
        return status

    def finish_after_exit(self, finish: bool = True) -> None:
        """The run ended normally (``finish``): builds still running may finish after the process exits if the
        settings allow it (``FUNCTRAIN_COMPILE_FINISH``), else they are killed at exit."""
        for job in self._jobs.values():
            job.finish_after_exit(finish)

    def close(self) -> None:
        """Stop the builds that still run (their workers are killed)."""
        for job in self._jobs.values():
            job.close()
