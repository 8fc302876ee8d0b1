"""Inductor's CPU ISA probes run side by side, started as a compile begins, each once
(:func:`functrain.compiler.probe_memo.probe_memo`).

In a fresh interpreter (inductor's per-process caches empty), the real probe is replaced by a stand-in before the
memo wraps it: the stand-in's first probe does not end until a second one has started, which only probes run side
by side allow (one after the other, it gives up after a bounded wait and the test fails); inductor's own question
(``pick_vec_isa``) then gets the same answers without a probe running twice, and picks the ISA its own probes one
after the other pick (the stand-in fails the best candidate).
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="inductor probes several ISAs only on x86")

CHILD = r"""
import collections, json, sys, threading
from torch._inductor import cpu_vec_isa as c
candidates = [i for i in c.supported_vec_isa_list if all(f in c.x86_isa_checker() for f in str(i).split())]
ahead = sys.argv[1] == "compile"
second_started, lock = threading.Event(), threading.Lock()
runs, order, overlapped = collections.Counter(), [], []
def stand_in(self, code):
    with lock:
        runs[(str(self), self.build_arch_flags(), code)] += 1
        order.append(str(self))
        first = len(order) == 1
        if len(set(order)) >= 2:
            second_started.set()
    if first and ahead:
        overlapped.append(second_started.wait(60))
    return str(self) != str(candidates[0])  # the best candidate fails: inductor must pick the next, either way
c.VecISA.check_build = stand_in
from functrain.compiler.probe_memo import probe_memo
if sys.argv[1] == "serial":  # inductor's own probes, one after the other: the pick to compare with
    with probe_memo():
        picked = str(c.pick_vec_isa())
    print("RESULT " + json.dumps({"picked": picked, "max_runs": max(runs.values())}))
    raise SystemExit(0)
if sys.argv[1] == "load":  # a block that compiles no CPU code (a load from the caches, a GPU graph): no probes
    with probe_memo():
        pass
    print("RESULT " + json.dumps({"candidates": len(candidates), "probes": len(runs)}))
    raise SystemExit(0)
with probe_memo(ahead=True):
    picked = str(c.pick_vec_isa())
print("RESULT " + json.dumps({"candidates": len(candidates), "overlapped": overlapped, "picked": picked,
                              "best": str(candidates[0]) if candidates else None,
                              "max_runs": max(runs.values()), "probes": len(runs)}))
"""


def run_child(tmp_path, case: str) -> dict:
    env = {"FUNCTRAIN_CACHE_DIR": str(tmp_path / "memo"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", CHILD, case], env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout + out.stderr
    return json.loads(lines[-1][7:])


def test_a_block_that_compiles_no_cpu_code_starts_no_probes(tmp_path):
    r = run_child(tmp_path, "load")
    assert r["probes"] == 0, r


def test_the_probes_run_side_by_side_and_each_once(tmp_path):
    r = run_child(tmp_path, "compile")
    if r["candidates"] < 2:
        pytest.skip(f"this CPU offers inductor {r['candidates']} ISA to probe")
    assert r["overlapped"] == [True], r  # the first probe saw a second one start while it ran
    assert r["max_runs"] == 1, r  # inductor's own question did not run a probe (ISA, flags, code) again
    assert r["probes"] >= 2 and r["picked"] != r["best"], r  # (the failed best candidate was not picked)
    serial = run_child(tmp_path / "serial", "serial")
    assert r["picked"] == serial["picked"], (r, serial)  # the same ISA as inductor's own probing picks
