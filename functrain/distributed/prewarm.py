"""Ranks that import torch while the launcher does (``python -m functrain.launch``).

The launcher is torchrun's agent, which needs torch: before it starts any rank, the launcher imports torch
(~1.4 s on this project's 2-core machine), and each rank then imports it again (~1 s). So before its own import the
launcher starts one waiting process per local rank (:class:`Prewarmed`): each imports torch and
``torch.distributed``, then waits on a private socket. When the agent starts a rank, the command it would run (the
launcher's worker command, :func:`functrain.distributed.cli._boot_code`), its environment and its output files are
handed to a waiting process instead of a new one (:func:`handing_over`, around the agent's
``SubprocessHandler._popen``): that process takes the rank's environment and output (:func:`serve`), and runs the
worker as the new one would have. The agent gets the waiting process's own ``Popen``: it polls, signals
(``killpg``: started in a session of its own, as torchrun starts ranks) and reaps it exactly as a process it
started itself.

What differs from a rank started afresh: the process was made before the agent's variables existed (``RANK``,
``MASTER_PORT``, ...: taken at the hand-over, read by torch only when the process group is made) and imported
torch with the launcher's environment (``OMP_NUM_THREADS`` and the launcher's own settings are set before the
waiting processes start). A command other than the worker command (another torch's wrapping), a waiting process
that died, or a failed hand-over gets a new process, as before; so does every rank of a restart (each waiting
process serves once). ``FUNCTRAIN_LAUNCH_PREWARM=0`` turns this off. Waiting processes never used are told to exit
when the launcher returns (their socket closes) and die with it if it is killed (the parent-death signal).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any, Iterator

__all__ = ["Prewarmed", "handing_over", "serve", "ENV"]

ENV = "FUNCTRAIN_LAUNCH_PREWARM"  # "0": every rank is a new process started by the agent
served = False  # in a rank: whether it runs in a waiting process (set by serve at the hand-over)
_MESSAGE = 1 << 22  # the largest hand-over message (the command and the environment, JSON)


class Prewarmed:
    """``n`` waiting processes for the worker command ``command`` (the prefix every rank's command starts with),
    started now with this process's environment; ``boot``: the code each runs first (``python -u -c boot``), which
    must end by calling :func:`serve` with the socket's file descriptor, its last argument."""

    def __init__(self, n: int, command: list[str], boot: str):
        self.command = list(command)
        self.waiting: list[tuple[subprocess.Popen, socket.socket]] = []
        for _ in range(n):
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                proc = subprocess.Popen([sys.executable, "-u", "-c", boot, str(theirs.fileno())],
                                        pass_fds=(theirs.fileno(),), start_new_session=True)
            except OSError:
                mine.close()
                continue
            finally:
                theirs.close()
            self.waiting.append((proc, mine))

    def take(self, args: tuple, env: dict, stdout: Any, stderr: Any) -> subprocess.Popen | None:
        """A waiting process now running ``args`` with ``env``, its output to the files ``stdout`` and ``stderr``
        (``None``: this process's, as a new process would inherit), or ``None``: ``args`` is not the worker
        command, or no waiting process took it (start a new one)."""
        if list(args[:len(self.command)]) != self.command:
            return None
        while self.waiting:
            proc, sock = self.waiting.pop(0)
            if proc.poll() is not None:
                sock.close()
                continue
            files = [f.fileno() for f in (stdout, stderr) if f is not None]
            message = json.dumps({"args": list(args), "env": dict(env), "stdout": stdout is not None,
                                  "stderr": stderr is not None}).encode()
            try:
                socket.send_fds(sock, [message], files)
            except OSError:  # (it died meanwhile, or the message is too large: a new process instead)
                sock.close()  # (first: the waiting process then reads the end and exits by itself)
                _end(proc)
                continue
            sock.close()
            return proc
        return None

    def close(self) -> None:
        """The waiting processes never used exit (their socket closes; SIGKILL after 5 s)."""
        while self.waiting:
            proc, sock = self.waiting.pop()
            sock.close()
            _end(proc)


def _end(proc: subprocess.Popen) -> None:
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def handing_over(prewarmed: Prewarmed | None) -> Iterator[None]:
    """While the block runs torchrun's agent: each rank it starts goes to a waiting process when one takes it."""
    if prewarmed is None:
        yield
        return
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    original = handler.__dict__.get("_popen")
    if original is None:  # (a torch whose handler starts ranks otherwise: every rank a new process)
        yield
        return

    def _popen(self: Any, args: tuple, env: dict) -> subprocess.Popen:
        proc = prewarmed.take(args, env, getattr(self, "_stdout", None), getattr(self, "_stderr", None))
        return proc if proc is not None else original(self, args, env)

    handler._popen = _popen
    try:
        yield
    finally:
        handler._popen = original


def serve(fd: int) -> list[str]:
    """A waiting process: import torch, wait for a rank's command on socket ``fd`` (the launcher's end closed:
    exit), then become that rank (its environment, its output files); returns the worker's arguments (what the
    launcher's boot code then runs: ``functrain.distributed.cli.main(argv)``)."""
    from .faults import die_with_parent

    launcher = os.environ.get("FUNCTRAIN_LAUNCHER_PID", "")
    die_with_parent(int(launcher) if launcher.isdigit() else None)
    sock = socket.socket(fileno=fd)
    import torch  # noqa: F401 - what this process is for
    import torch.distributed  # noqa: F401

    try:
        message, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 2)
    except OSError:
        message, fds = b"", []
    sock.close()
    if not message:
        os._exit(0)  # never used
    order = json.loads(message)
    targets = [n for n, used in ((1, order["stdout"]), (2, order["stderr"])) if used]
    for target, f in zip(targets, fds):
        os.dup2(f, target)
        os.close(f)
    os.environ.clear()
    os.environ.update(order["env"])
    global served
    served = True
    return order["args"][4:]  # (args: python -u -c BOOT __functrain_worker__ ...)
