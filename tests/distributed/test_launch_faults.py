"""Launchers under faults: no orphan ranks, the right rank blamed, a bounded and configurable grace period.

Both launchers (``python -m functrain.launch`` and ``ft.launch``) on real processes over gloo, with small
timeouts so the tests stay fast; every subprocess has a timeout.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import functrain as ft
from functrain.distributed import LaunchError, cli, spawn
from functrain.distributed.faults import RankEnd, cause_of, describe_end, left_early, root_cause


def _env():
    env = dict(os.environ)
    for var in ("FUNCTRAIN_DIST_TIMEOUT", "OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "FUNCTRAIN_LAUNCHER_PID", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        env.pop(var, None)
    return env


def _cmd(*args):
    return [sys.executable, "-m", "functrain.launch", *map(str, args)]


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a zombie has ended; only its exit status is left)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_for(paths, timeout: float, proc=None) -> None:
    end = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the launcher ended early ({proc.returncode}): {proc.communicate()}")
        if time.monotonic() > end:
            raise AssertionError(f"not all of {paths} appeared within {timeout} s")
        time.sleep(0.2)


def _pids(folder, n=2):
    return [int((folder / f"pid{r}").read_text()) for r in range(n)]


def _assert_all_dead(pids, within: float = 10.0) -> None:
    end = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.2)
    alive = [p for p in pids if _alive(p)]
    for p in alive:  # never leave them behind, even when the test fails
        os.kill(p, signal.SIGKILL)
    assert not alive, f"rank processes {alive} still alive {within:g} s after their launcher was SIGKILLed"


# --------------------------------------------------------------------------- the classifier (both launchers)

def test_one_classifier_for_both_launchers():
    assert cause_of(RuntimeError("[pair.cc:534] Read error [127.0.0.1]:1: Connection reset by peer")) == "lost_peer"
    assert cause_of("RuntimeError: [unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation") \
        == "peer_timeout"
    wrapped = ValueError("while stepping")
    wrapped.__cause__ = RuntimeError("Connection closed by peer")
    assert cause_of(wrapped) == "lost_peer"
    assert cause_of(KeyError("x")) == "own"
    # a rank that timed out waiting loses to the rank that was still running (hung)
    hung = [RankEnd(0, "error", cause="peer_timeout", time=5.0), RankEnd(1, "signal", code=15, time=6.0)]
    assert root_cause(hung).rank == 1
    assert root_cause([RankEnd(0, "error", cause="peer_timeout", time=5.0), RankEnd(1, "running")]).rank == 1
    # SIGTERM without a timeout is the launcher stopping a healthy rank: not the cause
    assert root_cause([RankEnd(0, "error", cause="lost_peer", time=5.0),
                       RankEnd(1, "signal", code=15, time=4.0)]).rank == 0
    assert root_cause([RankEnd(0, "error", cause="lost_peer", time=5.0),
                       RankEnd(1, "signal", code=9, time=6.0)]).rank == 1
    assert root_cause([RankEnd(0, "error", time=7.0), RankEnd(1, "signal", code=9, time=6.0)]).rank == 0
    # a rank that finished before anyone failed left its peers in a collective without it: it is the cause ...
    early = [RankEnd(0, "error", cause="lost_peer", time=9.0), RankEnd(1, "done", time=5.0)]
    assert root_cause(early).rank == 1 and left_early(early[1], early)
    assert "finished (exit status 0) while rank(s) 0 were still running" in describe_end(early[1], early)
    # ... but not one that finished after the failure, nor one with an unknown time, nor over an own error
    assert root_cause([RankEnd(0, "error", cause="lost_peer", time=5.0), RankEnd(1, "done", time=9.0)]).rank == 0
    assert root_cause([RankEnd(0, "error", cause="lost_peer", time=5.0), RankEnd(1, "done")]).rank == 0
    assert root_cause([RankEnd(0, "error", time=9.0), RankEnd(1, "done", time=5.0)]).rank == 0
    assert root_cause([RankEnd(0, "error", cause="peer_timeout", time=9.0), RankEnd(1, "running"),
                       RankEnd(2, "done", time=5.0)]).rank == 2
    # the CLI's launcher-side report and ft.launch both go through this one function
    assert cli.root_cause is root_cause and spawn.root_cause is root_cause
    assert not hasattr(spawn, "SECONDARY_ERRORS") and not hasattr(cli, "_SECONDARY")


# --------------------------------------------------------------------------- python -m functrain.launch

SLEEPER = textwrap.dedent("""
    import os, sys, time, pathlib, torch, functrain as ft
    import torch.distributed as dist

    info = ft.distributed.init()
    out = pathlib.Path(sys.argv[1])
    t = torch.ones(1)
    dist.all_reduce(t)
    (out / f"pid{info.rank}").write_text(str(os.getpid()))
    while True:  # "training": a collective and a checkpoint-like write every 0.2 s
        dist.all_reduce(t)
        (out / f"step{info.rank}").write_text(str(time.time()))
        time.sleep(0.2)
