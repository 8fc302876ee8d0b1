"""ft.compile's compile reuse (functrain/compiler/cache.py): the cache folder, the per-graph lock, the probe memo.

Real processes share a ``cache_dir``: two started together compile the graph once (the other
waits on the lock and loads it), a later one loads it, a changed loss misses and is right.
The probe memo is tested against inductor's real ISA probe. Each child process compiles
(seconds to tens of seconds here): eight in all, ~2 min on 2 cores.
"""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from functrain.compiler import cache as compile_cache
from functrain.compiler import graph_lock, probe_memo

# what both child scripts start with: a tiny MLP step whose loss is scaled by argv[1]
SETUP = r"""
import torch
import functrain as ft
torch.manual_seed(0)
scale, cache = float(sys.argv[1]), sys.argv[2]
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
apply_fn, params, buffers = ft.functionalize(model)
def loss_fn(params, buffers, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y) * scale
step = ft.train_step(loss_fn, ft.optim.adamw(1e-2))
"""

CHILD = r"""
import json, sys, time
""" + SETUP + r"""from torch._dynamo.utils import counters
batch = (torch.randn(8, 6), torch.randn(8, 1))
state = step.init(params, buffers)
cstep = ft.compile(step, cache_dir=cache)
t = time.perf_counter()
got, _ = cstep(state, batch)
first = time.perf_counter() - t
want, _ = step(state, batch)
print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "bypass": counters["inductor"]["fxgraph_cache_bypass"], "first_call_s": round(first, 3),
                  "folder": cstep.cache_dir, "equal": bool(ft.tree.tree_allclose(got, want, rtol=1e-5, atol=1e-6))}))
"""


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    return {**env, "OMP_NUM_THREADS": "1", "FUNCTRAIN_CACHE_DIR": str(tmp_path / "memo")}


def _start(tmp_path, scale):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(scale), str(tmp_path / "cache")], env=_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc):
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"child compile timed out:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_ranks_starting_together_compile_once_then_later_processes_load(tmp_path):
    """Two processes started together on one cache folder: exactly one compiles (misses inductor's
    FX-graph cache), the other waits on the graph's lock and loads its entry. A third process loads
    too; a fourth with a changed loss (same shapes, x*3 instead of x*1) is not served the first
    one's graph: it misses and equals its eager step."""
    a, b = _start(tmp_path, 1.0), _start(tmp_path, 1.0)
    ra, rb = _result(a), _result(b)
    assert ra["equal"] and rb["equal"], (ra, rb)
    assert ra["bypass"] == rb["bypass"] == 0, (ra, rb)
    assert sorted([ra["miss"], rb["miss"]]) == [0, 1], (ra, rb)
    assert sorted([ra["hit"], rb["hit"]]) == [0, 1], (ra, rb)
    assert ra["folder"] == rb["folder"] == str(tmp_path / "cache" / "inductor")
    assert os.listdir(tmp_path / "cache" / "inductor" / "functrain-locks")
    third = _result(_start(tmp_path, 1.0))
    assert third["hit"] == 1 and third["miss"] == 0 and third["equal"], third
    print(f"first call: {max(ra['first_call_s'], rb['first_call_s'])} s cold / {third['first_call_s']} s loaded")
    changed = _result(_start(tmp_path, 3.0))
    assert changed["miss"] == 1 and changed["hit"] == 0 and changed["equal"], changed
    # the memo of inductor's CPU probes was written by the first process (on x86 CPUs with a vector ISA)
    memo = tmp_path / "memo" / "vec_isa_probes.json"
    if memo.exists():
        assert json.loads(memo.read_text())["format"] == 1


# -- the folder ---------------------------------------------------------------------------------
def test_a_folder_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ValueError, match="writable by everyone"):
        compile_cache.check_private_folder(str(shared))
    with pytest.raises(TypeError, match="folder path"):
        compile_cache.use_cache_dir(3)
    made = compile_cache.check_private_folder(str(tmp_path / "new" / "folder"))
    assert os.stat(made).st_mode & 0o777 == 0o700


