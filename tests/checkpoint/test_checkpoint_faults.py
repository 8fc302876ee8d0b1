"""Checkpoints under faults: a full disk, a file-size limit, concurrent writers, stale locks, damaged newest
checkpoints, non-finite states in rotation, structure mismatches. Real processes, real limits, a real tmpfs."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from functrain import checkpoint as ck
from functrain.core.tree import tree_equal

pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(code, *args, timeout=120, prefix=()):
    script = "import sys; sys.path.insert(0, %r)\n" % ROOT + textwrap.dedent(code)
    return subprocess.run([*prefix, sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})


# ------------------------------------------------------------------------------------------ 6. no room
FSIZE = """
    import json, resource, signal, sys, torch
    from functrain import checkpoint as ck
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # so that a write past the limit fails with EFBIG
    mgr = ck.CheckpointManager(sys.argv[1], keep=3)
    mgr.save(1, {"w": torch.ones(1000)})
    nbytes = 250_000 * 4
    out = {}
    for case, limit in (("before", nbytes // 2), ("during", nbytes + 16)):  # during: only the header is over
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            mgr.save(2, {"w": torch.zeros(250_000)})
            out[case] = None
        except OSError as e:
            out[case] = [type(e).__name__, e.errno, str(e), getattr(e, "needed", None), getattr(e, "free", None)]
    print(json.dumps(out))
"""


def test_a_file_size_limit_names_the_checkpoint_and_the_sizes(tmp_path):
    out = _child(FSIZE, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    path = str(tmp_path / "step_00000002")
    for case in ("before", "during"):
        name, code, msg, needed, limit = res[case]
        assert name == "CheckpointSpaceError" and code == 27, res[case]  # EFBIG
        assert path in msg and str(needed) in msg and str(limit) in msg and "RLIMIT_FSIZE" in msg, msg
        assert needed >= 1_000_000
    assert res["before"][4] == 500_000 and res["during"][4] == 1_000_016
    mgr = ck.CheckpointManager(tmp_path)
    assert mgr.steps() == [1] and sorted(os.listdir(tmp_path)) == ["step_00000001"]  # no trace, the old one intact
    assert tree_equal(ck.load(mgr.path(1)), {"w": torch.ones(1000)})


TMPFS = """
    import json, os, sys, torch
    from functrain import checkpoint as ck
    folder = sys.argv[1]
    mgr = ck.CheckpointManager(folder, keep=3)
    mgr.save(1, {"w": torch.ones(1000)})
    out = {}
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    # before: more than the free space; during: the data fit, the page-rounded files do not
    for case, n in (("before", free // 4 + 1000), ("during", (free - 2048) // 4)):
        try:
            mgr.save(2, {"w": torch.zeros(n)})
            out[case] = None
        except OSError as e:
            out[case] = [type(e).__name__, e.errno, str(e), e.needed, e.free]
    out["listing"] = sorted(os.listdir(folder))
    out["loads"] = bool(torch.equal(ck.load(mgr.path(1))["w"], torch.ones(1000)))
    print(json.dumps(out))
"""


def test_a_full_disk_names_the_checkpoint_and_the_sizes(tmp_path):
    """A 2 MiB tmpfs, mounted in a private mount namespace (skipped where that is not allowed)."""
    unshare = shutil.which("unshare")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    probe = subprocess.run([unshare or "unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=2m tmpfs {mnt}"],
                           capture_output=True) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (unshare -rm)")
    code = "import subprocess, sys\n" + \
        f"subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=2m', 'tmpfs', {str(mnt)!r}], check=True)\n" + \
        textwrap.dedent(TMPFS)
    out = _child(code, mnt / "run", prefix=(unshare, "-rm"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    path = str(mnt / "run" / "step_00000002")
    for case in ("before", "during"):
        name, code_, msg, needed, free = res[case]
        assert name == "CheckpointSpaceError" and code_ == 28, res[case]  # ENOSPC
        assert path in msg and f"needs {needed} bytes" in msg and f"{free} bytes" in msg and "free" in msg, msg
    assert res["before"][3] > res["before"][4]  # refused before writing: it needs more than is free
    assert res["listing"] == ["step_00000001"] and res["loads"]


# ------------------------------------------------------------------------------------------ 3. writers and locks
HOLDER = """
    import sys, time
    from functrain import checkpoint as ck
    lock = ck.FolderLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(120)
"""


def test_a_folder_lock_names_its_holder_and_is_taken_over_after_sigkill(tmp_path):
    script = "import sys; sys.path.insert(0, %r)\n" % ROOT + textwrap.dedent(HOLDER)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(ck.FolderLocked, match=rf"{tmp_path} is in use by process {proc.pid} on host") as e:
            ck.FolderLock(tmp_path).acquire()
        assert e.value.holder["pid"] == proc.pid and e.value.folder == str(tmp_path)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with ck.FolderLock(tmp_path) as lock:  # the dead holder's lock is taken over, no cleanup needed
        assert lock.held and lock.holder()["pid"] == os.getpid()
        with pytest.raises(ck.FolderLocked):
            ck.FolderLock(tmp_path).acquire()  # a second holder, even in the same process
    assert ck.FolderLock(tmp_path).acquire().held


SLOW_WRITER = """
    import os, sys, time, torch
    from functrain import checkpoint as ck
    folder = sys.argv[1]
    real = ck.folder.write_tensors

    def slow(path, *args, **kwargs):
        out = real(path, *args, **kwargs)
        open(os.path.join(folder, "writing"), "w").close()
        time.sleep(3)   # mid-save: the temporary folder exists, full
        return out

    ck.folder.write_tensors = slow
    ck.CheckpointManager(folder, keep=5).save(1, {"w": torch.ones(100)})
    print("saved", flush=True)
"""


def test_a_save_never_tidies_another_writers_temporary_folder(tmp_path):
    script = "import sys; sys.path.insert(0, %r)\n" % ROOT + textwrap.dedent(SLOW_WRITER)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "writing").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.02)
        assert any(e.startswith(".step_00000001.tmp-") for e in os.listdir(tmp_path))
        ck.CheckpointManager(tmp_path, keep=5).save(2, {"w": torch.zeros(100)})  # tidies: must skip the live one
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.strip() == "saved", err[-3000:]
    mgr = ck.CheckpointManager(tmp_path)
    assert mgr.steps() == [1, 2]
    assert tree_equal(ck.load(mgr.path(1)), {"w": torch.ones(100)})
    # what a dead writer left is still tidied
    os.mkdir(tmp_path / ".step_00000003.tmp-0123456789ab")
    mgr.save(4, {"w": torch.zeros(1)})
    assert not any(e.startswith(".step_00000003") for e in os.listdir(tmp_path))


# ------------------------------------------------------------------------------------------ 5. fallback
def test_a_truncated_newest_checkpoint_is_skipped_with_a_warning(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep=3)
    for s in (1, 2, 3):
        mgr.save(s, {"w": torch.full((1000,), float(s))})
    for s in (2, 3):
        f = os.path.join(mgr.path(s), ck.TENSORS)
        os.truncate(f, os.path.getsize(f) - 100)
    with pytest.warns(RuntimeWarning) as caught:
        r = mgr.load_latest()
    assert r.step == 1 and tree_equal(r.state, {"w": torch.ones(1000)})
    messages = [str(w.message) for w in caught]
    for s in (3, 2):  # each skipped one, named, with why, and what was loaded instead
        assert any(mgr.path(s) in m and "truncated" in m and mgr.path(1) in m for m in messages), messages
    with pytest.raises(ck.CheckpointError, match="truncated"):
        mgr.load_latest(fallback=False)
    f = os.path.join(mgr.path(1), ck.TENSORS)
    os.truncate(f, 10)
    with pytest.warns(RuntimeWarning), pytest.raises(ck.CheckpointError, match="no checkpoint .* loads"):
        mgr.load_latest()


def test_a_structure_mismatch_names_every_path_and_is_never_a_fallback(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep=3)
    saved = {"params": {"w": torch.ones(3), "b": torch.zeros(2)}, "slots": {"ema": torch.ones(3)}}
    mgr.save(1, saved)
    mgr.save(2, saved)
    template = {"params": {"w": torch.ones(4), "b": torch.zeros(2, dtype=torch.float64)},
                "slots": {"skip_nonfinite": torch.zeros(())}}
    with pytest.raises(ck.StructureMismatch) as e:
        mgr.load_latest(template=template)
    assert e.value.path == mgr.path(2)
    where = [p for p, _ in e.value.differences]
    assert where == ["params/w", "params/b", "slots"], e.value.differences
    assert "only in the checkpoint ['ema'], only in the template ['skip_nonfinite']" in str(e.value)
    with pytest.raises(ck.StructureMismatch, match=r"at 'params/w'.*\(3,\).*\(4,\)"):
        ck.check_structure(mgr.path(1), template)


# ------------------------------------------------------------------------------------------ 1. finite marks
def test_rotation_never_removes_the_newest_finite_checkpoint(tmp_path):
    mgr = ck.CheckpointManager(tmp_path, keep=2)
    good = {"w": torch.ones(3)}
    bad = {"w": torch.full((3,), float("nan"))}
    mgr.save(1, good, finite=True)
    mgr.save(2, good, finite=True)
    for s in (3, 4, 5):
        mgr.save(s, bad, finite=False)
    assert mgr.steps() == [2, 4, 5] and mgr.newest_finite() == 2  # keep 2, plus the newest finite
    mgr.save(6, good, finite=True)
    assert mgr.steps() == [5, 6] and mgr.newest_finite() == 6
    mgr.save(7, good)  # unmarked: counted as finite, as before marks existed
    assert mgr.steps() == [6, 7]
    with pytest.raises(TypeError, match="finite"):
        mgr.save(8, good, finite=1)