""")


def test_sigkill_of_the_cli_launcher_kills_every_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**_env(), "TMPDIR": str(scratch)}
    launcher = subprocess.Popen(_cmd("--nproc", 2, "--dist-timeout", 60, script, tmp_path), cwd=tmp_path,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"], 90, launcher)
        pids = _pids(tmp_path)
        assert all(_alive(p) for p in pids)
        launcher.kill()  # SIGKILL: no handler, no forwarding
        launcher.wait(timeout=10)
        _assert_all_dead(pids)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    # the killed launcher could not remove its temporary log folder: the next launch does
    assert len(list(scratch.glob("functrain-launch-*"))) == 1
    (tmp_path / "empty.py").write_text("")
    p = subprocess.run(_cmd("--nproc", 1, tmp_path / "empty.py"), cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not list(scratch.glob("functrain-launch-*")), "a dead launcher's log folder was left behind"


HANG = textwrap.dedent("""
    import sys, time, torch, functrain as ft
    import torch.distributed as dist

    info = ft.distributed.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    if info.rank == 1:
        time.sleep(3600)  # hung: never reaches the next collective
    dist.all_reduce(t)
    print("should not get here", flush=True)
""")


def test_a_hung_rank_is_named_within_the_dist_timeout(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    t0 = time.monotonic()
    p = subprocess.run(_cmd("--nproc", 2, "--dist-timeout", 3, "--term-timeout", 5, script), cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    summary = [ln for ln in out.splitlines() if "failed first" in ln]
    assert len(summary) == 1, out
    assert summary[0].startswith(f"{cli._prog()}: rank 1 "), out  # the hung rank, not the one that waited
    assert "did not arrive" in summary[0] and "3 s" in summary[0], out
    assert "should not get here" not in out
    assert elapsed < 60, f"the hung job took {elapsed:.0f} s to end"


TERM = textwrap.dedent("""
    import os, signal, sys, time, pathlib, functrain as ft

    info = ft.distributed.init()
    out = pathlib.Path(sys.argv[1])
    need = float(sys.argv[2])
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    (out / f"pid{info.rank}").write_text(str(os.getpid()))
    while not stop:
        time.sleep(0.05)
    time.sleep(need)  # "saving a checkpoint" takes this long
    (out / f"saved{info.rank}").write_text("ok")
    sys.exit(143)