def test_the_folder_is_process_wide_a_second_one_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "_active", None)
    monkeypatch.setattr(compile_cache, "_inductor_compiled", lambda: False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    first = compile_cache.use_cache_dir(tmp_path / "one")
    assert first == str(tmp_path / "one" / "inductor") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    with pytest.warns(UserWarning, match="process-wide"):
        again = compile_cache.use_cache_dir(str(tmp_path / "two"))
    assert again == first == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_cache.use_cache_dir(tmp_path / "one") == first  # the same folder again: silent


def test_the_lock_timeout_must_be_a_number(monkeypatch):
    from functrain.compiler.settings import WorkerSettings

    monkeypatch.setenv("FUNCTRAIN_COMPILE_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FUNCTRAIN_COMPILE_LOCK_TIMEOUT.*'soon'"):
        WorkerSettings.from_env()


def test_a_held_lock_is_waited_for_then_compiled_through_with_a_warning(tmp_path, monkeypatch):
    """Bounded: another process holding the graph's lock past the timeout -> compile here, with a warning."""
    monkeypatch.setattr(compile_cache, "_inductor_dir", lambda: str(tmp_path))
    os.makedirs(tmp_path / "functrain-locks", mode=0o700)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(tmp_path / 'functrain-locks' / 'k.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(30)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.warns(UserWarning, match="compiling it here too"):
            with graph_lock.compile_lock("k", 0.3) as held:
                assert held is False
    finally:
        holder.kill()
        holder.wait(10)
    with graph_lock.compile_lock("k", 0.3) as held:  # released by the holder's exit: taken at once
        assert held is True


def test_a_lock_this_process_holds_is_not_waited_for(tmp_path, monkeypatch):
    """A background job of a graph that outlived its runner holds the graph's lock in this process; a compile of
    the same graph on the training thread waited for it its whole timeout (600 s; two Trainer tests of the same toy
    model deadlocked the full suite): a flock on a second open file of the lock waits even in the same process."""
    monkeypatch.setattr(compile_cache, "_inductor_dir", lambda: str(tmp_path))
    os.makedirs(tmp_path / "functrain-locks", mode=0o700)
    job = graph_lock.GraphLock("k")  # as SharedJob holds it while its worker compiles
    assert job.acquire() and graph_lock.held_here("k")
    assert not job.held_elsewhere()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "compiling it here too": no wait at all
        with graph_lock.compile_lock("k", 600.0) as held:
            assert held is False
    job.close()
    assert not graph_lock.held_here("k")
    with graph_lock.compile_lock("k", 0.3) as held:
        assert held is True


# -- the probe memo -------------------------------------------------------------------------------
def _isa():
    import platform
    if platform.machine() not in ("x86_64", "AMD64") or not torch.cpu._is_avx2_supported():
        pytest.skip("no AVX2 CPU: no ISA probe to memoize")
    return pytest.importorskip("torch._inductor.cpu_vec_isa")


def test_a_passed_probe_is_not_run_again_and_a_corrupt_memo_is_rebuilt(tmp_path, monkeypatch):
    cvi = _isa()
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path / "memo"))
    real = cvi.VecISA.check_build
    calls = []

    def counted(self, code):
        calls.append(str(self))
        return real(self, code)

    monkeypatch.setattr(cvi.VecISA, "check_build", counted)
    (tmp_path / "memo").mkdir(mode=0o700)
    memo = tmp_path / "memo" / "vec_isa_probes.json"
    memo.write_text("{not json")
    isa = cvi.VecAVX2()
    with pytest.warns(UserWarning, match="unreadable probe memo"):
        with probe_memo.probe_memo():
            assert cvi.VecISA.check_build(isa, cvi.VecISA._avx_code) is True
    assert calls == [str(isa)], "the probe did not run"
    assert cvi.VecISA.check_build is counted, "the memo was left in place after the compile"
    assert len(json.loads(memo.read_text())["passed"]) == 1
    with probe_memo.probe_memo():
        assert cvi.VecISA.check_build(isa, cvi.VecISA._avx_code) is True
        assert cvi.VecISA.check_build(isa, cvi.VecISA._avx_code + "\n// other code") is True
    assert calls == [str(isa)] * 2, "a memoized probe ran again, or a different probe did not run"
    # a memo from another machine / compiler / torch build has other keys: it is probed again
    memo.write_text(json.dumps({"format": 1, "passed": ["0" * 64]}))
    with probe_memo.probe_memo():
        assert cvi.VecISA.check_build(isa, cvi.VecISA._avx_code) is True
    assert len(calls) == 3


