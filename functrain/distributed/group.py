"""The process group from the environment: torchrun, SLURM, Open MPI / PMI.

``init()`` reads who this process is from the variables its launcher set and
joins the default process group (gloo on CPU, NCCL on CUDA with the device
``cuda:local_rank``). A job launched with N processes is always one real
N-process group; a plain single process needs no group at all.

Timeouts: every collective fails after ``timeout`` (default
``FUNCTRAIN_DIST_TIMEOUT`` seconds, else 300) instead of waiting forever for a
rank that died.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.validate import check_real

__all__ = ["ProcessInfo", "process_info", "init", "is_initialized", "rank", "world_size", "default_timeout"]


@dataclass(frozen=True)
class ProcessInfo:
    """Who this process is in the job, as its launcher said."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "none"


def _int(env: dict, *names: str) -> int | None:
    for name in names:
        if name in env and env[name] != "":
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None
    return None


def process_info(env: dict | None = None) -> ProcessInfo:
    """Read rank, world size and local rank from torchrun, SLURM, Open MPI or PMI variables (in that order)."""
    env = dict(os.environ if env is None else env)
    for launcher, r, w, lr in (
        ("torchrun", ("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",)),
        ("slurm", ("SLURM_PROCID",), ("SLURM_NTASKS",), ("SLURM_LOCALID",)),
        ("mpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",)),
        ("pmi", ("PMI_RANK",), ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK")),
    ):
        rank_, world = _int(env, *r), _int(env, *w)
        if rank_ is not None and world is not None:
            if not 0 <= rank_ < world:
                raise ValueError(f"{launcher}: rank {rank_} is outside world size {world}")
            local = _int(env, *lr)
            return ProcessInfo(rank_, world, rank_ if local is None else local, launcher)
    return ProcessInfo()


def default_timeout() -> datetime.timedelta:
    """``FUNCTRAIN_DIST_TIMEOUT`` seconds (default 300): how long a collective may wait for a peer."""
    raw = os.environ.get("FUNCTRAIN_DIST_TIMEOUT", "300")
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"FUNCTRAIN_DIST_TIMEOUT={raw!r} is not a number of seconds") from None
    return datetime.timedelta(seconds=check_real("FUNCTRAIN_DIST_TIMEOUT", seconds, lo=0, lo_open=True))


def init(backend: str | None = None, timeout: datetime.timedelta | None = None) -> ProcessInfo:
    """Join the default process group described by the environment; a no-op for one process.

    ``MASTER_ADDR``/``MASTER_PORT`` must be set for SLURM/MPI launches (torchrun sets
    them). Returns this process's :class:`ProcessInfo`. Calling it again returns the
    same information without re-initialising.
    """
    info = process_info()
    if info.world_size == 1 or dist.is_initialized():
        return info
    if info.launcher != "torchrun":
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"{info.launcher} launch with {info.world_size} processes needs {missing} in the "
                               f"environment (the address and port of rank 0)")
        os.environ.setdefault("RANK", str(info.rank))
        os.environ.setdefault("WORLD_SIZE", str(info.world_size))
        os.environ.setdefault("LOCAL_RANK", str(info.local_rank))
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    kwargs = {}
    if cuda and backend == "nccl":
        device = torch.device("cuda", info.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size,
                            timeout=timeout or default_timeout(), **kwargs)
    return info


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def device() -> torch.device:
    """The device this process should use: ``cuda:local_rank`` when CUDA is there, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", process_info().local_rank % torch.cuda.device_count())
    return torch.device("cpu")