""")


@pytest.mark.parametrize("term_timeout,saved,work", [(15, True, 4), (1, False, 10)])
def test_term_timeout_is_the_grace_the_ranks_get(tmp_path, term_timeout, saved, work):
    script = tmp_path / "term.py"
    script.write_text(TERM)
    launcher = subprocess.Popen(_cmd("--nproc", 2, "--term-timeout", term_timeout, script, tmp_path, work),
                                cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"], 90, launcher)
        time.sleep(0.5)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)  # e.g. the cluster's preemption: forwarded to the ranks
        out, err = launcher.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert "stopped by SIGTERM" in err, err
    done = sorted(p.name for p in tmp_path.glob("saved*"))
    if saved:  # 4 s of work < 15 s of grace: both ranks finish; 143 says they ended by themselves
        assert done == ["saved0", "saved1"], out + err
        assert launcher.returncode == 128 + signal.SIGTERM, out + err
        assert "every rank ended by itself within --term-timeout 15 s" in err, err
    else:  # 10 s of work > 1 s of grace: SIGKILLed (the default, 30 s, would have let them finish); the margin
        # (killed at ~1 s, the work would end at 10 s) holds on a loaded machine
        assert done == [], out + err
        assert elapsed < work, f"the ranks were not killed after --term-timeout 1 ({elapsed:.1f} s)"
        # the exit status says the ranks did not finish: 137, not the 143 of a clean stop
        assert launcher.returncode == 128 + signal.SIGKILL, out + err
        assert "rank(s) 0, 1 did not end within --term-timeout 1 s and were SIGKILLed" in err, err
    _assert_all_dead(_pids(tmp_path), within=5.0)


HUNG_IGNORING_SIGTERM = textwrap.dedent("""
    import pathlib, signal, sys, time, torch, functrain as ft
    import torch.distributed as dist

    info = ft.distributed.init()
    out = pathlib.Path(sys.argv[1])
    t = torch.ones(1)
    dist.all_reduce(t)
    if info.rank == 1:
        # hung; its SIGTERM handler (a Trainer's, say) only sets a flag that the hung code never reads
        signal.signal(signal.SIGTERM, lambda *a: (out / "sigterm1").write_text(repr(time.time())))
        (out / "hung1").write_text(repr(time.time()))
        while True:
            time.sleep(1)
    dist.all_reduce(t)
