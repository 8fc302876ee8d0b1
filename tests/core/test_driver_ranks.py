"""ft.run on 2 real processes (gloo): an agreed stop (rank 1 alone asks; both stop at its step, with the same
state), a clear error when a rank dies instead of a hang, and the console: one bar for the job (rank 0's), left on
screen with its rate, and lines printed during training above the bar, never glued onto it."""
import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

import functrain

pytest.importorskip("tqdm")
ROOT = os.path.dirname(os.path.dirname(functrain.__file__))  # the ranks import this functrain

SCRIPT = textwrap.dedent("""
    import json, os, sys, torch, functrain as ft

    ft.distributed.init()
    rank, mode, k = int(os.environ["RANK"]), sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    apply_fn, params, buffers = ft.functionalize(torch.nn.Linear(3, 1))

    def loss_fn(p, b, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(apply_fn(p, b, x), y)

    step = ft.data_parallel()(ft.train_step(loss_fn, ft.optim.sgd(0.1)))
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    data = [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(20)]

    def on_step(i, state, metrics):
        if mode == "die" and rank == 1 and i == k:
            os._exit(3)  # gone without a word, before its vote
        print(f"rank {rank} ran step {i}")
        return rank == 1 and i == k  # rank 1 alone asks to stop

    try:
        state = ft.run(step, step.init(params, buffers), data, log_every=5, on_step=on_step)
    except RuntimeError as e:
        print("ERROR " + str(e).splitlines()[0], flush=True)
        os._exit(2)  # (a gloo group with a dead peer may abort in its teardown at exit)
    print("RESULT " + json.dumps({"rank": rank, "step": int(state.step),
                                  "params": [float(v) for p in state.params.values() for v in p.reshape(-1)]}))
    torch.distributed.destroy_process_group()
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(tmp_path, mode: str, k: int, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Both ranks' runs (each one's stdout and stderr merged, as a terminal shows them)."""
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1",
               FUNCTRAIN_DIST_TIMEOUT="60", PYTHONUNBUFFERED="1", TQDM_MININTERVAL="0",  # the bar drawn every step
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, str(script), mode, str(k)], cwd=tmp_path,  # bytes: every \r kept
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    done = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out.decode(errors="replace"), ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return done


def _screen(text: str) -> list[str]:
    """The lines as a terminal leaves them: each carriage return starts the line over, writing over it."""
    lines = []
    for raw in text.split("\n"):
        line = ""
        for part in raw.split("\r"):
            line = part + line[len(part):]
        lines.append(line.rstrip())
    return lines


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """Rank 1 alone asks to stop at step 7 (not a log step)."""
    return _two_ranks(tmp_path_factory.mktemp("stop"), "stop", 7)


def test_one_rank_s_stop_stops_every_rank_at_its_step(stopped):
    for p in stopped:
        assert p.returncode == 0, p.stdout
    results = [json.loads(m) for p in stopped for m in re.findall(r"RESULT (\{.*\})", p.stdout)]
    assert sorted(r["rank"] for r in results) == [0, 1], [p.stdout for p in stopped]
    assert [r["step"] for r in results] == [7, 7]  # both at rank 1's step
    assert results[0]["params"] == results[1]["params"]  # one data-parallel run: the same state
    assert "rank 0 ran step 8" not in stopped[0].stdout


def test_one_bar_for_the_job_left_with_its_rate(stopped):
    assert "/20 [" not in stopped[1].stdout  # rank 1 draws none
    screen = _screen(stopped[0].stdout + stopped[1].stdout)  # the combined output, as a terminal leaves it
    bars = [line for line in screen if re.search(r"\d+/20 \[", line)]
    assert len(bars) == 1, screen  # one bar, left on screen at the end
    assert "7/20 [" in bars[0] and re.search(r"\d ?(it/s|s/it)", bars[0]), bars  # at the stop step, with the rate


def test_lines_printed_during_the_run_land_above_the_bar(stopped):
    screen = _screen(stopped[0].stdout)
    printed = [line for line in screen if "rank 0 ran step" in line]
    assert [line for line in printed] == [f"rank 0 ran step {i}" for i in range(1, 8)], screen


def test_a_rank_that_died_is_a_clear_error_not_a_hang(tmp_path):
    rank0, rank1 = _two_ranks(tmp_path, "die", 4)
    assert rank1.returncode == 3
    assert rank0.returncode == 2, rank0.stdout
    assert "ERROR ft.run: the processes could not agree whether to stop after step 4" in rank0.stdout
