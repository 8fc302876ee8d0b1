"""Saving a replicated state from every rank (as Accelerate's examples call save_state on every process).

Real processes: 2 ranks over gloo on CPU, a free port per test, a timeout on every subprocess. In an initialised
process group, ``CheckpointManager.save`` and ``ft.save`` of an unsharded (replicated) state are rank 0's: rank 0
writes (and rotates), every other rank that calls save writes nothing and waits for rank 0's save of the same step,
bounded by ``timeout``; a different step is refused by name. Before this rule, two ranks saving into one folder
raised ``OSError: Directory not empty`` or ``FileNotFoundError`` now and then.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = textwrap.dedent("""
    import datetime, json, os, sys, time, traceback
    import torch, torch.distributed as dist
    import functrain as ft

    folder, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    N = 300  # saves at the same moment on both ranks: before the rule, a few of them raised an OSError
    report = {"rank": rank}

    def state_of(n):  # replicated: the same on every rank
        return {"w": torch.arange(4096.0) * n, "b": torch.full((3,), float(n)), "step": torch.tensor(n)}

    t0 = time.monotonic()
    try:
        if mode == "loop":  # both ranks save at the same moment (a barrier before each save), rotating keep=2
            manager = ft.CheckpointManager(folder, keep=2, fsync=False)
            paths = []
            for n in range(1, N + 1):
                dist.barrier()
                paths.append(manager.save(n, state_of(n), extra={"n": n}))
            report["paths_ok"] = all(p == manager.path(n) for n, p in zip(range(1, N + 1), paths))
        elif mode == "ft_save":  # ft.save of one path on both ranks, replaced N times
            for n in range(1, N + 1):
                dist.barrier()
                path = ft.save(os.path.join(folder, "final"), state_of(n), extra={"n": n}, fsync=False)
                report["path"] = path
                # every rank returns only once rank 0's save is complete: what it reads is step n's
                report.setdefault("read_back", []).append(ft.load_extra(path)["n"] == n)
        elif mode == "mismatch":  # rank 1 saves another step than rank 0
            manager = ft.CheckpointManager(folder, keep=2, timeout=60)
            manager.save(1 if rank == 0 else 2, state_of(1))
        elif mode == "rank0_fails":  # rank 0's save raises (an unsavable extra): rank 1 hears it, by name
            manager = ft.CheckpointManager(folder, keep=2, timeout=60)
            manager.save(1, state_of(1), extra={"bad": object()} if rank == 0 else None)
        elif mode == "timeout":  # rank 1 saves, rank 0 saves nothing
            if rank == 1:
                ft.CheckpointManager(os.path.join(folder, "mine1"), keep=2, timeout=3).save(1, state_of(1))
        elif mode == "per_rank_targets":  # each rank its own state into its own folder and path, at the same point
            manager = ft.CheckpointManager(os.path.join(folder, f"rank{rank}"), keep=2)
            for n in (1, 2, 3):
                manager.save(n, {"r": torch.full((2,), float(rank * 10 + n))})
                ft.save(os.path.join(folder, f"own-{rank}"), {"r": torch.full((2,), float(rank * 10 + n))})
            report["steps"] = manager.steps()
        elif mode == "own_folders":  # each rank's own state into its own folder: replicated=False
            manager = ft.CheckpointManager(os.path.join(folder, f"rank{rank}"), keep=2, replicated=False)
            for n in (1, 2, 3):
                manager.save(n, {"r": torch.full((2,), float(rank * 10 + n))})
            report["steps"] = manager.steps()
        elif mode == "rank0_alone":  # the documented way stays: rank 0 alone saves, never waits for the others
            manager = ft.CheckpointManager(folder, keep=2, timeout=60)
            if rank == 0:
                for n in (1, 2, 3):
                    manager.save(n, state_of(n))
                ft.save(os.path.join(folder, "final"), state_of(3))
            dist.barrier()
            report["steps"] = manager.steps()
        else:
            raise SystemExit(f"unknown mode {mode}")
    except Exception as e:
        report.update(error=type(e).__name__, message=str(e), where=traceback.format_exc()[-1500:])
    report["seconds"] = time.monotonic() - t0
    dist.barrier()  # (rank 0 hosts the store: it stays until every rank is done)
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)
""")


def _two_ranks(tmp_path, *args, timeout=240):
    """Run WORKER as ranks 0 and 1 (env rendezvous on a free port); each rank's REPORT (or None) and output."""
    from functrain.distributed import free_port

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(script), *map(str, args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    reports = []
    for out in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
        reports.append(json.loads(lines[-1][7:]) if lines else None)
    return reports, outs


def _state(n):
    import torch

    return {"w": torch.arange(4096.0) * n, "b": torch.full((3,), float(n)), "step": torch.tensor(n)}


def test_every_rank_saving_into_one_folder_writes_once_and_never_fails(tmp_path):
    """300 saves on both ranks at the same moment, keep=2: no error on either rank, the folder holds exactly the
    two newest checkpoints and nothing else, and each loads and equals its state."""
    import functrain as ft

    folder = tmp_path / "ckpt"
    (r0, r1), outs = _two_ranks(tmp_path, folder, "loop")
    assert r0 is not None and r1 is not None, outs[0][-3000:] + outs[1][-3000:]
    for r in (r0, r1):
        assert "error" not in r, r
        assert r["paths_ok"], r
    assert sorted(os.listdir(folder)) == ["step_00000299", "step_00000300"]  # no leftover (.tmp, .old, .del)
    manager = ft.CheckpointManager(folder)
    assert manager.steps() == [299, 300]
    for n in (299, 300):
        loaded = ft.load(manager.path(n), template=_state(0))
        assert ft.tree.tree_equal(loaded, _state(n))
        assert ft.load_extra(manager.path(n)) == {"n": n}


def test_ft_save_of_one_path_on_every_rank(tmp_path):
    """ft.save of the same path on both ranks, 300 times: no error; each rank returns once step n is there."""
    import functrain as ft

    (r0, r1), outs = _two_ranks(tmp_path, tmp_path / "out", "ft_save")
    assert r0 is not None and r1 is not None, outs[0][-3000:] + outs[1][-3000:]
    for r in (r0, r1):
        assert "error" not in r, r
        assert r["read_back"] == [True] * 300, r
    assert sorted(os.listdir(tmp_path / "out")) == ["final"]
    assert ft.tree.tree_equal(ft.load(tmp_path / "out" / "final", template=_state(0)), _state(300))


def test_ranks_saving_different_steps_are_refused_by_name(tmp_path):
    """Rank 0 saves step 1, rank 1 step 2 into the same folder: rank 1 raises ValueError naming both steps and the
    folder; rank 0's checkpoint is written once."""
    folder = tmp_path / "ckpt"
    (r0, r1), outs = _two_ranks(tmp_path, folder, "mismatch")
    assert r0 is not None and r1 is not None, outs[0][-3000:] + outs[1][-3000:]
    assert "error" not in r0, r0
    assert r1.get("error") == "ValueError", r1
    assert "rank 1 saves step 2" in r1["message"] and "step 1" in r1["message"], r1
    assert str(folder) in r1["message"], r1
    assert sorted(os.listdir(folder)) == ["step_00000001"]


def test_rank0s_failure_is_raised_on_the_other_ranks_at_once(tmp_path):
    """Rank 0's save raises (an extra that is not JSON): rank 0 raises it, rank 1 raises PeerFailed quoting it,
    long before its 60 s timeout."""
    (r0, r1), outs = _two_ranks(tmp_path, tmp_path / "ckpt", "rank0_fails")
    assert r0 is not None and r1 is not None, outs[0][-3000:] + outs[1][-3000:]
    assert r0.get("error") == "TypeError", r0
    assert r1.get("error") == "PeerFailed", r1
    assert "rank 0" in r1["message"] and "JSON" in r1["message"], r1
    assert r1["seconds"] < 45, r1


def test_a_rank_waiting_for_a_save_rank0_never_makes_fails_within_its_timeout(tmp_path):
    """Rank 1 saves, rank 0 does not (timeout=3): rank 1 raises PeerFailed naming the folder, the step, the timeout
    and the way out (replicated=False), within the bound; nothing is written there."""
    (r0, r1), outs = _two_ranks(tmp_path, tmp_path / "ckpt", "timeout")
    assert r0 is not None and r1 is not None, outs[0][-3000:] + outs[1][-3000:]
    assert "error" not in r0, r0
    assert r1.get("error") == "PeerFailed", r1
    message = r1["message"]
    assert "mine1" in message and "step 1" in message and "3 s" in message and "replicated=False" in message, r1
    assert 2.5 <= r1["seconds"] < 40, r1
    assert not os.path.exists(tmp_path / "ckpt" / "mine1" / "step_00000001")


def test_each_ranks_own_folder_and_path_are_written_by_that_rank(tmp_path):
    """Every rank saves its own state into a folder (and an ft.save path) of its own, at the same points: rank 0's
    save at that point goes elsewhere, so each rank writes its own, as before the rule."""
    import functrain as ft
    import torch

    (r0, r1), outs = _two_ranks(tmp_path, tmp_path / "ckpt", "per_rank_targets")
    assert r0 is not None and r1 is not None, outs[0][-3000:] + outs[1][-3000:]
    for rank, r in enumerate((r0, r1)):
        assert "error" not in r, r
        assert r["steps"] == [2, 3], r
        want = torch.full((2,), float(rank * 10 + 3))
        assert torch.equal(ft.CheckpointManager(tmp_path / "ckpt" / f"rank{rank}").load_latest().state["r"], want)
        assert torch.equal(ft.load(tmp_path / "ckpt" / f"own-{rank}")["r"], want)


def test_replicated_false_lets_each_rank_write_its_own_folder(tmp_path):
    import functrain as ft
    import torch

    (r0, r1), outs = _two_ranks(tmp_path, tmp_path / "ckpt", "own_folders")
    assert r0 is not None and r1 is not None, outs[0][-3000:] + outs[1][-3000:]
    for rank, r in enumerate((r0, r1)):
        assert "error" not in r, r
        assert r["steps"] == [2, 3], r
        got = ft.CheckpointManager(tmp_path / "ckpt" / f"rank{rank}").load_latest().state["r"]
        assert torch.equal(got, torch.full((2,), float(rank * 10 + 3)))


def test_rank0_alone_still_saves_without_waiting(tmp_path):
    """The documented way (rank 0 alone calls save) is unchanged: nothing waits, both ranks see the checkpoints."""
    (r0, r1), outs = _two_ranks(tmp_path, tmp_path / "ckpt", "rank0_alone")
    assert r0 is not None and r1 is not None, outs[0][-3000:] + outs[1][-3000:]
    for r in (r0, r1):
        assert "error" not in r, r
        assert r["steps"] == [2, 3], r
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["final", "step_00000002", "step_00000003"]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "10", True])
def test_a_bad_timeout_is_refused_by_name(tmp_path, bad):
    import functrain as ft

    with pytest.raises((ValueError, TypeError), match="timeout"):
        ft.CheckpointManager(tmp_path, timeout=bad)
