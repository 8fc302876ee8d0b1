"""torchrun's agent as ``python -m functrain.launch`` runs it: the grace period it was given, and how each rank ended.

Two things torchrun (2.13) gets wrong, fixed here for the launcher's own process:

* **The grace period.** ``--shutdown-timeout`` (functrain's ``--term-timeout``) is used
  only when the launcher itself is signalled. When a rank fails, the worker context
  stops the others with ``close()`` at its default of 30 s (``PContext._poll``), and the
  agent's ``_stop_workers`` calls ``_shutdown()`` with the same default: a hung rank got
  30 s between SIGTERM and SIGKILL whatever the flag said. Every ``close`` of the worker
  context made by :class:`Agent` uses the agent's shutdown timeout.
* **Ranks that finished.** torchrun's failure list leaves out ranks that exited 0, so a
  rank that left early while the others still ran (their next collective then fails
  with "Connection closed by peer") was never named. :class:`Agent` notes when each
  rank ended with status 0, and the exit status of every rank after a shutdown.

:func:`watching` puts :class:`Agent` in place of ``LocalElasticAgent`` in
``torch.distributed.launcher.api`` (the name ``launch_agent`` constructs) while the
launcher runs, and hands back a :class:`Watch` with what it saw.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from typing import Any, Iterator

__all__ = ["Watch", "watching"]

AT_ONCE_S = 3.0  # after a second signal: how long the ranks get to say what is lost before SIGKILL


@dataclasses.dataclass
class Watch:
    """What the agent saw of the ranks on this node.

    ``finished``: global rank -> ``(local rank, pid, time.time())`` of each rank seen
    ending with status 0 while the job ran. ``after_stop``: global rank -> exit status
    (``Popen.returncode``: negative for a signal) of every rank once the agent stopped
    them (empty until then). ``term_timeout``: the grace period used. ``second``: the
    signal that came while the ranks had their grace period (a second Ctrl-C), which
    cut it short: it was forwarded, and the ranks SIGKILLed ``AT_ONCE_S`` seconds later.

    Example::

        >>> w = Watch(term_timeout=5)
        >>> w.ended_by_themselves(signal.SIGTERM)   # nobody stopped yet
        False
    """

    term_timeout: int = 30
    finished: dict = dataclasses.field(default_factory=dict)
    after_stop: dict = dataclasses.field(default_factory=dict)
    second: int | None = None

    def ended_by_themselves(self, sig: int) -> bool:
        """Whether every rank ended on its own after the launcher forwarded ``sig``: status 0, or
        ``128 + sig`` of its own (``sys.exit(143)``), rather than killed (by ``sig``'s default action, or
        SIGKILL after the grace period) or failed."""
        return bool(self.after_stop) and all(code in (0, 128 + int(sig)) for code in self.after_stop.values())

    def killed(self) -> list[int]:
        """The ranks SIGKILLed by the agent's shutdown (they did not end within the grace period)."""
        return sorted(r for r, code in self.after_stop.items() if code == -signal.SIGKILL)


def _at_once(context: Any, sig: int) -> None:
    """A second signal during the grace period: forward it (an ``ft.Trainer`` then says what is lost and ends),
    give the ranks ``AT_ONCE_S`` seconds, SIGKILL the rest; a third signal SIGKILLs them at once."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    procs = [h.proc for h in getattr(context, "subprocess_handlers", {}).values()]

    def send(proc: Any, s: int) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, s)  # each rank leads its own process group (torchrun starts it so)
            except (ProcessLookupError, PermissionError):
                pass

    for proc in procs:
        send(proc, sig)
    end = time.monotonic() + AT_ONCE_S
    try:
        for proc in procs:
            try:
                proc.wait(max(end - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
    except SignalException:  # a third signal: no more waiting
        pass
    for proc in procs:
        send(proc, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(10.0)
        except subprocess.TimeoutExpired:  # (a process in uninterruptible sleep: nothing more to do)
            pass


def _agent_class(watch: Watch) -> type:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    class Agent(LocalElasticAgent):
        """``LocalElasticAgent`` whose every stop honours the shutdown timeout, noting how ranks ended."""

        def _start_workers(self, worker_group: Any) -> dict:
            ids = super()._start_workers(worker_group)
            context = self._pcontext
            ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
            close = context.close
            timeout = self._shutdown_timeout

            def close_in_time(death_sig: Any = None, timeout_: Any = None) -> None:
                # torchrun calls close() with its 30 s default on a rank's failure: use ours, always
                try:
                    close(death_sig, timeout)
                except SignalException as e:  # another signal while the ranks had their grace: stop at once
                    watch.second = int(e.sigval)
                    _at_once(context, e.sigval)
                    close(signal.SIGKILL, 0)  # the rest of close() (its output tails); every rank has ended
                for local, handler in getattr(context, "subprocess_handlers", {}).items():
                    code = handler.proc.poll()
                    if code is not None and local in ranks:
                        watch.after_stop[ranks[local]] = code

            context.close = close_in_time  # an instance attribute: PContext._poll's self.close() finds it
            self._functrain_ranks = ranks
            return ids

        def _monitor_workers(self, worker_group: Any) -> Any:
            ranks = getattr(self, "_functrain_ranks", {})
            now = time.time()
            for local, handler in getattr(self._pcontext, "subprocess_handlers", {}).items():
                rank = ranks.get(local)
                if rank is not None and rank not in watch.finished and handler.proc.poll() == 0:
                    watch.finished[rank] = (local, handler.proc.pid, now)
            return super()._monitor_workers(worker_group)

    return Agent


@contextlib.contextmanager
def watching(term_timeout: int) -> Iterator[Watch]:
    """While the block runs torchrun, its agent is :class:`Agent`; yields the :class:`Watch` it fills.

    Example::

        with watching(term_timeout=5) as watch:
            torch.distributed.run.run(args)   # a failed rank's peers get SIGKILL 5 s after SIGTERM
    """
    from torch.distributed.launcher import api

    watch = Watch(term_timeout=term_timeout)
    original = api.LocalElasticAgent
    api.LocalElasticAgent = _agent_class(watch)
    try:
        yield watch
    finally:
        api.LocalElasticAgent = original
