"""ft.Trainer on 2 real processes resumes every rank from the same checkpoint, or none.

One flipped byte in rank 1's shard of the newest sharded checkpoint: both ranks resume from the older
checkpoint, rank 0 names the skipped one with rank 1 and the file, and the run ends bitwise equal to an
uninterrupted run resumed from that older checkpoint. A damaged shard in the only checkpoint: both ranks refuse
with the same error (none starts afresh, none resumes). Every subprocess runs with a timeout.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import functrain as ft
from functrain import tree as T

sys.path.insert(0, os.path.dirname(__file__))
from test_trainer import _cmd, _env, _final  # noqa: E402  (the trainer job's runner: same env, same timeouts)

ARGS = ("--no-compile", "--save-every", 2, "--shard", "optimizer")


def _job(results, *args, timeout=300):
    return subprocess.run(_cmd(results, 2, *map(str, args), *map(str, ARGS)), env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def _flip(path):
    """Flip the last 4 bytes of a file (tensor data: its block checksum no longer matches)."""
    with open(path, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        tail = f.read(4)
        f.seek(-4, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))


def _losses(results):
    return [(r["step"], r["loss"]) for r in map(json.loads, open(os.path.join(results, "metrics.jsonl")))]


def test_a_damaged_shard_of_the_newest_checkpoint_makes_both_ranks_resume_from_the_older_one(tmp_path):
    damaged, reference = tmp_path / "damaged", tmp_path / "reference"
    out = _job(damaged, "--steps", 6)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    manager = ft.CheckpointManager(damaged / "checkpoints")
    assert manager.steps() == [2, 4, 6]
    shutil.copytree(damaged, reference)
    shutil.rmtree(ft.CheckpointManager(reference / "checkpoints").path(6))  # as if killed right after step 4
    victim = os.path.join(manager.path(6), "rank_00001", "tensors.safetensors")
    _flip(victim)

    out = _job(damaged, "--steps", 8)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ref = _job(reference, "--steps", 8)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    both = out.stdout + out.stderr
    assert f"resumed from {manager.path(4)} at step 4" in out.stdout, both[-3000:]
    # rank 0 names the skipped checkpoint once, with rank 1 and the damaged file
    skips = re.findall(r"skipping checkpoint (\S+): (.*)", both)
    assert len(skips) == 1, both[-3000:]
    assert skips[0][0] == manager.path(6) + ":" or skips[0][0] == manager.path(6), skips
    assert "rank 1:" in skips[0][1] and victim in skips[0][1], skips
    assert sorted(re.findall(r"DONE step=(\d+) rank=(\d+)", out.stdout)) == [("8", "0"), ("8", "1")], out.stdout
    # every rank trained from step 4: the whole state (both shards) equals the run resumed from step 4, bitwise
    assert T.tree_equal(_final(damaged, 8), _final(reference, 8)), "the ranks did not resume from one state"
    assert _losses(damaged) == _losses(reference)


def test_a_damaged_shard_in_the_only_checkpoint_makes_both_ranks_refuse(tmp_path):
    """Decided: both refuse (as one process does when no checkpoint loads), with the same error on each rank,
    naming rank 1 and the file; neither starts afresh, so no step of a fresh run overwrites anything."""
    results = tmp_path / "run"
    out = _job(results, "--steps", 2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    manager = ft.CheckpointManager(results / "checkpoints")
    victim = os.path.join(manager.path(2), "rank_00001", "tensors.safetensors")
    _flip(victim)
    out = _job(results, "--steps", 4, timeout=240)
    both = out.stdout + out.stderr
    assert out.returncode != 0, both[-3000:]
    assert "resumed from" not in out.stdout and "DONE" not in out.stdout, both[-3000:]
    # the launcher reports a rank's own error: the CheckpointError naming rank 1's damaged file
    assert "CheckpointError" in both and "rank 1:" in both and victim in both, both[-3000:]
    assert manager.steps() == [2], "a rank trained and saved"