""")


def test_a_hung_rank_gets_exactly_term_timeout_after_sigterm(tmp_path):
    """Rank 1 hangs and survives SIGTERM; rank 0 times out after 3 s and fails: the launcher stops rank 1 with
    SIGTERM and SIGKILLs it --term-timeout (5 s) later, not after torchrun's own 30 s."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG_IGNORING_SIGTERM)
    p = subprocess.run(_cmd("--nproc", 2, "--dist-timeout", 3, "--term-timeout", 5, script, tmp_path),
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    ended = time.time()
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    summary = [ln for ln in out.splitlines() if "failed first" in ln]
    assert len(summary) == 1 and summary[0].startswith(f"{cli._prog()}: rank 1 "), out
    assert "did not arrive" in summary[0] and "SIGKILL" in summary[0], out
    hung, sigterm = float((tmp_path / "hung1").read_text()), float((tmp_path / "sigterm1").read_text())
    grace = ended - sigterm  # from the SIGTERM to the launcher's exit (its SIGKILL, plus its exit)
    print(f"hang -> SIGTERM {sigterm - hung:.1f} s, SIGTERM -> exit {grace:.1f} s")
    assert grace >= 4.9, f"rank 1 got only {grace:.1f} s of the 5 s grace"
    assert grace < 15, f"rank 1 was SIGKILLed {grace:.1f} s after SIGTERM, not --term-timeout 5 s later"
    assert ended - hung < 3 + 5 + 10, f"the job ended {ended - hung:.0f} s after the hang"


EARLY = textwrap.dedent("""
    import sys, time, torch, functrain as ft
    import torch.distributed as dist

    info = ft.distributed.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    if info.rank == 1:
        sys.exit(0)  # leaves early: fewer steps than rank 0
    for _ in range(600):
        dist.all_reduce(t)
        time.sleep(0.05)
""")


def test_a_rank_that_exits_0_early_is_blamed_by_the_cli(tmp_path):
    script = tmp_path / "early.py"
    script.write_text(EARLY)
    p = subprocess.run(_cmd("--nproc", 2, "--dist-timeout", 30, script), cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out  # rank 0's status: it failed (because of rank 1)
    summary = [ln for ln in out.splitlines() if ln.startswith(f"{cli._prog()}: rank ")]
    assert len(summary) == 1, out
    assert summary[0].startswith(f"{cli._prog()}: rank 1 (local rank 1, pid "), out
    assert "finished (exit status 0) while rank(s) 0 were still running" in summary[0], out
    assert "another node" not in out, out  # a one-node job: no peer elsewhere to blame


def test_term_timeout_usage(tmp_path, capsys):
    script = tmp_path / "x.py"
    script.write_text("")
    assert cli.main(["--term-timeout", "-1", str(script)]) == 2
    assert "--term-timeout must be an int >= 0; got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "--term-timeout" in capsys.readouterr().out


# --------------------------------------------------------------------------- ft.launch

def _hang_on_rank_1():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.all_reduce(t)
    return 0


def test_ft_launch_names_the_hung_rank():
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 of 2 did not arrive at a collective within the collective "
                                          r"timeout \(3 s\)") as info:
        ft.launch(_hang_on_rank_1, nprocs=2, dist_timeout=3, timeout=120)
    assert "Timed out waiting" in str(info.value)  # rank 0's report comes with it
    assert time.monotonic() - t0 < 60


def _sigkill_rank_1():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(100):
        dist.all_reduce(t)  # rank 0 loses its peer: it fails, but is not to blame
        time.sleep(0.05)
    return 0


def test_ft_launch_blames_the_killed_rank_not_the_survivor():
    with pytest.raises(LaunchError, match=r"rank 1 of 2 was killed by signal 9 \(SIGKILL\)"):
        ft.launch(_sigkill_rank_1, nprocs=2, dist_timeout=30, timeout=120)


def _rank_1_returns_early():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        return 1  # leaves early: fewer steps than rank 0
    for _ in range(600):
        dist.all_reduce(t)
        time.sleep(0.05)
    return 0


def test_ft_launch_blames_the_rank_that_returned_early():
    with pytest.raises(LaunchError, match=r"rank 1 of 2 finished \(exit status 0\) while rank\(s\) 0 were still "
                                          r"running") as info:
        ft.launch(_rank_1_returns_early, nprocs=2, dist_timeout=30, timeout=120)
    assert "Connection" in str(info.value)  # rank 0's report (it lost its peer) comes with it


def test_ft_launch_checks_its_arguments():
    with pytest.raises(ValueError, match=r"dist_timeout must be a number > 0; got 0"):
        ft.launch(_hang_on_rank_1, nprocs=2, dist_timeout=0)
    with pytest.raises(ValueError, match=r"nprocs must be an int >= 1; got True"):
        ft.launch(_hang_on_rank_1, nprocs=True)


PARENT = textwrap.dedent("""
    import os, pathlib, sys, time
    import functrain as ft

    def work(out):
        import torch.distributed as dist
        pathlib.Path(out, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
        time.sleep(3600)

    if __name__ == "__main__":
        ft.launch(work, nprocs=2, args=(sys.argv[1],), timeout=3600)
""")


def test_sigkill_of_the_ft_launch_caller_kills_every_rank(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"], 90, parent)
        pids = _pids(tmp_path)
        parent.kill()
        parent.wait(timeout=10)
        _assert_all_dead(pids)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_the_functrain_launch_console_script_points_at_the_cli(tmp_path):
    import importlib
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    target = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["functrain-launch"]
    module, func = target.split(":")
    main = getattr(importlib.import_module(module), func)
    assert main is cli.main
    # what the installed script does: sys.exit(main()) with sys.argv[0] = "functrain-launch"
    p = subprocess.run([sys.executable, "-c", f"import sys; sys.argv[0] = 'functrain-launch'; "
                        f"from {module} import {func}; sys.exit({func}())", "--help"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "usage: functrain-launch" in p.stdout and "--term-timeout" in p.stdout, p.stderr
