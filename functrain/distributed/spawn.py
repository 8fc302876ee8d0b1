"""``ft.launch``: run a function on N local processes that form one process group (notebooks, tests).

For scripts and clusters use ``python -m functrain.launch`` (torchrun underneath, :mod:`functrain.distributed.cli`).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

__all__ = ["launch", "free_port", "LaunchError", "SECONDARY_ERRORS"]


class LaunchError(RuntimeError):
    """A launched rank failed, or the job did not finish in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, args: tuple, rank: int, nprocs: int, port: int, backend: str | None,
            results: Any, env: dict) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        import torch.distributed as dist

        from . import group as distributed

        distributed.init(backend)
        try:
            value = fn(*args)
        except BaseException as e:  # report before the group goes down, so this rank's error arrives first
            _report_failure(results, rank, e)
            raise SystemExit(1) from None
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        results.put((rank, True, value, None))
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
        _report_failure(results, rank, e)


def _report_failure(results: Any, rank: int, error: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        results.put((rank, False, error, tb))
    except Exception:  # the exception itself does not pickle: send its text
        results.put((rank, False, None, tb))


# What a rank raises when it failed only because another rank died first.
SECONDARY_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                    "NCCL communicator was aborted")


def _secondary(failure: tuple) -> bool:
    """A rank that failed only because another rank died first."""
    return any(marker in (failure[2] or "") for marker in SECONDARY_ERRORS)


def launch(fn: Callable, nprocs: int = 2, args: tuple = (), *, backend: str | None = None,
           timeout: float = 300.0, env: dict | None = None) -> list:
    """Run ``fn(*args)`` on ``nprocs`` new processes forming one process group; return their results by rank.

    Each process gets torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT`` on a free port), ``OMP_NUM_THREADS=1`` unless set,
    and joins the group (gloo on CPU, NCCL on CUDA) before ``fn`` runs. ``fn`` and
    ``args`` must be picklable (a module-level function). If a rank raises, the
    others are stopped and its exception is raised here with the rank's traceback
    attached; a job that runs longer than ``timeout`` seconds is killed and raises
    :class:`LaunchError`. Nothing waits forever.

    Example::

        def work(x):
            import torch, torch.distributed as dist
            t = torch.tensor([x + dist.get_rank()])
            dist.all_reduce(t)
            return int(t)

        ft.launch(work, nprocs=2, args=(10,))   # [21, 21]
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch: nprocs must be an int >= 1; got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable; got {type(fn).__name__}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, args, r, nprocs, port, backend, results, child_env), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    failure: tuple | None = None
    try:
        while len(values) < nprocs and failure is None:
            try:
                rank, ok, value, tb = results.get(timeout=0.2)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in values]
                if dead:
                    time.sleep(0.5)  # its report may still be in the pipe
                    try:
                        rank, ok, value, tb = results.get(timeout=1.0)
                    except queue.Empty:
                        r, code = dead[0]
                        failure = (r, None, f"rank {r} exited with code {code} without reporting")
                        break
                elif time.monotonic() > deadline:
                    raise LaunchError(f"launch: the job did not finish within {timeout:g} s "
                                      f"(ranks done: {sorted(values)}); all ranks were killed")
                else:
                    continue
            if ok:
                values[rank] = value
            else:
                failure = (rank, value, tb)
                if _secondary(failure):  # wait briefly for the rank that failed first
                    try:
                        other = results.get(timeout=2.0)
                        if not other[1] and not _secondary(other):
                            failure = (other[0], other[2], other[3])
                    except queue.Empty:
                        pass
    finally:
        for p in procs:
            p.join(timeout=0.0 if failure or len(values) < nprocs else 5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5.0)
        results.close()
    if failure is not None:
        rank, exc, tb = failure
        message = f"rank {rank} of {nprocs} failed:\n{tb}"
        if isinstance(exc, BaseException):
            exc.add_note(message)
            raise exc
        raise LaunchError(message)
    return [values[r] for r in range(nprocs)]

