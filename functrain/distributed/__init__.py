"""Many processes: the process group, data parallelism (replicated and sharded state) and launchers.

``ft.distributed.init()`` forms the process group from torchrun/SLURM/MPI/PMI
variables (:mod:`.group`); :func:`data_parallel` is the step transform that
reduces gradients across it (:mod:`.data_parallel`, sharded state in
:mod:`.sharding`), :func:`local_sgd` the mode that averages the params every k steps instead
(:mod:`.local_sgd`); the small host-side collectives the other packages use live in :mod:`.comm`; :func:`launch` runs a function on N local processes (:mod:`.spawn`) and
``python -m functrain.launch`` wraps torchrun (:mod:`.cli`, its agent in :mod:`.agent`); both blame the
rank that failed first with one classifier and end their ranks when they die
(:mod:`.faults`); the helpers for scripts run on every rank (print once, rank 0 first, a barrier, split a
list) are in :mod:`.process`.
"""
from .data_parallel import DataParallel, data_parallel
from .local_sgd import LocalSGD, local_sgd
from .sharding import ShardedDataParallel, gather_state
from .group import ProcessInfo, default_timeout, device, init, is_initialized, process_info, rank, world_size
from .faults import PeerFailed
from .process import (is_local_main_process, is_main_process, main_process_first, print_main,
                      split_between_processes, wait_for_everyone)
from .spawn import LaunchError, free_port, launch

__all__ = ["ProcessInfo", "process_info", "init", "is_initialized", "rank", "world_size", "device",
           "default_timeout", "data_parallel", "DataParallel", "local_sgd", "LocalSGD", "ShardedDataParallel",
           "gather_state",
           "launch", "free_port", "LaunchError", "PeerFailed", "print_main", "is_main_process",
           "is_local_main_process", "main_process_first", "wait_for_everyone", "split_between_processes"]
