"""The compile worker: a child process that compiles one traced graph into the shared caches.

    main([PARENT_PID, TIMEOUT_S, NICE]) < job    (started by functrain.compiler.jobs.worker_command)

:mod:`functrain.compiler.background` starts it for each graph it compiles in the background,
before tracing the graph (the worker imports torch and inductor meanwhile), and then writes
the job to its stdin: a pickle made by :func:`job_payload` (the worker trusts only
its parent, through a pipe; no file is read). The job holds the traced graph (``torch.fx``'s
``GraphPickler``: nodes, names and metadata as they are, so the graph's cache key is the one
the parent computes), the ``(shape, stride, dtype, device)`` of its inputs, the inductor
arguments (``mode``, ``options``) and the settings that enter the generated code or the cache
keys (:func:`settings`: the intra-op thread count, matmul precision, deterministic algorithms,
the TF32 / reduced-precision flags, and inductor's, AOTAutograd's and Dynamo's configs). The
worker compiles the graph exactly as the training process would (the same counting backend:
the per-graph machine-wide lock, the probe memo, a tracing context with a shape environment),
so its entries land in AOTAutograd's and inductor's on-disk caches under the keys the parent
then loads (:meth:`~functrain.compiler.backend.CountingBackend.load`), and a later run finds.

It answers one JSON line on stdout, ``{"ok": true, "seconds": s, "cpu_s": c}`` (``c``: its CPU seconds, its
compiler subprocesses' included) or ``{"ok": false, "error":
"..."}``, and exits. It runs at a lower priority (``nice`` + ``NICE``, ``FUNCTRAIN_COMPILE_NICE`` as the
parent read it, 10 by default: its compiler subprocesses inherit it), ignores Ctrl-C (its parent decides) and dies
with its parent, its compiler children with it (``PR_SET_PDEATHSIG``: :func:`functrain.core.procs.die_with_parent`,
then SIGTERM, whose handler kills the worker's process group; a thread watching the parent backs it up), unless the
parent, ending its run normally, sends it ``SIGUSR1`` first (once it has said ``ready``: the signal
is handled from then on): then it answers ``detached`` on stdout at once, finishes its compile after
the parent has gone (so the next run loads the code from the caches;
:meth:`functrain.compiler.jobs.WorkerJob.detach`), and bounds itself by ``TIMEOUT_S``.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import sys
import time
import warnings
from typing import Any

import torch

__all__ = ["job_payload", "settings", "apply_settings", "main", "FORMAT"]

FORMAT = 1
_CONFIGS = ("torch._inductor.config", "torch._functorch.config", "torch._dynamo.config")
_FLAGS = ("cuda.matmul.allow_tf32", "cuda.matmul.allow_fp16_reduced_precision_reduction",
          "cuda.matmul.allow_bf16_reduced_precision_reduction", "cudnn.allow_tf32", "cudnn.deterministic",
          "cudnn.benchmark", "cudnn.enabled", "fp32_precision", "cuda.matmul.fp32_precision", "cudnn.fp32_precision",
          "cudnn.conv.fp32_precision", "cudnn.rnn.fp32_precision", "mkldnn.fp32_precision",
          "mkldnn.matmul.fp32_precision", "mkldnn.conv.fp32_precision", "mkldnn.rnn.fp32_precision")


def _owner(path: str) -> tuple[Any, str]:
    where, name = path.rsplit(".", 1) if "." in path else ("", path)
    obj: Any = torch.backends
    for part in filter(None, where.split(".")):
        obj = getattr(obj, part, None)
    return obj, name


def _flags() -> dict:
    out = {}
    for path in _FLAGS:
        obj, name = _owner(path)
        try:
            out[path] = getattr(obj, name)
        except (AttributeError, RuntimeError):  # not in this torch build
            pass
    return out


def settings() -> dict:
    """This process's settings that change a compiled graph or its cache key (for :func:`apply_settings`):
    the intra-op thread count, deterministic algorithms, the TF32 / fp32-precision / reduced-precision flags
    (``torch.set_float32_matmul_precision`` sets the precision flags) and the compiler's configs.

    Example::

        >>> from functrain.compiler.worker import settings
        >>> sorted(settings())
        ['configs', 'deterministic', 'flags', 'threads']
    """
    import importlib

    configs = {}
    for name in _CONFIGS:
        module = importlib.import_module(name)
        configs[name] = module.save_config_portable()
    return {"threads": torch.get_num_threads(),
            "deterministic": [torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()],
            "flags": _flags(), "configs": configs}


def apply_settings(s: dict, stack: contextlib.ExitStack) -> None:
    """Make this (worker) process's settings ``s``; config changes are entered on ``stack``. Only what differs
    is set: setting a flag to its default can itself change a cache key (a precision flag set explicitly is
    not the same as one left at its default)."""
    import importlib

    if torch.get_num_threads() != int(s["threads"]):
        torch.set_num_threads(int(s["threads"]))
    det = [torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()]
    if det != list(s["deterministic"]):
        torch.use_deterministic_algorithms(bool(s["deterministic"][0]), warn_only=bool(s["deterministic"][1]))
    mine = _flags()
    for path, value in s["flags"].items():
        if path in mine and mine[path] != value:
            obj, name = _owner(path)
            setattr(obj, name, value)
    for name, wanted in s["configs"].items():
        module = importlib.import_module(name)
        current = module.save_config_portable()
        changed = {k: v for k, v in wanted.items() if k in current and current[k] != v}
        if changed:
            stack.enter_context(module.patch(changed))


# Operator namespaces a graph may hold and a worker rebuilds by name: torch's own, registered in every process that
# imports torch. GraphPickler's default allows aten and fbgemm only, so a data-parallel step's graph (functional
# collectives: torch.ops._c10d_functional) could not travel and was compiled on the training thread, blocking that
# rank past its peers' collective timeout.
_SENDABLE_OPS = ("torch.ops.aten.", "torch.ops.fbgemm.", "torch.ops.prims.", "torch.ops._c10d_functional.",
                 "torch.ops.higher_order.")


def _sendable(name: str) -> bool:
    return name.startswith(_SENDABLE_OPS)


def job_payload(gm: torch.fx.GraphModule, metas: tuple, inductor: dict, lock: str | None = None,
                lock_timeout: float = 600.0, package: dict | None = None) -> bytes:
    """The job for a worker: ``gm`` (traced, constants lifted), its inputs' ``metas``, the inductor
    arguments (``{"mode", "options", "donate"}`` of :class:`~functrain.compiler.options.Options`).
    ``lock``: the key of the graph's machine-wide lock, which the parent holds for the worker (the worker
    compiles without taking it, and takes it over if the parent exits first); ``lock_timeout``: how long the
    worker waits for another process's compile of the graph when nobody holds the lock for it. ``package``:
    build the graph's AOTInductor package and its warm entry instead (:mod:`functrain.compiler.later`:
    ``{"folder", "prekey", "plan", "lock_timeout"}``)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    graph = GraphPickler.dumps(gm, Options(ops_filter=_sendable))
    return pickle.dumps({"format": FORMAT, "graph": graph, "metas": metas, "inductor": inductor,
                         "settings": settings(), "process_group": _process_group(gm), "lock": lock,
                         "lock_timeout": float(lock_timeout), "package": package},
                        protocol=pickle.HIGHEST_PROTOCOL)


