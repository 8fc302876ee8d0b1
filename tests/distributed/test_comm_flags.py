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
    proposals = Vote(False, group, every=3 + 5 * r)  # (each rank proposes; the least is agreed)
    out["every"] = proposals.every()
    dist.barrier(group=other)
    return out


def test_flags_and_votes_give_every_rank_the_same_answer():
    reports = ft.launch(_worker, nprocs=2, timeout=240, dist_timeout=60)
    for out in reports:
        assert out["flags"] == [True, False, False, True]
        assert out["on_group"] == [True, False, True]
        assert out["votes"] == [False, False, True, False]  # vote k answered whether any rank wanted it at k
        assert out["vote_pulls"] == 0  # a CPU number read directly: no item(), no device sync
        assert out["every"] == 3  # the least of 3 and 8


def _stopping_worker():
    import torch.distributed as dist

    from functrain.trainer.stopping import MAX_VOTE_EVERY, StopAgreement

    r = dist.get_rank()
    out = {}
    for period in (0.0, 1e6):  # every step; as rarely as allowed (MAX_VOTE_EVERY steps)
        agreement = StopAgreement(r, 2, None, period_s=period)
        agreement.begin(None, None)
        votes, stopped = 0, None
        try:
            for step in range(1, 400):
                if r == 1 and step == 50:
                    agreement.request()  # (rank 1 only)
                before = agreement.vote
                if agreement.agreed(step):
                    stopped = step
                    break
                votes += agreement.vote is not None and agreement.vote is not before
            agreement.end_vote()
        finally:
            agreement.restore()
        out[str(period)] = {"stopped": stopped, "votes": votes}
    out["max"] = MAX_VOTE_EVERY
    return out


def test_the_stop_votes_are_spaced_by_the_least_proposal_and_agree_on_the_step():
    """A stop wanted on rank 1 at step 50 is agreed by both ranks at the same step: at step 51 when every step votes
    (a proposal of 1), at the vote after it when the ranks propose the most spacing (votes at steps 1, 2, then every
    MAX_VOTE_EVERY: the one at 2 + MAX_VOTE_EVERY carries it, read one step later)."""
    reports = ft.launch(_stopping_worker, nprocs=2, timeout=240, dist_timeout=60)
    spaced = 2 + reports[0]["max"] + 1
    for out in reports:
        assert out["0.0"] == {"stopped": 51, "votes": 50}, out  # (a vote at each of steps 1-50)
        assert out["1000000.0"] == {"stopped": spaced, "votes": 3}, out  # (steps 1, 2 and 2 + MAX_VOTE_EVERY)
