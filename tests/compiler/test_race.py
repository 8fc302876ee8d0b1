"""The fastest runner per call (issue 40, functrain/compiler/race.py): a background compile's JIT code against the
package built in the same run, timed on alternate calls, the faster kept.

In process: the paired ratio against a reference computed here (hypothesis draws the rounds); the race's call order
against that ratio (a runner of fixed cost per call gives exactly the quotient of the costs, whatever the rounds);
the decision's margin; a look at the package's files on disk. Then real processes: a background compile whose
package is built in the run, timed against its JIT code and the faster kept, equal to the eager run
(tests/compiler/test_warm_start.py's background test); here, a package whose first call disagrees with the eager
step (a module global the entry's key cannot see, changed after the build) is dropped with a warning naming the
leaf, and the run goes on with its JIT code; and 2 gloo ranks race at the same calls and keep the same runner.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from functrain.compiler import race as race_mod
from functrain.distributed.spawn import free_port
from functrain.compiler.race import GONE, READY, WAIT, Race, chooses_package, paired_ratio

_times = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_times, _times), min_size=1, max_size=40))
def test_the_paired_ratio_is_the_median_of_each_rounds_package_over_jit_time(rounds):
    """Round r's two calls come in the order the race makes them (JIT first in even rounds); the ratio is the median
    of package/JIT over the rounds, computed here with numpy from the (JIT, package) pairs."""
    times = []
    for r, (jit, package) in enumerate(rounds):
        times += [jit, package] if r % 2 == 0 else [package, jit]
    expected = float(np.median([p / j for j, p in rounds]))
    assert paired_ratio(times) == pytest.approx(expected, rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(_times, _times, st.integers(min_value=1, max_value=3))
def test_the_race_calls_each_runner_in_the_order_its_ratio_reads(jit_cost, package_cost, polls):
    """A race whose JIT code takes ``jit_cost`` a call and the package ``package_cost``: whatever the rounds, the
    decided ratio is their quotient, and the race ends after ROUNDS rounds of one call on each."""
    jit, package = object(), object()
    r = Race("key", "prekey", jit, ("/nonexistent/entry", "/nonexistent/refusal"))
    looks = [r.due() for _ in range(polls * race_mod.POLL_EVERY)]
    assert looks.count(True) == polls and looks[-1]  # (every POLL_EVERY-th call looks)
    r.start(package)
    called, done = [], False
    while not done:
        cap = r.next()
        called.append(cap)
        done = r.timed(jit_cost if cap is jit else package_cost)
    assert called.count(jit) == called.count(package) == race_mod.ROUNDS
    assert r.ratio() == pytest.approx(package_cost / jit_cost, rel=1e-12)


def test_the_package_must_gain_the_margin():
    assert chooses_package(1.0 - race_mod.MARGIN) and chooses_package(0.5)
    assert not chooses_package(1.0 - race_mod.MARGIN / 2) and not chooses_package(1.0)
    with pytest.raises(ValueError, match="at least one round"):
        paired_ratio([1e-4])


def test_a_look_reads_the_entry_the_refusal_and_this_process_build(tmp_path):
    entry, refusal = tmp_path / "warm-k.json", tmp_path / "nopackage-k.json"
    r = Race("key", "k", object(), (str(entry), str(refusal)))
    assert r.look(False) == WAIT
    assert r.look(True) == GONE  # (this process's build ended without an entry)
    refusal.write_text("{}")
    assert r.look(False) == GONE
    entry.write_text("{}")
    assert r.look(True) == READY  # (the entry is there: whatever else)


PATCHED_CHILD = r"""
import json, sys, warnings, torch
import functrain as ft
cache = sys.argv[1]
SCALE = 1.0
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
apply_fn, params, buffers = ft.functionalize(model)
def loss_fn(params, buffers, batch):
    x, y = batch
    return SCALE * torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)
step = ft.train_step(loss_fn, ft.optim.sgd(1e-2))  # (an update proportional to the loss: SCALE shows)
state = step.init(params, buffers)
batches = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(3)]
cstep = ft.compile(step, cache_dir=cache, package=True, switch_at=2)
run = cstep.runner(donate=True, background=True)
c, n, eager_at = ft.tree.tree_map(torch.clone, state), 0, []
for _ in range(4):
    c, m = run(c, batches[n % 3]); n += 1
written = cstep.wait_for_packages()
SCALE = 3.0  # (what the package's key cannot see: its first call in this run is checked against the eager step)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(200):
        before = run.rates.calls["eager"]
        c, m = run(c, batches[n % 3]); n += 1
        if run.rates.calls["eager"] != before:
            eager_at.append(n - 1)
