"""distributed/comm.py's flags on 2 gloo ranks: any_rank / every_rank (at once, on the default group or on a gloo
group of their own, gloo_group), and Vote (asked at one step, answered later: the same answer on every rank, read
without a device read). The Trainer's stop vote, its lock, export and finite-checkpoint agreements use them."""
import datetime

import functrain as ft


def _worker():
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from functrain.distributed.comm import Vote, any_rank, every_rank, gloo_group

    class Pulls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                self.n += 1
            return func(*args, **(kwargs or {}))

    r = dist.get_rank()
    out = {"flags": [any_rank(r == 1), any_rank(False), every_rank(r == 0), every_rank(True)]}
    group = gloo_group(30.0)
    other = gloo_group(datetime.timedelta(seconds=30))
    out["on_group"] = [any_rank(r == 0, group), every_rank(r == 0, other), every_rank(True, group)]
    # votes: rank 1 wants a stop at vote 2 only; each vote is read after the next one started (as the Trainer does)
    answers, pending = [], None
    with Pulls() as pulls:
        for k in range(4):
            vote = Vote(r == 1 and k == 2, group)
            if pending is not None:
                answers.append(pending.result())
            pending = vote
        pending.wait()
        answers.append(pending.result())
    out["votes"], out["vote_pulls"] = answers, pulls.n
    dist.barrier(group=other)
    return out


def test_flags_and_votes_give_every_rank_the_same_answer():
    reports = ft.launch(_worker, nprocs=2, timeout=240, dist_timeout=60)
    for out in reports:
        assert out["flags"] == [True, False, False, True]
        assert out["on_group"] == [True, False, True]
        assert out["votes"] == [False, False, True, False]  # vote k answered whether any rank wanted it at k
        assert out["vote_pulls"] == 0  # a CPU number read directly: no item(), no device sync