def _process_group(gm: torch.fx.GraphModule) -> dict | None:
    """The process group the graph's functional collectives run on, as the worker stands it in: ``{"name",
    "rank", "size"}`` of the default group (inductor resolves the group while it lowers a collective; the
    generated code only names it). ``None``: no collective. A collective on another group cannot be sent
    (``ValueError``: the caller compiles the graph at the switch instead)."""
    names = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not str(node.target).startswith("_c10d_functional."):
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.name == "group_name":
                names.add(node.args[i] if i < len(node.args) else node.kwargs.get("group_name"))
    if not names:
        return None
    from torch.distributed.distributed_c10d import _get_default_group

    default = _get_default_group()
    if names != {default.group_name}:
        raise ValueError(f"the graph's collectives run on process groups {sorted(map(str, names))}; a compile "
                         f"worker stands in the default group {default.group_name!r} only")
    return {"name": default.group_name, "rank": default.rank(), "size": default.size()}


def _stand_in(group: dict) -> None:
    """A process group in this (worker) process of the parent's name, rank and size, that runs nothing
    (torch's ``fake`` backend): what inductor needs to lower the graph's collectives."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=int(group["rank"]), world_size=int(group["size"]))
    name = _get_default_group().group_name
    if name != group["name"]:
        raise RuntimeError(f"the worker's stand-in process group is named {name!r}, the graph's {group['name']!r}")


def _prepare() -> None:
    """What every compile needs, imported before the job arrives (the parent traces meanwhile)."""
    import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401 - make_fx's node hook needs it imported
    import torch._inductor.compile_fx  # noqa: F401
    from torch.fx._graph_pickler import GraphPickler  # noqa: F401

    from . import backend  # noqa: F401


def _take_over(key: str) -> None:
    """The parent holds the graph's lock while this worker compiles; a daemon thread waits for it, so that if
    the parent exits first (a run that ended, its compile left to finish) this worker holds it until it exits
    and no other process starts compiling the same graph meanwhile."""
    import threading

    from .graph_lock import GraphLock

    lock = GraphLock(key)
    if lock.usable:
        threading.Thread(target=lock.acquire, args=(True,), name="functrain-lock-take-over", daemon=True).start()


def _run(data: bytes) -> dict:
    job = pickle.loads(data)  # from the parent, through a pipe
    if not isinstance(job, dict) or job.get("format") != FORMAT:
        return {"ok": False, "error": f"not a functrain compile job of format {FORMAT}"}
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    from .backend import compile_graph, make_backend
    from .options import Options

    if job.get("process_group"):
        _stand_in(job["process_group"])
    if job.get("lock"):
        _take_over(str(job["lock"]))
    with contextlib.ExitStack() as stack:
        apply_settings(job["settings"], stack)
        gm = GraphPickler.loads(job["graph"], FakeTensorMode())
        if job.get("package"):
            return _package(gm, tuple(job["metas"]), job["package"])
        backend = make_backend(Options(**job["inductor"]), float(job.get("lock_timeout", 600.0)))
        backend.lock_held = bool(job.get("lock"))
        t0 = time.perf_counter()
        notes: list = []  # (a damaged cache file set aside and rebuilt: the parent says it)
        compile_graph(backend, gm, tuple(job["metas"]), notes)
    from .history import cpu_seconds

    # the CPU seconds this worker used, its imports and its compiler subprocesses included (what the machine paid
    # for the compile: the compile policy's history records it)
    return {"ok": True, "seconds": time.perf_counter() - t0, "cpu_s": cpu_seconds(), "notes": notes}


def _package(gm: torch.fx.GraphModule, metas: tuple, spec: dict) -> dict:
    """Build ``gm``'s package (inputs of its metadata, zeros: a package is compiled for shapes, not values) and,
    once it loads, its warm entry (:mod:`functrain.compiler.later`). A graph that cannot be packaged leaves a
    ``nopackage-<prekey>.json`` saying why, so that later runs do not try again (the pre-trace key covers
    functrain's source and the torch build: a new one tries anew)."""
    from .package import Packages
    from .warm import WarmStarts
    from .history import cpu_seconds

    t0 = time.perf_counter()
    packages = Packages(spec["folder"], float(spec.get("lock_timeout", 600.0)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            inputs = [torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
                      for shape, stride, dtype, device in metas]
            fn = packages(gm, inputs, lambda: None)
            why = None if fn is not None else \
                ("; ".join(str(w.message) for w in caught) or "the graph cannot be packaged")
        except Exception as e:  # noqa: BLE001 - said in the marker and the answer
            fn, why = None, f"{type(e).__name__}: {e}"
    warm = WarmStarts(packages, {})
    if fn is None:
        packages.write_json(warm.refusal(spec["prekey"]), {"why": why[:4000]})
        return {"ok": False, "error": why[:4000]}
    warm.write(spec["prekey"], spec["plan"], fn.key)
    return {"ok": True, "package": fn.key, "seconds": time.perf_counter() - t0, "cpu_s": cpu_seconds()}


def _group_dies_with_parent(parent: int) -> Any:
    """Make this worker's whole process group (it and its compiler children: gcc, inductor's compile pool) die
    when the parent dies, however it dies (a SIGTERM or SIGKILL skips the parent's exit handlers): the kernel's
    parent-death signal is SIGTERM, whose handler kills the group, and a daemon thread checks the parent ten times
    a second as a second line. Returns the event that :func:`main`'s detach sets to turn both off."""
    import threading

    detached = threading.Event()

    def kill_group(*_: Any) -> None:
        if not detached.is_set():
            os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, kill_group)
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # gone already (the race between start and prctl)
        kill_group()

    def watch() -> None:
        while not detached.wait(0.1):
            if os.getppid() != parent:
                kill_group()

    threading.Thread(target=watch, name="functrain-worker-orphan", daemon=True).start()
    return detached


def main(argv: list[str] | None = None) -> int:
    """The worker's entry point: read the job from stdin, compile, answer one JSON line."""
    from ..core.procs import die_with_parent

    started = time.monotonic()
    argv = sys.argv[1:] if argv is None else argv
    parent = int(argv[0]) if argv and argv[0].isdigit() else os.getppid()
    die_with_parent(parent)
    orphaned = _group_dies_with_parent(parent)
    # (the parent checked both: WorkerSettings)
    timeout = float(argv[1]) if len(argv) > 1 else 3600.0
    nice = int(argv[2]) if len(argv) > 2 else 10
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    try:
        os.nice(nice)
    except OSError:
        pass
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the compiler prints goes to the log, not into the answer

    def detach(signum: int, frame: Any) -> None:  # the parent ends its run normally: finish the compile
        from ..core.procs import outlive_parent

        # the parent no longer bounds this process: its own timer does (what is left of the parent's timeout),
        # killing it with its compiler children (its own process group)
        signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))
        signal.setitimer(signal.ITIMER_REAL, max(timeout - (time.monotonic() - started), 1.0))
        orphaned.set()  # (the group no longer dies with the parent)
        outlive_parent()
        out.write("detached\n")
        out.flush()

    signal.signal(signal.SIGUSR1, detach)
    out.write("ready\n")  # SIGUSR1 is handled from now on (until here it would kill the process)
    out.flush()
    try:
        _prepare()
        data = sys.stdin.buffer.read()
        if not data:  # the parent closed the pipe without a job: its trace failed, or it is gone
            return 0
        result = _run(data)
    except BaseException as e:  # noqa: BLE001 - every failure becomes the answer
        text = f"{type(e).__name__}: {e}".strip()
        result = {"ok": False, "error": text[:4000]}
    try:
        out.write(json.dumps(result) + "\n")
        out.flush()
    except (BrokenPipeError, OSError):  # detached: the parent is gone; the caches hold the result
        pass
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