e = state
for i in range(n):  # the JIT code computes with the traced SCALE; the call whose check failed returned eager's
    SCALE = 3.0 if i in eager_at else 1.0
    e, _ = step(e, batches[i % 3])
from functrain.compiler.package import PackageCall
print(json.dumps({"written": written, "eager_at": eager_at, "runner": run.progress.runner,
                  "races": len(run.graphs.races), "dropped": cstep._warm.dropped,
                  "last_is_package": isinstance(run.last.fn, PackageCall),
                  "equal": bool(ft.tree.tree_allclose(c, e, rtol=1e-5, atol=1e-6)),
                  "warnings": [str(w.message) for w in caught if "package" in str(w.message)]}))
"""


def test_a_package_whose_first_call_disagrees_is_dropped_and_the_jit_code_goes_on(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(OMP_NUM_THREADS="1", FUNCTRAIN_CACHE_DIR=str(tmp_path / "memo"))
    proc = subprocess.run([sys.executable, "-c", PATCHED_CHILD, str(tmp_path / "cache")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["written"] == 1 and out["dropped"] == 1 and out["races"] == 0, out
    assert len(out["eager_at"]) == 1 and out["runner"] is None and not out["last_is_package"], out
    (warning,) = out["warnings"]
    assert "its first call disagrees with the eager step (state/params/" in warning, warning
    assert "this run goes on with its JIT code" in warning, warning
    assert out["equal"], out
    assert not list((tmp_path / "cache" / "packages").glob("warm-*.json"))  # (the entry is deleted)


TWO_RANKS = r"""
import json, os, sys, torch
import functrain as ft
ft.distributed.init()
rank = int(os.environ["RANK"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
apply_fn, params, buffers = ft.functionalize(model)
def loss_fn(params, buffers, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)
step = ft.data_parallel()(ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.adamw(1e-2))))
state = step.init(params, buffers)
g = torch.Generator().manual_seed(1 + rank)
batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)) for _ in range(3)]
cstep = ft.compile(step, cache_dir=sys.argv[1], package=True, switch_at=2)
run = cstep.runner(donate=True, background=True)
c, n = ft.tree.tree_map(torch.clone, state), 0
for _ in range(4):
    c, m = run(c, batches[n % 3]); n += 1
written = cstep.wait_for_packages()  # (rank 0 builds it; every rank then looks for it at the same calls)
for _ in range(200):
    c, m = run(c, batches[n % 3]); n += 1
e = state
for i in range(n):
    e, _ = step(e, batches[i % 3])
from functrain.compiler.package import PackageCall
print("RESULT " + json.dumps({"rank": rank, "written": written, "runner": run.progress.runner,
                              "ratio": run.progress.runner_ratio, "races": len(run.graphs.races),
                              "last_is_package": isinstance(run.last.fn, PackageCall),
                              "equal": bool(ft.tree.tree_allclose(c, e, rtol=1e-5, atol=1e-6))}), flush=True)
"""


def test_two_ranks_race_at_the_same_calls_and_keep_the_same_runner(tmp_path):
    """A data-parallel step on 2 gloo ranks: rank 0 builds the package, both find it at the same look, both check
    and time it, and both keep the runner the larger of their ratios chooses (its calls hold the all-reduce: a rank
    on another runner or another call would hang, bounded here by the launcher's collective timeout)."""
    script = tmp_path / "race.py"
    script.write_text(TWO_RANKS)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(OMP_NUM_THREADS="1", FUNCTRAIN_CACHE_DIR=str(tmp_path / "memo"))
    proc = subprocess.run([sys.executable, "-m", "functrain.launch", "--nproc", "2", "--master-port",
                           str(free_port()), "--dist-timeout", "120", str(script), str(tmp_path / "cache")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # (the two ranks share the pipe: a line may hold both, unbuffered print writing text and newline apart)
    out = sorted((json.loads(x) for x in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)), key=lambda r: r["rank"])
    assert [r["rank"] for r in out] == [0, 1], proc.stdout[-2000:]
    assert out[0]["written"] == 1 and out[1]["written"] == 0, out  # (one build per machine)
    assert out[0]["runner"] == out[1]["runner"] in ("package", "jit") and out[0]["ratio"] == out[1]["ratio"], out
    for r in out:
        assert r["races"] == 0 and r["equal"] and r["last_is_package"] == chooses_package(r["ratio"]), r
