"""A damaged compile cache entry is rebuilt, not kept.

Before: one damaged kernel source in inductor's cache (inductor finds the ``.cpp`` on disk, keyed by its
intended content, and builds it as it is) made every later run's background compile fail with
``CppCompileError``, for good, and the warning did not say what to do. Now the compile is retried once with
the file moved aside (``<name>.damaged``), the warning names it; a second failure names the folder to delete.
Each run is a process of its own, with a cache folder of its own.
"""
import glob
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

_SCRIPT = """
import sys, time, warnings, torch, functrain as ft
warnings.simplefilter("always")
step = ft.train_step(lambda p, b, x: ((p["w"] * x).tanh().sum() - 1) ** 2, ft.optim.adamw(0.1))
state = step.init({"w": torch.ones(64)})
mode = sys.argv[1]
if mode == "poisoned":  # every kernel source inductor writes is damaged: the retry fails too
    import torch._inductor.config
    torch._inductor.config.compile_threads = 1  # (built in this process, where the damage is patched in)
    import torch._inductor.codecache as cc
    real = cc.write
    def write(content, extension, *args, **kwargs):
        if str(extension).endswith("cpp"):
            content = "this is not C++;\\n" + content
        return real(content, extension, *args, **kwargs)
    cc.write = write
c = ft.compile(step, background=mode == "background")
if mode != "background":
    try:
        c(state, torch.ones(64))
        print("PHASE compiled", flush=True)
    except Exception as e:
        print("RAISED", type(e).__name__, str(e).replace(chr(10), " "), flush=True)
    raise SystemExit(0)
deadline = time.monotonic() + 600
while c.progress is None or c.progress.phase not in ("compiled", "failed"):
    state, _ = c(state, torch.ones(64))
    assert time.monotonic() < deadline, c.progress
print("PHASE", c.progress.phase, c.progress.reason, flush=True)
"""


def _run(tmp_path, mode):
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "FUNCTRAIN_COMPILE_FINISH": "0"}
    out = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _damage_a_kernel_source(tmp_path) -> str:
    """Damage the kernel source of the cache, and drop what was built from it (the built library and the graph
    entries that point to it), so that the next compile builds the source as it finds it on disk."""
    sources = glob.glob(str(tmp_path / "inductor" / "*" / "*.cpp"))
    assert sources, os.listdir(tmp_path / "inductor")
    with open(sources[0], "r+b") as f:
        text = f.read()
        f.seek(0)
        f.write(b"@" + text[1:])  # the first byte flipped to one no C++ file starts with
    for built in glob.glob(str(tmp_path / "inductor" / "*" / "*.so")):
        os.remove(built)
    for folder in ("fxgraph", "aotautograd"):
        subprocess.run(["rm", "-rf", str(tmp_path / "inductor" / folder)], check=True, timeout=60)
    return sources[0]


def test_a_damaged_kernel_source_is_moved_aside_rebuilt_and_named(tmp_path):
    first = _run(tmp_path, "background")
    assert "PHASE compiled None" in first.stdout, first.stdout[-2000:] + first.stderr[-3000:]
    damaged = _damage_a_kernel_source(tmp_path)
    again = _run(tmp_path, "background")
    assert "PHASE compiled None" in again.stdout, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"a damaged compile cache file was moved aside and rebuilt: {damaged}" in again.stderr, again.stderr[-3000:]
    assert os.path.exists(damaged + ".damaged") and os.path.exists(damaged)
    with open(damaged, "rb") as f:
        assert not f.read().startswith(b"@")  # written afresh
    third = _run(tmp_path, "background")  # and the next run is served as usual: nothing to say
    assert "PHASE compiled None" in third.stdout and "moved aside" not in third.stderr, third.stderr[-3000:]


def test_a_compile_that_fails_again_after_the_retry_names_the_folder_to_delete(tmp_path):
    out = _run(tmp_path, "poisoned")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith(("RAISED", "PHASE")))
    assert line.startswith("RAISED CacheDamaged"), out.stdout[-2000:] + out.stderr[-3000:]
    assert f"delete the compile cache folder {tmp_path / 'inductor'}" in line, line
    assert ".cpp" in line and "moved aside (renamed *.damaged)" in line, line
