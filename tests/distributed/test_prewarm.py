"""Ranks that import torch while the launcher does (functrain/distributed/prewarm.py), with real launches.

A rank of ``python -m functrain.launch`` is a process that imported torch before the agent handed it its command
(it says it ran in a waiting process), has its rank's environment, writes to the output files the agent
gave it (``--redirects``), is a child of the launcher (it dies with it) and ends with the script's status; with
``FUNCTRAIN_LAUNCH_PREWARM=0`` each rank is a new process, as before. Waiting processes never used exit when
told (their socket closed), whatever the launch did.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from functrain.distributed.cli import _WORKER, _boot_code, _prewarm_code
from functrain.distributed.prewarm import Prewarmed
from functrain.distributed.spawn import free_port

SCRIPT = r"""
import sys
import json, os
early = sys.modules["functrain.distributed.prewarm"].served  # (it ran in a waiting process)
print("RANK-LINE " + json.dumps({"early": early, "rank": int(os.environ["RANK"]), "ppid": os.getppid(),
                                 "world": int(os.environ["WORLD_SIZE"]), "argv": sys.argv[1:],
                                 "mine": os.environ.get("MY_SETTING")}), flush=True)
sys.exit(int(sys.argv[1]))
"""


def _launch(tmp_path, *extra, status=0, prewarm=True):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, MY_SETTING="kept")
    env["FUNCTRAIN_LAUNCH_PREWARM"] = "1" if prewarm else "0"
    proc = subprocess.Popen([sys.executable, "-m", "functrain.launch", "--nproc", "2", "--master-port",
                             str(free_port()), *extra, str(script), str(status)], env=env, cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    # (the ranks share the pipe: a line may hold both, unbuffered print writing text and newline apart)
    lines = [json.loads(x) for x in re.findall(r"RANK-LINE (\{[^{}]*\})", out)]
    return proc, sorted(lines, key=lambda r: r["rank"]), err


def test_each_rank_starts_with_torch_imported_and_its_own_environment(tmp_path):
    proc, ranks, err = _launch(tmp_path)
    assert proc.returncode == 0, err[-2000:]
    assert [r["rank"] for r in ranks] == [0, 1], ranks
    for r in ranks:
        assert r["early"] and r["world"] == 2 and r["argv"] == ["0"] and r["mine"] == "kept", r
        assert r["ppid"] == proc.pid, r  # (the launcher's child: it dies with it)


def test_without_prewarming_each_rank_imports_torch_itself(tmp_path):
    proc, ranks, err = _launch(tmp_path, prewarm=False)
    assert proc.returncode == 0, err[-2000:]
    assert [r["early"] for r in ranks] == [False, False], ranks


def test_a_prewarmed_rank_writes_to_its_redirected_files_and_ends_with_its_status(tmp_path):
    logs = tmp_path / "logs"
    proc, ranks, err = _launch(tmp_path, "--log-dir", str(logs), "--redirects", "3")
    assert proc.returncode == 0, err[-2000:]
    assert ranks == []  # (their output went to the files, not the launcher's)
    written = [json.loads(x) for path in logs.rglob("stdout.log")
               for x in re.findall(r"RANK-LINE (\{[^{}]*\})", path.read_text())]
    assert sorted(r["rank"] for r in written) == [0, 1] and all(r["early"] for r in written), written
    (tmp_path / "failing").mkdir()
    failed, _, err = _launch(tmp_path / "failing", status=3)  # (a rank's status is the launcher's, as before)
    assert failed.returncode == 3, err[-2000:]


def test_waiting_processes_never_used_exit_when_told(tmp_path):
    command = [sys.executable, "-u", "-c", _boot_code(), _WORKER]
    waiting = Prewarmed(2, command, _prewarm_code())
    procs = [p for p, _ in waiting.waiting]
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert waiting.take(("python", "other"), {}, None, None) is None  # (not the worker command: a new process)
    waiting.close()
    assert [p.returncode for p in procs] == [0, 0]  # (exited by themselves on the closed socket, not killed)
