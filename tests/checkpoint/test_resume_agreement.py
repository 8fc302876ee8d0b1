"""CheckpointManager.load_latest on several processes: the ranks agree on one checkpoint, or fail together.

Real processes (2 ranks over gloo on CPU, a free port per test, a timeout on every subprocess). Each rank
checks its own part of each candidate (its shard; the whole checkpoint when every rank loads it), one small
collective per candidate combines the verdicts, and every rank loads the newest checkpoint that is whole on
every rank. A rank that dies or hangs during the agreement makes the other fail with PeerFailed within the
group's timeout, never hang.
"""
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = textwrap.dedent("""
    import datetime, json, os, sys, time, warnings
    import torch, torch.distributed as dist
    import functrain as ft

    folder, mode, fault = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))  # the agreement's bound

    def problem():
        params = {"w": torch.arange(15.0).reshape(5, 3), "b": torch.ones(3)}
        step = ft.ema(0.9, warmup=False)(ft.train_step(lambda p, b, x: (p["w"].sum(0) * p["b"] * x).sum(), ft.optim.adamw(1e-2)))
        if mode != "replicated":
            step = ft.data_parallel(shard=mode)(step)
        return step, params

    step, params = problem()
    manager = ft.CheckpointManager(folder, keep=None)
    state = step.init(params)
    states = {}
    for n in (1, 2, 3):
        state, _ = step(state, torch.ones(3))
        if mode != "replicated" or rank == 0:  # a sharded state: every rank its shard; replicated: rank 0
            manager.save(n, state, extra={"n": n})
        states[n] = ft.gather_state(state) if mode != "replicated" else state
    dist.barrier()

    if fault == "rank1-sees-3-damaged" and rank == 1:  # this rank alone finds step 3 damaged (its own read)
        from functrain.checkpoint import manager as m
        real = m.CheckpointManager._try
        def _try(self, path, n, *a):
            if n == 3:
                return 1, ft.checkpoint.CheckpointError(f"{path}/tensors.safetensors: read error on rank 1"), None
            return real(self, path, n, *a)
        m.CheckpointManager._try = _try
    if fault in ("dies", "hangs") and rank == 1:
        from functrain.checkpoint import manager as m
        def _try(self, *a):
            if fault == "hangs":
                time.sleep(25)  # far past the group's 5 s timeout
            os._exit(3)
        m.CheckpointManager._try = _try

    t0 = time.monotonic()
    report = {"rank": rank}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            restored = manager.load_latest(template=step.init(params), group=group)
            report.update(step=restored.step, extra=restored.extra,
                          exact=ft.tree.tree_equal(ft.gather_state(restored.state) if mode != "replicated"
                                                   else restored.state, states[restored.step]))
        except Exception as e:
            report.update(error=type(e).__name__, message=str(e), chain=repr(e.__cause__))
    report["seconds"] = time.monotonic() - t0
    report["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)  # (a gloo group torn down at exit with a dead peer may abort: the report is what counts)
""")


def _two_ranks(tmp_path, *args, timeout=180):
    """Run WORKER as ranks 0 and 1 (env rendezvous on a free port); returns each rank's REPORT (or None) and
    its output."""
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


@pytest.mark.parametrize("mode", ["replicated", "optimizer"])
def test_a_checkpoint_one_rank_finds_damaged_is_skipped_by_every_rank(tmp_path, mode):
    """Rank 1 alone finds step 3 damaged: both ranks load step 2; rank 0 names step 3, rank 1 and why."""
    (r0, r1), outs = _two_ranks(tmp_path, tmp_path / "ckpt", mode, "rank1-sees-3-damaged")
    assert r0 is not None and r1 is not None, outs[0][-3000:] + outs[1][-3000:]
    for r in (r0, r1):
        assert "error" not in r, r
        assert r["step"] == 2 and r["extra"] == {"n": 2} and r["exact"], r
    assert len(r0["warnings"]) == 1, r0["warnings"]
    warning = r0["warnings"][0]
    assert "step_00000003" in warning and "rank 1:" in warning and "read error on rank 1" in warning, warning
    assert "tensors.safetensors" in warning and "step_00000002 (step 2) instead" in warning, warning
    assert r1["warnings"] == [], "the skipped checkpoint is named once, by rank 0"


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_rank_lost_during_the_agreement_fails_the_other_in_bounded_time(tmp_path, fault):
    """Rank 1 dies (or hangs) while the ranks agree: rank 0 raises PeerFailed naming the agreement, within the
    group's 5 s timeout (plus slack for a loaded machine), and never loads a checkpoint alone."""
    (r0, r1), outs = _two_ranks(tmp_path, tmp_path / "ckpt", "optimizer", fault)
    assert r0 is not None, outs[0][-3000:]
    assert r0.get("error") == "PeerFailed", r0
    assert "agreeing which checkpoint" in r0["message"] and "to resume" in r0["message"], r0
    assert r0["seconds"] < 60, r0
    if fault == "hangs":
        assert "Timed out" in r0["message"] or "timed out" in r0["message"].lower(), r0
    from functrain.distributed.faults import LOST, TIMEOUT

    assert r1 is None  # (it died, or hung and then died, without a report)
    expected = {"dies": LOST, "hangs": TIMEOUT}[fault]
    from functrain.distributed.faults import cause_of

    assert cause_of(r0["message"]) in (expected, LOST), r0  # the launchers blame rank 1, never rank 0
