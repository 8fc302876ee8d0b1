"""examples/sweep.py runs end to end on a short schedule (a subprocess with a timeout): 16 members, 16 learning rates.
(One graph and no recompile for a population: tests/transforms/test_population.py.)"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def test_sweep_trains_sixteen_members_in_one_graph_and_picks_the_best():
    pytest.importorskip("sklearn")
    out = subprocess.run([sys.executable, "examples/sweep.py", "--steps", "120"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = re.findall(r"member +(\d+) +seed +(\d+) +lr ([0-9.e+-]+) +test accuracy ([0-9.]+)", out.stdout)
    assert [int(r[0]) for r in rows] == list(range(16)), out.stdout[-2000:]
    lrs = [float(r[2]) for r in rows]
    assert lrs == sorted(lrs) and len(set(lrs)) == 16           # 16 learning rates, one per member
    acc = [float(r[3]) for r in rows]
    assert "16 members x 120 steps, one compiled step" in out.stdout
    best = re.search(r"best: member (\d+) \(lr ([0-9.e+-]+)\), test accuracy ([0-9.]+)", out.stdout)
    assert best is not None and float(best.group(3)) == max(acc) and acc[int(best.group(1))] == max(acc)
    assert max(acc) > 0.9 and min(acc) < max(acc) - 0.05         # the sweep matters: the lrs train differently
