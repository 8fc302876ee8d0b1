"""``python -m functrain.launch``: run a script on N processes, torchrun underneath, with bounded failure.

Usage::

    python -m functrain.launch --nproc 2 train.py --lr 1e-3          # one machine, 2 processes
    python -m functrain.launch --nproc 4 -m mypkg.train               # a module, like python -m

    # two machines (run on each; node 0's address and a free port on it)
    python -m functrain.launch --nnodes 2 --node-rank 0 --nproc 8 --master-addr 10.0.0.1 --master-port 29500 train.py
    python -m functrain.launch --nnodes 2 --node-rank 1 --nproc 8 --master-addr 10.0.0.1 --master-port 29500 train.py

The script calls ``ft.distributed.init()`` (torchrun's variables are set) and
wraps its step in ``ft.data_parallel()``. What this adds to plain torchrun:

* **Bounded failure.** ``FUNCTRAIN_DIST_TIMEOUT`` (how long a collective waits
  for a peer; read by ``ft.distributed.init``) is set to ``--dist-timeout``
  (default 120 s) unless the environment already sets it; the rendezvous gives up
  after ``--join-timeout`` (default 300 s) if not all nodes arrive; with
  ``--max-restarts 0`` (the default) the first rank that fails stops the others on
  its node, and ranks on other nodes fail on their next collective (at once if the
  peer's connection closed, else after the collective timeout).
* **A hung rank is named.** A rank that never reaches a collective (a deadlock, an
  endless loop, a stuck read) is found when a peer's collective times out:
  ``--dist-timeout`` seconds after that peer entered it. The launcher then stops
  the others (SIGTERM, SIGKILL after ``--term-timeout``) and names the rank that
  did not arrive, not the one that timed out waiting for it. A job with a hung
  rank therefore ends at most ``--dist-timeout`` + ``--term-timeout`` seconds
  (+ about a second) after the hang began (with the defaults 120 + 30 s).
* **A bounded grace period.** Whenever the launcher stops the ranks (one failed,
  or the launcher got SIGTERM/SIGINT, which it forwards), each rank gets the signal
  (SIGTERM when a rank failed) and ``--term-timeout`` seconds (default 30, torchrun's
  ``--shutdown-timeout``) to finish (e.g. save a checkpoint) before SIGKILL: exactly
  that long, also when a rank failed (torchrun itself then waits its own 30 s;
  :mod:`.agent` fixes it). A second signal during the grace (a second Ctrl-C) is
  forwarded at once and the ranks still running 3 s later are SIGKILLed.
* **Whether the checkpoint is written.** Each rank tells the launcher how it
  stopped (:func:`.faults.report_stop`: an ``ft.Trainer`` after its save, or when a
  second Ctrl-C stopped it; the runner when a ``KeyboardInterrupt`` ended the
  script); the launcher's exit status and last line say whether the checkpoint is
  written, and if not which steps are lost (below).
* **Nothing from the current folder.** Each worker runs ``python -u -c`` code that
  drops the current folder from ``sys.path`` before any import and loads functrain
  from the folder the launcher has it from (:func:`_boot_code`): a package another
  user planted in a folder they can write never runs in a rank.
* **Nothing left behind.** Each rank dies with the launcher, even when the
  launcher is SIGKILLed (the Linux parent-death signal, set first thing in each
  worker; a polling thread elsewhere): no orphan rank goes on writing
  checkpoints. The agent runs inside the launcher process, so it dies with it.
* **One traceback.** Each worker runs the script through a small runner that
  prints a failing rank's traceback once (lines prefixed ``[rankN]:``) and
  records it in torchrun's error file; a rank that failed only because a peer
  died first ("Connection closed by peer") waits a few seconds for the launcher
  to stop it before it says anything, so its secondary traceback normally never
  appears. The launcher then prints a short summary naming the rank that failed
  first and its error (not the traceback again) and exits with its exit code.
  Plain torchrun prints the traceback up to three times (the worker, the
  ``ChildFailedError`` report, and the launcher's own traceback).
* **A clean exit.** A worker whose script finished ends with ``os._exit`` after
  joining the script's threads and running its ``atexit`` handlers: gloo's C++
  teardown at interpreter exit aborts (SIGABRT) in about one exit in ten on
  torch 2.13, which plain torchrun reports as a failed job (and, on another node,
  makes the launcher wait out torchelastic's 300 s exit barrier).
  ``FUNCTRAIN_LAUNCH_HARD_EXIT=0`` turns this off. The process group the script
  left is destroyed first (after a success only).
* ``OMP_NUM_THREADS=1`` unless set (torchrun's default too, without its banner);
  torchrun's per-run log folder (error files) is a temporary folder removed at the
  end, unless ``--log-dir`` is given or ``--redirects``/``--tee`` put output there.

Rendezvous: the default backend is ``static``, as in torchrun: node ``--node-rank``
0 hosts the store on ``--master-addr:--master-port`` (or ``--rdzv-endpoint``) and
the node ranks are the ones given. On one node without a port, torchrun's
"standalone" mode is used (a c10d store on a free port). Pass ``--rdzv-backend
c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB`` for elastic jobs (node ranks are
assigned on arrival, ``--nnodes MIN:MAX``, restarts across nodes).

* **The right rank blamed.** A rank that finishes (status 0) while the others
  still run is named as the cause when they then fail in a collective without it
  (torchrun's own failure list leaves it out).

Exit status: 0 when every rank succeeded; else the first failed rank's exit code
(128 + the signal number for a rank killed by a signal), 1 if the rendezvous
failed. When the launcher itself is stopped (SIGTERM, Ctrl-C) and forwards the
signal: 128 + the signal number (143 for SIGTERM, 130 for Ctrl-C) if the
checkpoint is written: every rank reported it saved (``ft.Trainer``), or, for a
script that reports nothing, every rank ended by itself within ``--term-timeout``
(status 0, or 128 + that signal of its own) and no second signal came; else 137
(128 + SIGKILL): some rank was SIGKILLed after the grace period, stopped at once
by a second signal, ended with a ``KeyboardInterrupt`` or otherwise, and the
checkpoint may be missing; the last line names those ranks, the last checkpoint
and the steps lost (the rules: :func:`.faults.stop_outcome`).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

from ..core.validate import BadValue, check_int, check_real
from .agent import Watch, watching
from .prewarm import ENV as PREWARM_ENV, Prewarmed, handing_over
from .faults import (LOST, OWN, STOP_REPORT, TIMEOUT, RankEnd, cause_of, describe_end, die_with_parent, left_early,
                     read_stop_reports, report_stop, root_cause, stop_outcome)

__all__ = ["main"]

_WORKER = "__functrain_worker__"  # first argument of the worker runner: python -u -c BOOT __functrain_worker__
_SECONDARY_GRACE_S = 3.0  # how long a rank failing only because a peer died waits to be stopped before it reports

DEFAULT_DIST_TIMEOUT_S = 120
DEFAULT_JOIN_TIMEOUT_S = 300
DEFAULT_TERM_TIMEOUT_S = 30  # torchrun's own default, now stated
_LAUNCHER_PID = "FUNCTRAIN_LAUNCHER_PID"  # set for the workers: the parent whose death ends them


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Run a training script on N processes (torchrun underneath) with bounded failure.",
        epilog="Everything after the script is passed to it. See functrain/distributed/cli.py for the failure model.")
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", default="1",
                   help="processes on this node (an int, or torchrun's auto/cpu/gpu); default 1")
    p.add_argument("--nnodes", default="1", help="number of nodes, or MIN:MAX with --rdzv-backend c10d; default 1")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   help="this node's rank (static rendezvous); default 0")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   help="address of node 0 (static rendezvous); default 127.0.0.1")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=None,
                   help="port on node 0 (static rendezvous); default: a free port on one node, else 29500")
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="static",
                   choices=["static", "c10d", "etcd", "etcd-v2"], help="rendezvous backend; default static")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="",
                   help="HOST:PORT of the rendezvous (for static: same as --master-addr/--master-port)")
    p.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default="none",
                   help="job id, the same on every node (c10d rendezvous)")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                   help="restart the worker group this many times after a failure; default 0")
    p.add_argument("--join-timeout", dest="join_timeout", type=int, default=DEFAULT_JOIN_TIMEOUT_S,
                   help=f"seconds to wait for all nodes to join; default {DEFAULT_JOIN_TIMEOUT_S}")
    p.add_argument("--dist-timeout", dest="dist_timeout", type=float, default=None,
                   help="seconds a collective waits for a peer (sets FUNCTRAIN_DIST_TIMEOUT); also the time "
                        "to detect a hung rank, which is then named; default "
                        f"$FUNCTRAIN_DIST_TIMEOUT, else {DEFAULT_DIST_TIMEOUT_S}")
    p.add_argument("--term-timeout", dest="term_timeout", type=int, default=DEFAULT_TERM_TIMEOUT_S,
                   help="seconds a rank has between SIGTERM and SIGKILL when the launcher stops the job (a rank "
                        "failed, or the launcher got SIGTERM/SIGINT): time to save a checkpoint; "
                        f"default {DEFAULT_TERM_TIMEOUT_S}")
    p.add_argument("--log-dir", "--log_dir", dest="log_dir", default=None,
                   help="keep torchrun's per-rank logs and error files here (default: a temporary folder, removed)")
    p.add_argument("--redirects", "-r", default="0",
                   help="torchrun's --redirects: rank output into files under --log-dir (if none, a temporary "
                        "folder that is kept and named at the end)")
    p.add_argument("--tee", "-t", default="0", help="torchrun's --tee: to the console and into those files")
    p.add_argument("--local-addr", "--local_addr", dest="local_addr", default=None, help="torchrun's --local-addr")
    p.add_argument("-m", "--module", action="store_true", help="the script is a module name, run as python -m")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _prog() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name and not name.endswith(".py") and name != "-c" else "python -m functrain.launch"


def _torchrun_argv(ns: argparse.Namespace, log_dir: str) -> list[str]:
    argv = ["--nnodes", ns.nnodes, "--nproc-per-node", str(ns.nproc), "--rdzv-backend", ns.rdzv_backend,
            "--rdzv-id", ns.rdzv_id, "--max-restarts", str(ns.max_restarts), "--node-rank", str(ns.node_rank),
            "--log-dir", log_dir, "--redirects", ns.redirects, "--tee", ns.tee,
            "--shutdown-timeout", str(ns.term_timeout),  # SIGTERM -> SIGKILL grace of the agent
            # join_timeout: c10d/etcd rendezvous; timeout: static (each ignores the other's key)
            "--rdzv-conf", f"join_timeout={ns.join_timeout},timeout={ns.join_timeout}"]
    if ns.rdzv_endpoint:
        argv += ["--rdzv-endpoint", ns.rdzv_endpoint]
    if ns.master_addr is not None:
        argv += ["--master-addr", ns.master_addr]
    if ns.master_port is not None:
        argv += ["--master-port", str(ns.master_port)]
    if ns.local_addr is not None:
        argv += ["--local-addr", ns.local_addr]
    # each worker: python -u -c BOOT __functrain_worker__ [-m] script args... (see _boot_code)
    argv += ["--no-python", sys.executable, "-u", "-c", _boot_code(), _WORKER]
    argv += (["-m"] if ns.module else []) + [ns.script, *ns.script_args]
    return argv


def _boot_code(*last: str) -> str:
    """What each worker runs first (``python -c``): nothing is imported from the current folder.

    ``python -m`` and ``python -c`` put the current folder first on ``sys.path``; in a folder another user can
    write (``/tmp``, a shared project folder) a planted ``functrain/`` or ``torch/`` would then run as the user.
    The code drops that entry before any import (on Python 3.10 too, where ``-P`` does not exist), loads
    functrain from the very folder the launcher imported it from, and runs the worker; the user's script gets
    its own folder (or, with ``-m``, the current folder) on the path only after that (:func:`_worker`).
    ``last``: the lines that end it (default: the worker's ``main``).
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../functrain
    init = os.path.join(package, "__init__.py")
    return "\n".join([
        "import sys",
        "if not getattr(sys.flags, 'safe_path', False):  # (-P, PYTHONSAFEPATH: nothing was put first)",
        "    del sys.path[0]  # the current folder, put first by -c",
        "import importlib.util",
        f"spec = importlib.util.spec_from_file_location('functrain', {init!r}, "
        f"submodule_search_locations=[{package!r}])",
        "module = importlib.util.module_from_spec(spec)",
        "sys.modules['functrain'] = module",
        "spec.loader.exec_module(module)",
        *(last or ("from functrain.distributed.cli import main", "sys.exit(main())")),
    ])


def _prewarm_code() -> str:
    """What a waiting process runs (``python -u -c CODE FD``): the worker's boot, then :func:`.prewarm.serve`."""
    return _boot_code("from functrain.distributed.prewarm import serve", "argv = serve(int(sys.argv[1]))",
                      "from functrain.distributed.cli import main", "sys.exit(main(argv))")


def _prewarm(ns: argparse.Namespace) -> Prewarmed | None:
    """One waiting process per local rank, importing torch while the launcher does (:mod:`.prewarm`); ``None``
    when ``FUNCTRAIN_LAUNCH_PREWARM=0`` or the process count is not a number (torchrun's ``auto``, ``gpu``)."""
    if os.environ.get(PREWARM_ENV, "1") == "0" or not str(ns.nproc).isdigit():
        return None
    return Prewarmed(int(ns.nproc), [sys.executable, "-u", "-c", _boot_code(), _WORKER], _prewarm_code())


def main(argv: list[str] | None = None) -> int:
    """Launch ``script`` on ``--nproc`` processes per node; return the job's exit status (see the module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_WORKER]:
        return _worker(argv[1:])
    ns = _parser(_prog()).parse_args(argv)
    try:
        check_int("--max-restarts", ns.max_restarts, minimum=0)
        check_int("--join-timeout", ns.join_timeout, minimum=1)
        check_int("--term-timeout", ns.term_timeout, minimum=0)
        if ns.dist_timeout is not None:
            check_real("--dist-timeout", ns.dist_timeout, lo=0, lo_open=True)
    except BadValue as e:
        print(f"{_prog()}: {e}", file=sys.stderr)
        return 2
    if not ns.module and not os.path.isfile(ns.script):
        print(f"{_prog()}: no such script: {ns.script}", file=sys.stderr)
        return 2

    # Environment the workers inherit (the agent copies os.environ into each worker); restored at the end.
    saved = {k: os.environ.get(k) for k in ("FUNCTRAIN_DIST_TIMEOUT", "OMP_NUM_THREADS", _LAUNCHER_PID, STOP_REPORT)}
    os.environ[_LAUNCHER_PID] = str(os.getpid())
    if ns.dist_timeout is not None:
        os.environ["FUNCTRAIN_DIST_TIMEOUT"] = f"{ns.dist_timeout:g}"
    else:
        os.environ.setdefault("FUNCTRAIN_DIST_TIMEOUT", str(DEFAULT_DIST_TIMEOUT_S))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ns.effective_dist_timeout = os.environ["FUNCTRAIN_DIST_TIMEOUT"]

    prewarmed = _prewarm(ns)  # (the ranks' processes import torch now, while this one does)
    try:
        return _run(ns, prewarmed)
    finally:
        if prewarmed is not None:
            prewarmed.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(ns: argparse.Namespace, prewarmed: Prewarmed | None) -> int:
    """The launch itself, torchrun's agent underneath (the rest of :func:`main`)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # redirected output is kept (in the temporary folder when no --log-dir): it is the only copy
    keep_logs = ns.log_dir is not None or ns.redirects != "0" or ns.tee != "0"
    _remove_stale_log_dirs()
    # this launch's own folder, removed at the end (a launcher killed by SIGKILL cannot: the next launch does, see
    # _remove_stale_log_dirs): torchrun's logs unless they are kept, and the ranks' stop reports
    scratch = tempfile.mkdtemp(prefix="functrain-launch-")
    with open(os.path.join(scratch, _OWNER), "w") as fp:
        fp.write(str(os.getpid()))
    log_dir = ns.log_dir or (tempfile.mkdtemp(prefix="functrain-launch-") if keep_logs else scratch)
    stops = os.path.join(scratch, "stops")  # where each rank says how it stopped (faults.report_stop)
    os.mkdir(stops, 0o700)
    os.environ[STOP_REPORT] = stops
    try:
        targs = torchrun.parse_args(_torchrun_argv(ns, log_dir))
        watch = None
        try:
            # torchrun's agent, honouring --term-timeout on every stop; its ranks in the waiting processes
            with watching(ns.term_timeout) as watch, handing_over(prewarmed):
                torchrun.run(targs)  # standalone c10d on one node without a port, else as asked; raises on failure
            return 0
        except ChildFailedError as e:
            return _report(e, ns, watch)
        except SignalException as e:
            return _stopped(e.sigval, ns, watch, read_stop_reports(stops))
        except Exception as e:  # rendezvous timeout, a store that cannot be reached, a bad option
            if not _is_rendezvous_error(e):
                raise
            first = (str(e).strip().splitlines() or [""])[0]
            if type(e).__name__ in ("RendezvousTimeoutError", "DistStoreError") or "timed out" in first.lower():
                first += (f" (not all {ns.nnodes} node(s) joined within --join-timeout {ns.join_timeout} s; "
                          f"is node 0 up at the address and port given?)")
            print(f"{_prog()}: the job could not start: {type(e).__name__}: {first}", file=sys.stderr)
            return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if keep_logs and ns.log_dir is None:
            print(f"{_prog()}: per-rank logs in {log_dir}", file=sys.stderr)


_OWNER = ".functrain-launcher-pid"  # in a temporary log folder meant to be removed: the launcher that owns it


def _remove_stale_log_dirs() -> None:
    """Remove temporary log folders whose launcher died without removing them (it was SIGKILLed)."""
    import glob

    for folder in glob.glob(os.path.join(tempfile.gettempdir(), "functrain-launch-*")):
        try:
            with open(os.path.join(folder, _OWNER)) as fp:
                pid = int(fp.read().strip())
        except (OSError, ValueError):
            continue  # kept logs, or not ours
        if pid == os.getpid() or _pid_alive(pid):
            continue
        shutil.rmtree(folder, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _is_rendezvous_error(e: BaseException) -> bool:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousError

    return isinstance(e, (RendezvousError, TimeoutError, ConnectionError, ValueError, dist.DistError))


# --------------------------------------------------------------------------- failure report (launcher side)

def _failure_info(failure) -> dict:
    """rank's error from its error file: message, cause, time (float), or what the exit code says."""
    data = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    if isinstance(data, dict):
        extra = data.get("extraInfo", {})
        try:
            t = float(extra.get("functrain_time", extra.get("timestamp", failure.timestamp)))
        except (TypeError, ValueError):
            t = float(failure.timestamp)
        message = str(data.get("message", ""))
        cause = extra.get("functrain_cause")
        if cause not in (OWN, LOST, TIMEOUT):  # an error file from elsewhere (or an older runner)
            cause = LOST if extra.get("secondary") else cause_of(message)
        return {"message": message, "cause": cause, "secondary": cause != OWN, "time": t, "recorded": True}
    if failure.exitcode < 0:
        msg = f"killed by signal {-failure.exitcode} ({failure.signal_name()})"
    else:
        msg = f"exited with code {failure.exitcode} without a Python traceback"
    # SIGTERM is how the launcher stops the other ranks once one failed
    return {"message": msg, "cause": OWN, "secondary": failure.exitcode == -signal.SIGTERM,
            "time": float(failure.timestamp), "recorded": False}


def _end(rank: int, failure) -> RankEnd:
    i = _failure_info(failure)
    if i["recorded"]:
        return RankEnd(rank, "error", cause=i["cause"], time=i["time"], message=i["message"])
    if failure.exitcode < 0:
        return RankEnd(rank, "signal", code=-failure.exitcode, time=i["time"])
    return RankEnd(rank, "exit", code=failure.exitcode, time=i["time"])


def _root(failures: dict) -> int:
    """The rank that failed first for a reason of its own (the rules: :func:`.faults.root_cause`)."""
    return root_cause(_end(r, f) for r, f in failures.items()).rank


def _stopped(sig: signal.Signals, ns: argparse.Namespace, watch: Watch | None, reports: dict | None = None) -> int:
    """The launcher was signalled and stopped the ranks: print one line saying whether their checkpoint is written
    and return the exit status (the rules: :func:`.faults.stop_outcome`)."""
    code, text = stop_outcome(
        int(sig), term_timeout=ns.term_timeout, after=watch.after_stop if watch is not None else {},
        killed=watch.killed() if watch is not None else [], ended=watch is not None and watch.ended_by_themselves(sig),
        second=watch.second if watch is not None else None, reports=reports or {})
    print(f"{_prog()}: {text}", file=sys.stderr)
    return code


def _one_node(ns: argparse.Namespace) -> bool:
    return str(ns.nnodes).strip() in ("1", "1:1")


def _report(error, ns: argparse.Namespace, watch: Watch | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import Std, to_map

    failures = error.failures
    ends = [_end(r, f) for r, f in failures.items()]
    finished = {r: v for r, v in (watch.finished if watch is not None else {}).items() if r not in failures}
    ends += [RankEnd(r, "done", time=t) for r, (_, _, t) in finished.items()]
    root = root_cause(ends).rank
    prog = _prog()
    try:
        dist_timeout = float(getattr(ns, "effective_dist_timeout", ""))
    except ValueError:
        dist_timeout = None
    end = next(e for e in ends if e.rank == root)
    if left_early(end, ends):  # torchrun does not list it: a rank that finished while its peers still ran
        local, pid, _ = finished[root]
        lines = [f"{prog}: rank {root} (local rank {local}, pid {pid}) is the cause: it {describe_end(end, ends)}"]
        lines.append("  the ranks that then failed: " + ", ".join(f"{r} ({_failure_info(failures[r])['message']})"
                                                                for r in sorted(failures)))
        if ns.log_dir:
            lines.append(f"  logs and error files: {ns.log_dir}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        first = min(failures.values(), key=lambda f: f.timestamp)
        return first.exitcode if first.exitcode > 0 else (128 - first.exitcode if first.exitcode < 0 else 1)
    f = failures[root]
    info = _failure_info(f)
    if end.how == "signal" and any(e.how == "error" and e.cause == TIMEOUT for e in ends):
        head = f"failed first: it {describe_end(end, ends, dist_timeout)}"  # hung, then stopped by the launcher
    else:
        head = f"failed first: {info['message']}"
    lines = [f"{prog}: rank {root} (local rank {f.local_rank}, pid {f.pid}) {head}"]
    if info["recorded"]:
        redirected = to_map(Std.from_str(ns.redirects), f.local_rank + 1).get(f.local_rank, Std.NONE)
        teed = to_map(Std.from_str(ns.tee), f.local_rank + 1).get(f.local_rank, Std.NONE)
        if (redirected & Std.ERR) == Std.ERR and (teed & Std.ERR) != Std.ERR:
            callstack = f.error_file_data["message"].get("extraInfo", {}).get("py_callstack", "")
            where = os.path.join(os.path.dirname(f.error_file), "stderr.log")
            lines.append(f"  its stderr went to {where}; its traceback:\n{callstack.rstrip()}")
        else:
            lines.append(f"  (its traceback is above, lines prefixed [rank{root}])")
        if info["cause"] in (LOST, TIMEOUT) and _one_node(ns):  # every rank is on this node: none said why
            lines.append("  (it failed because of a peer, but no other rank of this one-node job reported a "
                         "failure)")
        elif info["cause"] == LOST:
            lines.append("  (it lost its connection to a peer: the rank that failed first is on another node; "
                         "see that node's output)")
        elif info["cause"] == TIMEOUT:
            lines.append("  (a collective timed out waiting for a peer that did not arrive: the hung rank is on "
                         "another node; see that node's output)")
    others = sorted(r for r in failures if r != root)
    if others:
        lines.append("  other ranks stopped: " + ", ".join(f"{r} ({_failure_info(failures[r])['message']})"
                                                         for r in others))
    if ns.log_dir:
        lines.append(f"  logs and error files: {ns.log_dir}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    code = f.exitcode
    return code if code > 0 else (128 - code if code < 0 else 1)


# --------------------------------------------------------------------------- worker runner (one per rank)

def _user_traceback(e: BaseException) -> str:
    """The traceback without the runner's own frames (this file and runpy) on top."""
    tb = e.__traceback__
    own = {os.path.abspath(__file__)}
    while tb is not None:
        fname = tb.tb_frame.f_code.co_filename
        if os.path.abspath(fname) in own or "runpy" in fname:
            tb = tb.tb_next
        else:
            break
    return "".join(traceback.format_exception(type(e), e, tb))  # a SyntaxError in the script: no frames left


def _record(e: BaseException, text: str, cause: str) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": f"{type(e).__name__}: {e}",
                        "extraInfo": {"py_callstack": text, "timestamp": str(int(now)),
                                      "functrain_time": repr(now), "secondary": cause != OWN,
                                      "functrain_cause": cause}}}
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError:
        pass


def _worker(argv: list[str]) -> int:
    """Run the user's script as __main__; on an exception print its traceback once, record it, exit 1.

    The process then ends with ``os._exit`` (after joining the script's non-daemon threads and running its
    ``atexit`` handlers on a normal exit): a gloo process group's C++ teardown at interpreter exit aborts
    ("terminate called without an active exception", SIGABRT) in about one exit in ten on torch 2.13,
    with or without ``destroy_process_group()``, which would turn a finished job into a failed one.
    ``FUNCTRAIN_LAUNCH_HARD_EXIT=0`` restores the ordinary interpreter exit.
    """
    launcher = os.environ.get(_LAUNCHER_PID, "")
    die_with_parent(int(launcher) if launcher.isdigit() else None)  # no orphan rank if the launcher is killed
    import runpy

    if not argv:
        print("functrain worker: no script", file=sys.stderr)
        return 2
    module = argv[0] == "-m"
    if module:
        argv = argv[1:]
    target, args = argv[0], argv[1:]
    try:
        faulthandler.enable(all_threads=True)  # a segfault still prints where it happened
    except Exception:  # noqa: BLE001 - stderr without a fileno
        pass
    code = 0
    try:
        sys.argv = [target, *args]
        # as python does for the script (functrain and torch are imported already, from the launcher's folders)
        if module:
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): printed, status 1, as the interpreter does
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # the launcher forwarded a Ctrl-C the script does not handle: no traceback from each
        report_stop(False, how="KeyboardInterrupt", replace=False)  # (a Trainer that saved already said so)
        _flush()
        os._exit(130)
    except BaseException as e:  # noqa: BLE001 - every failure is reported once
        text = _user_traceback(e)
        cause = cause_of(e)
        if cause == LOST:  # a peer died first: the launcher normally stops this process within this grace time
            time.sleep(_SECONDARY_GRACE_S)
        # (a timeout is reported at once: the peer it waited for is alive, hung, and will not fail by itself)
        _record(e, text, cause)
        prefix = f"[rank{os.environ.get('RANK', '?')}]: "
        sys.stderr.write("".join(prefix + ln + "\n" for ln in text.rstrip("\n").split("\n")))
        _flush()
        # no atexit handlers, no teardown: either can wait forever on a peer that is gone
        os._exit(1)
    if code == 0:
        _shutdown_group()  # not after a failure: destroying a group while peers are in a collective can hang
    if os.environ.get("FUNCTRAIN_LAUNCH_HARD_EXIT", "1") == "0":
        return code
    import atexit
    import threading

    # what interpreter shutdown does first: threading's own exit hooks (which stop executor and compile-pool
    # threads), then join the non-daemon threads; then the atexit handlers
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:  # pragma: no cover - not CPython
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join(timeout=60.0)
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream
            pass


def _shutdown_group() -> None:
    """Destroy a process group the script left behind (NCCL warns, and teardown order is then defined)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the job already succeeded
        pass


if __name__ == "__main__":
    raise SystemExit(main())
