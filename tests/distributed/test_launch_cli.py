"""python -m functrain.launch: real multi-process jobs over gloo (torchrun underneath), every one with a timeout."""
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import two_nodes_on_loopback

from functrain.distributed import cli
from functrain.distributed import free_port

TRAIN = textwrap.dedent("""
    import atexit, os, sys, threading, time, torch, functrain as ft

    info = ft.distributed.init()
    # the runner's exit still joins the script's threads and runs its atexit handlers
    atexit.register(lambda: sys.stdout.write(f"ATEXIT {info.rank}\\n") and sys.stdout.flush())
    threading.Thread(target=lambda: time.sleep(0.5) or sys.stdout.write(f"THREAD {info.rank}\\n")).start()
    pool = __import__("concurrent.futures").futures.ThreadPoolExecutor(1)  # an idle worker thread at exit
    pool.submit(int).result()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    apply_fn, params, buffers = ft.functionalize(model)
    if info.rank:  # another start on rank 1: data_parallel's init must broadcast rank 0's
        params = {k: v + 1.0 for k, v in params.items()}

    def loss_fn(params, buffers, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)

    step = ft.data_parallel()(ft.train_step(loss_fn, ft.optim.adamw(1e-2)))
    state = step.init(params, buffers)
    start = sum(float(p.double().sum()) for p in state.params.values())
    g = torch.Generator().manual_seed(100 + ft.distributed.rank())  # each rank its own shard
    for _ in range(5):
        x = torch.randn(16, 8, generator=g)
        state, metrics = step(state, (x, x.sum(1, keepdim=True)))
    checksum = sum(float(p.double().sum()) for p in state.params.values())
    # one write: the ranks share the console, and print() writes the text and the newline separately
    sys.stdout.write("RESULT " + __import__("json").dumps({
        "rank": ft.distributed.rank(), "world": ft.distributed.world_size(), "checksum": checksum,
        "start": start, "args": sys.argv[1:], "dist_timeout": os.environ.get("FUNCTRAIN_DIST_TIMEOUT"),
        "omp": os.environ.get("OMP_NUM_THREADS")}) + "\\n")
    sys.stdout.flush()
""")

FAIL = textwrap.dedent("""
    import torch, functrain as ft
    import torch.distributed as dist

    info = ft.distributed.init()

    def boom():
        raise KeyError("rank one failed")

    t = torch.ones(1)
    dist.all_reduce(t)  # both ranks are up
    if info.rank == 1:
        boom()
    for _ in range(100):
        dist.all_reduce(t)  # rank 0 waits on the dead peer: must end, not hang
    print("rank 0 should not get here", flush=True)
""")


def _env():
    env = dict(os.environ)
    for var in ("FUNCTRAIN_DIST_TIMEOUT", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"):
        env.pop(var, None)
    return env


def _cmd(*args):
    return [sys.executable, "-m", "functrain.launch", *map(str, args)]


def _results(out: str) -> list[dict]:
    return sorted((json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", out)), key=lambda r: r["rank"])


def _check_trained(results: list[dict]) -> None:
    assert [r["rank"] for r in results] == [0, 1], results
    assert all(r["world"] == 2 for r in results), results
    assert results[0]["start"] == results[1]["start"], "initial state not broadcast from rank 0"
    assert results[0]["checksum"] == results[1]["checksum"], "ranks diverged"
    assert results[0]["checksum"] != results[0]["start"], "no training happened"


def test_two_processes_train_data_parallel(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    p = subprocess.run(_cmd("--nproc", 2, script, "--lr", "0.1", "extra"), cwd=tmp_path,
                       env={**_env(), "TMPDIR": str(scratch)}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    results = _results(p.stdout)
    _check_trained(results)
    for r in results:
        assert r["args"] == ["--lr", "0.1", "extra"]  # everything after the script is the script's
        assert r["dist_timeout"] == str(cli.DEFAULT_DIST_TIMEOUT_S) and r["omp"] == "1"
    for rank in (0, 1):
        assert f"ATEXIT {rank}" in p.stdout and f"THREAD {rank}" in p.stdout, p.stdout
    assert not list(scratch.glob("functrain-launch-*")), "the launcher's log folder was left behind"


def test_two_nodes_on_loopback_form_one_world(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    nodes = two_nodes_on_loopback(script, tmp_path, _env(), 120)
    for returncode, out, err in nodes:
        assert returncode == 0, out + err
    outs = [(out, err) for _, out, err in nodes]
    assert [r["rank"] for r in _results(outs[0][0])] == [0]  # node 0 runs global rank 0, node 1 rank 1
    assert [r["rank"] for r in _results(outs[1][0])] == [1]
    _check_trained(_results(outs[0][0] + outs[1][0]))


def test_a_failing_rank_ends_the_job_with_one_traceback(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(FAIL)
    t0 = time.monotonic()
    p = subprocess.run(_cmd("--nproc", 2, script), cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=90)
    elapsed = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert elapsed < 60, f"the failed job took {elapsed:.0f} s to end"
    assert "should not get here" not in out
    assert out.count("Traceback (most recent call last)") == 1, out  # rank 0's secondary error is not shown
    assert out.count("[rank1]: Traceback (most recent call last)") == 1, out
    assert out.count("[rank1]: KeyError: 'rank one failed'") == 1, out
    assert out.count(", in boom") == 1, out
    assert "ChildFailedError" not in out and "To enable traceback" not in out, out
    summary = [ln for ln in out.splitlines() if "failed first" in ln]
    assert len(summary) == 1 and "rank 1 " in summary[0] and "KeyError" in summary[0], out


def test_script_exit_code_passes_through(tmp_path):
    script = tmp_path / "exit3.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    p = subprocess.run(_cmd("--nproc", 2, script), cwd=tmp_path, env=_env(), capture_output=True, text=True,
                       timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 3, out
    assert "Traceback" not in out and "rank 1 (local rank 1" in out, out


def test_a_missing_node_0_fails_within_the_join_timeout(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    t0 = time.monotonic()
    p = subprocess.run(_cmd("--nnodes", 2, "--node-rank", 1, "--master-addr", "127.0.0.1", "--master-port",
                            free_port(), "--join-timeout", 3, script),
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=90)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "the job could not start" in p.stderr and "--join-timeout 3 s" in p.stderr, p.stderr
    assert time.monotonic() - t0 < 45
    assert "RESULT" not in p.stdout


def test_usage_errors(tmp_path, capsys):
    assert cli.main(["--nproc", "2", str(tmp_path / "missing.py")]) == 2
    assert "no such script" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    assert "--nproc" in capsys.readouterr().out


def test_root_cause_prefers_an_own_error_over_a_lost_peer(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(rank, message, when, secondary, exitcode=1):
        path = tmp_path / f"error{rank}.json"
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "Traceback ...", "timestamp": str(int(when)), "functrain_time": repr(when),
            "secondary": secondary}}}))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))

    lost = failure(0, "RuntimeError: Connection closed by peer", 10.0, True)  # reported first, but secondary
    own = failure(1, "KeyError: 'x'", 10.5, False)
    assert cli._root({0: lost, 1: own}) == 1
    assert cli._root({0: lost}) == 0
    killed = ProcessFailure(local_rank=2, pid=102, exitcode=-15, error_file=str(tmp_path / "none.json"))
    assert cli._root({2: killed, 1: own}) == 1
    early = failure(3, "ValueError: y", 9.0, False)
    assert cli._root({1: own, 3: early, 0: lost}) == 3