def test_a_failed_probe_is_not_remembered(tmp_path, monkeypatch):
    cvi = _isa()
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path / "memo"))
    calls = []
    monkeypatch.setattr(cvi.VecISA, "check_build", lambda self, code: calls.append(1) is not None)
    for _ in range(2):
        with probe_memo.probe_memo():
            assert cvi.VecISA.check_build(cvi.VecAVX2(), "int x;") is False
    assert len(calls) == 2
    assert not (tmp_path / "memo" / "vec_isa_probes.json").exists()


# -- packages (ahead-of-time compiled steps a later process loads) ---------------------------------
PACKAGE_CHILD = r"""
import json, sys, time, warnings
""" + SETUP + r"""batches = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(3)]
state = step.init(params, buffers)
cstep = ft.compile(step, cache_dir=cache, package=True)
run = cstep.runner(donate=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    t = time.perf_counter()
    c, _ = run(ft.tree.tree_map(torch.clone, state), batches[0])
    first = time.perf_counter() - t
    for b in batches[1:]:
        c, _ = run(c, b)
e = state
for b in batches:
    e, _ = step(e, b)
print(json.dumps({"built": cstep._packages.built, "loaded": cstep._packages.loaded, "warm": cstep._warm.loaded,
                  "compiles": cstep.compiles,
                  "first_call_s": round(first, 3), "equal": bool(ft.tree.tree_allclose(c, e, rtol=1e-5, atol=1e-6)),
                  "warnings": [str(w.message) for w in caught if "package" in str(w.message)]}))
"""


def _package_run(tmp_path, scale):
    proc = subprocess.Popen([sys.executable, "-c", PACKAGE_CHILD, str(scale), str(tmp_path / "cache")],
                            env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _result(proc)


def test_a_package_is_loaded_by_a_later_process_and_rebuilt_when_corrupt_or_for_other_code(tmp_path):
    """The first process builds the package; the second loads it (no compile; before any trace, from its warm
    entry: tests/compiler/test_warm_start.py) and is right; a corrupted package is rebuilt with a warning, never
    loaded; a changed loss builds its own."""
    first = _package_run(tmp_path, 1.0)
    assert first["built"] == 1 and first["loaded"] == 0 and first["compiles"] == 1 and first["equal"], first
    packages = tmp_path / "cache" / "packages"
    (pt2,) = [p for p in packages.iterdir() if p.suffix == ".pt2"]
    second = _package_run(tmp_path, 1.0)
    assert second["warm"] == 1 and second["built"] == 0 and second["equal"] and not second["warnings"], second
    print(f"first call: {first['first_call_s']} s building / {second['first_call_s']} s loading the package")
    pt2.write_bytes(pt2.read_bytes()[: pt2.stat().st_size // 2])  # a torn / tampered file
    third = _package_run(tmp_path, 1.0)
    assert third["built"] == 1 and third["loaded"] == 0 and third["warm"] == 0 and third["equal"], third
    assert any("not loading" in w and "checksum" in w for w in third["warnings"]), third
    changed = _package_run(tmp_path, 3.0)
    assert changed["built"] == 1 and changed["loaded"] == 0 and changed["equal"], changed
    assert len([p for p in packages.iterdir() if p.suffix == ".pt2"]) == 2


def test_packages_without_a_cache_dir_live_in_functrain_private_folder_and_need_the_direct_capture(tmp_path,
                                                                                                   monkeypatch):
    import functrain as ft
    from functrain.compiler import trust
    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path / "private"))
    step = ft.train_step(lambda p, b, x: (p["w"] * x).sum(), ft.optim.sgd(0.1))
    cstep = ft.compile(step, package=True)
    assert cstep._packages.folder == os.path.join(trust.private_home(), "packages")
    assert cstep._packages.folder.startswith(str(tmp_path / "private")) and cstep.cache_dir is None
    with pytest.raises(ValueError, match="direct capture"):
        ft.compile(step, package=True, capture="dynamo")
