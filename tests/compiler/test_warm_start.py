"""Warm starts (issue 40): a later process runs a packaged step from its first call, without a trace
(functrain/compiler/warm.py, functrain/compiler/prekey.py).

The pre-trace key, in process (no compile): each thing that defines the graph, changed, is another key; each
value the state carries as data (learning rate, schedule constants, betas, eps, weight decay, clip bound, EMA
decay, loss-scale settings), changed, is the same key (hypothesis draws them); a memo the first calls fill does not
change it. The first-call check (:func:`functrain.compiler.warm.disagreement`) against references computed here.
Then real processes sharing a ``cache_dir``: the first compiles a package; a later one (with another learning rate
too) runs it from its first call with neither Dynamo, inductor nor sympy imported, equal to its own eager run; a
patched library function the key cannot see is caught by the first call's check (warning, eager result, a new
compile); a tampered entry is refused. Four child processes compile (~1 min on 2 cores).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functrain as ft
import functrain.testing as ftt
from functrain.compiler import prekey, warm
from functrain.compiler.race import chooses_package
from functrain.optim import schedules


def _params(width=8):
    gen = torch.Generator().manual_seed(0)
    return {"w0": torch.randn(6, width, generator=gen), "b0": torch.zeros(width),
            "w1": torch.randn(width, 3, generator=gen), "b1": torch.zeros(3)}


BATCH = (torch.randn(8, 6), torch.randn(8, 3))


def build(opt="adamw", peak=2e-2, warmup=3, total=100_000, final=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=1e-3,
          momentum=0.9, max_norm=0.5, decay=0.8, ema_start=2, growth=2.0, backoff=0.5, interval=3,
          loss=ftt.mlp_loss, accumulate=1, fp16=True):
    lr = schedules.warmup_cosine(peak, warmup, total, final=final)
    optimizer = {"adamw": lambda: ft.optim.adamw(lr, betas=betas, eps=eps, weight_decay=wd),
                 "sgd": lambda: ft.optim.sgd(lr, momentum=momentum, weight_decay=wd),
                 "lion": lambda: ft.optim.lion(lr, betas=betas, weight_decay=wd)}[opt]()
    step = ft.clip(max_norm)(ft.train_step(loss, optimizer))
    if fp16:
        step = ft.mixed_precision("fp16", growth_factor=growth, backoff_factor=backoff, growth_interval=interval)(step)
    step = ft.ema(decay, start_step=ema_start)(step)
    return ft.accumulate(accumulate)(step) if accumulate > 1 else step


def key(step, params=None, batch=BATCH, memory="owned", structure=None):
    state = step.init(_params() if params is None else params)
    starts = warm.WarmStarts(None, structure or {"cuda_graphs": False})
    return starts.key(step, memory, state._replace(rng=None), batch)


# -- the key: data is not structure ----------------------------------------------------------------------
DATA = {"peak": st.floats(1e-5, 1.0), "warmup": st.integers(0, 5000), "total": st.integers(5001, 10**6),
        "final": st.floats(0.0, 1e-5), "betas": st.tuples(st.floats(0.0, 0.99), st.floats(0.0, 0.9999)),
        "eps": st.floats(1e-12, 1e-3), "wd": st.floats(1e-6, 0.5), "momentum": st.floats(0.01, 0.99),
        "max_norm": st.floats(1e-3, 100.0), "decay": st.floats(0.5, 0.9999), "ema_start": st.integers(0, 10**5),
        "growth": st.floats(1.0, 4.0), "backoff": st.floats(0.01, 0.99), "interval": st.integers(1, 10**5)}


@settings(max_examples=40, deadline=None)
@given(opt=st.sampled_from(["adamw", "sgd", "lion"]), values=st.fixed_dictionaries({}, optional=DATA))
def test_every_value_the_state_holds_as_data_keeps_the_key(opt, values):
    """A run with another learning rate, schedule, betas, eps, decay, clip bound, EMA or loss-scale setting loads
    the same warm entry (the graph reads them as inputs: tests/transforms/test_hyper_as_data.py)."""
    assert key(build(opt, **values)) == key(build(opt))


def test_a_memo_the_first_calls_fill_keeps_the_key():
    step = build()
    before = key(step)
    state = step.init(_params())
    step(state, BATCH)
    assert key(step) == before


scale = 1.0  # a global the loss reads (test_each_thing...: "a global's value")


def _scaled_loss(params, buffers, batch):
    return ftt.mlp_loss(params, buffers, batch) * scale


def _helper(x):
    return x.tanh()


def _loss_with_helper(params, buffers, batch):
    x, y = batch
    return ((_helper(x @ params["w0"] + params["b0"]) @ params["w1"] + params["b1"] - y) ** 2).mean()


class Net(torch.nn.Module):
    def __init__(self, gain=1.0):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)
        self.gain = gain

    def forward(self, x):
        return self.lin(x) * self.gain


def _module_step(net):
    apply_fn, params, buffers = ft.functionalize(net)

    def loss(p, b, batch):
        return ((apply_fn(p, b, batch[0]) - batch[1]) ** 2).mean()
    return ft.train_step(loss, ft.optim.adamw(1e-3)), params, buffers


def _module_key(net):
    step, params, buffers = _module_step(net)
    state = step.init(params, buffers)
    return warm.WarmStarts(None, {"cuda_graphs": False}).key(step, "owned", state._replace(rng=None), BATCH)


def test_each_thing_that_defines_the_graph_changes_the_key(monkeypatch):
    """One miss per ingredient: the loss's code, a function it calls, a closure's value, a global's value, a
    module's class code, a module's non-tensor attribute, a submodule, the state's shapes and dtypes, the batch's
    shapes and dtypes, a transform's structural setting, which transforms, a structural optimizer setting (a
    weight decay of 0), the memory kind, the compile options, the torch build, functrain's source, the machine."""
    global scale
    base = key(build(loss=_scaled_loss))
    misses = {}
    scale = 3.0
    misses["a global's value"] = key(build(loss=_scaled_loss))
    scale = 1.0
    assert key(build(loss=_scaled_loss)) == base

    def loss_code(params, buffers, batch):
        return ftt.mlp_loss(params, buffers, batch) * 2.0
    misses["the loss's code"] = key(build(loss=loss_code))

    def closure(factor):
        return lambda p, b, batch: ftt.mlp_loss(p, b, batch) * factor
    assert key(build(loss=closure(2.0))) == key(build(loss=closure(2.0)))
    misses["a closure's value"] = key(build(loss=closure(3.0)))
    with_helper = key(build(loss=_loss_with_helper))
    monkeypatch.setitem(globals(), "_helper", lambda x: x.sigmoid())
    misses["the code of a function the loss calls"] = key(build(loss=_loss_with_helper))
    assert misses["the code of a function the loss calls"] != with_helper

    net = Net()
    module_base = _module_key(net)
    assert _module_key(Net()) == module_base  # (other parameter values: the same graph)
    monkeypatch.setattr(Net, "forward", lambda self, x: self.lin(x).relu() * self.gain)
    misses["a module class's code"] = _module_key(Net())
    monkeypatch.undo()
    assert _module_key(Net()) == module_base
    misses["a module's non-tensor attribute"] = _module_key(Net(gain=2.0))
    deeper = Net()
    deeper.extra = torch.nn.ReLU()
    misses["a submodule"] = _module_key(deeper)

    misses["the state's shapes"] = key(build(loss=_scaled_loss), params=_params(width=9))
    misses["the state's dtypes"] = key(build(loss=_scaled_loss, fp16=False),
                                       params={k: v.double() for k, v in _params().items()})
    misses["the batch's shapes"] = key(build(loss=_scaled_loss), batch=(torch.randn(4, 6), torch.randn(4, 3)))
    misses["the batch's dtypes"] = key(build(loss=_scaled_loss), batch=(BATCH[0].double(), BATCH[1]))
    misses["a transform's structural setting"] = key(build(loss=_scaled_loss, accumulate=2))
    misses["which transforms"] = key(build(loss=_scaled_loss, fp16=False))
    assert misses["which transforms"] != misses["the state's dtypes"]
    misses["a weight decay of 0 (structure)"] = key(build(loss=_scaled_loss, wd=0.0))
    misses["the memory kind"] = key(build(loss=_scaled_loss), memory="fresh")
    misses["the compile options"] = key(build(loss=_scaled_loss), structure={"cuda_graphs": True})
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "-other")
    misses["the torch build"] = key(build(loss=_scaled_loss))
    monkeypatch.undo()
    monkeypatch.setattr(prekey, "_functrain_source", lambda: "another functrain")
    misses["functrain's source"] = key(build(loss=_scaled_loss))
    monkeypatch.undo()
    monkeypatch.setattr(prekey, "machine", lambda: {"host": "another machine"})
    misses["the machine"] = key(build(loss=_scaled_loss))
    monkeypatch.undo()
    assert key(build(loss=_scaled_loss)) == base
    same = [what for what, k in misses.items() if k == base or k is None]
    assert not same, f"these changes kept the key: {same}"
    assert len(set(misses.values())) == len(misses), "two different changes made one key"


# -- the first call's check ---------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 64), lr=st.floats(1e-3, 1.0), rel=st.floats(0.0, 5e-4), seed=st.integers(0, 2**31 - 1))
def test_the_check_accepts_rounding_and_names_a_different_update(n, lr, rel, seed):
    """Within the tolerance of eager's change it agrees; a change off by more than it (a stale graph whose update
    is another) is named by the leaf's path. The references are computed here."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=gen)
    update = torch.randn(n, generator=gen)
    eager = old - lr * update
    noise = torch.randn(n, generator=gen)
    close = eager + rel * lr * update.norm() * noise / max(float(noise.norm()), 1e-12)
    assert warm.disagreement([old, None], [eager, torch.tensor(1.5)], [close, torch.tensor(1.5)],
                             ["state/w", "metrics/loss"]) is None
    stale = old - 1.5 * lr * update  # another update (a changed loss scale, say): past the tolerance
    why = warm.disagreement([old], [eager], [stale], ["state/w"])
    assert why is not None and why.startswith("state/w")
    assert "metrics/loss" in warm.disagreement([None], [torch.tensor(1.5)], [torch.tensor(1.6)], ["metrics/loss"])
    assert "state/count" in warm.disagreement([torch.tensor(1)], [torch.tensor(2)], [torch.tensor(3)],
                                              ["state/count"])


# -- real processes ---------------------------------------------------------------------------------------
CHILD = r"""
import json, sys, time, warnings
t0 = time.perf_counter()
import torch
import functrain as ft
cache, lr, patch = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "patch"
if patch:  # what a key cannot see: a library function changed in this process
    _mse = torch.nn.functional.mse_loss
    torch.nn.functional.mse_loss = lambda a, b, *r, **k: _mse(a, b, *r, **k) * 2
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
apply_fn, params, buffers = ft.functionalize(model)
def loss_fn(params, buffers, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)
step = ft.ema(0.99)(ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.adamw(lr))))
state = step.init(params, buffers)
batches = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(3)]
cstep = ft.compile(step, cache_dir=cache, package=True)
run = cstep.runner(donate=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    t = time.perf_counter()
    c, m = run(ft.tree.tree_map(torch.clone, state), batches[0])
    first = time.perf_counter() - t
    imported = sorted(x for x in ("torch._dynamo", "torch._inductor", "sympy") if x in sys.modules)
    for b in batches[1:]:
        c, m = run(c, b)
    imported_after = sorted(x for x in ("torch._dynamo", "torch._inductor", "sympy") if x in sys.modules)
e = state
for b in batches:
    e, _ = step(e, b)
print(json.dumps({"imported": imported, "imported_after": imported_after, "first_s": round(first, 4),
                  "warm": cstep._warm.loaded, "dropped": cstep._warm.dropped, "built": cstep._packages.built,
                  "loaded": cstep._packages.loaded, "source": run.progress.source, "phase": run.progress.phase,
                  "equal": bool(ft.tree.tree_allclose(c, e, rtol=1e-5, atol=1e-6)),
                  "warnings": [str(w.message) for w in caught if "package" in str(w.message)]}))
"""


def _run(tmp_path, lr=1e-2, patch=False):
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(OMP_NUM_THREADS="1", FUNCTRAIN_CACHE_DIR=str(tmp_path / "memo"))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "cache"), str(lr),
                             "patch" if patch else "-"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"child timed out:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _entries(tmp_path):
    return sorted((tmp_path / "cache" / "packages").glob("warm-*.json"))


def test_a_later_run_is_compiled_from_its_first_call_without_the_compiler(tmp_path):
    """The first process compiles the package and writes the warm entry; a later one, and one with another
    learning rate, run the package from their first call (checked against the eager step), import none of
    Dynamo, inductor or sympy, and equal their own eager runs. A patched library function is caught by the first
    call's check: a warning names it, the entry is dropped, the run compiles anew and is right. A tampered entry
    is refused with a warning and the run is right."""
    first = _run(tmp_path)
    assert first["built"] == 1 and first["warm"] == 0 and first["equal"], first
    assert len(_entries(tmp_path)) == 1
    for lr in (1e-2, 3e-2):
        later = _run(tmp_path, lr=lr)
        assert later["warm"] == 1 and later["built"] == 0 and later["loaded"] == 0, later
        assert later["imported"] == [] and later["imported_after"] == [], later
        assert later["source"] == "warm" and later["phase"] == "compiled" and later["equal"], later
        assert not later["warnings"], later
        print(f"lr {lr}: first call {later['first_s']} s (eager step + package load + compiled call)")
    patched = _run(tmp_path, patch=True)
    assert patched["warm"] == 1 and patched["dropped"] == 1 and patched["built"] == 1 and patched["equal"], patched
    assert any("disagrees with the eager step" in w and "metrics/" in w for w in patched["warnings"]), patched
    # the entry now names the patched graph's package: the next plain run is caught the same way, and right
    healed = _run(tmp_path)
    assert healed["dropped"] == 1 and healed["loaded"] == 1 and healed["equal"], healed
    again = _run(tmp_path)
    assert again["warm"] == 1 and again["imported_after"] == [] and again["equal"], again
    (entry,) = _entries(tmp_path)
    data = json.loads(entry.read_text())
    data["plan"] = data["plan"].replace('"random": true', '"random": false')
    entry.write_text(json.dumps(data))
    tampered = _run(tmp_path)
    assert tampered["warm"] == 0 and tampered["equal"], tampered
    assert any("not signed with this user's package key" in w for w in tampered["warnings"]), tampered


BACKGROUND_CHILD = r"""
import json, sys, torch
import functrain as ft
cache, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
apply_fn, params, buffers = ft.functionalize(model)
def loss_fn(params, buffers, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(apply_fn(params, buffers, x), y)
step = ft.ema(0.99)(ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.adamw(1e-2))))
state = step.init(params, buffers)
batches = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(3)]
# the first run's switch waits for its background compile at call 2 (a deterministic switch); a later run's
# runner starts warm when it can (a switch_at turns warm starts off)
cstep = ft.compile(step, cache_dir=cache, package=True, **({"switch_at": 2} if mode == "first" else {}))
run = cstep.runner(donate=True, background=True)
c = ft.tree.tree_map(torch.clone, state)
for i in range(6):
    c, m = run(c, batches[i % 3])
imported = sorted(x for x in ("torch._dynamo", "torch._inductor", "sympy") if x in sys.modules)
written = cstep.wait_for_packages()
n = 6
if mode == "first":  # the package is there within the run: timed against the JIT code, the faster kept (race.py)
    for n in range(6, 200):
        c, m = run(c, batches[n % 3])
    n += 1
e = state
for i in range(n):
    e, _ = step(e, batches[i % 3])
from functrain.compiler.package import PackageCall
from functrain.trainer.compiling import RunClock
clock, host = RunClock(run, compiled=True, start=n), {}
clock.tick(n + 1)
clock.fields(n + 1, host)  # (what the Trainer records and says of this runner)
print(json.dumps({"source": run.progress.source, "phase": run.progress.phase, "written": written,
                  "host": {k: v for k, v in host.items() if k.startswith("compile_runner")}, "notes": clock.notes(),
                  "warm": cstep._warm.loaded, "built": cstep._packages.built, "imported": imported,
                  "runner": run.progress.runner, "ratio": run.progress.runner_ratio, "races": len(run.graphs.races),
                  "last_is_package": isinstance(run.last.fn, PackageCall),
                  "equal": bool(ft.tree.tree_allclose(c, e, rtol=1e-5, atol=1e-6))}))
"""


def test_a_background_compile_leaves_a_package_for_the_next_run(tmp_path):
    """A run that compiles in the background (its steps never wait for a package) installs the worker's code;
    then another worker builds the graph's package and its warm entry (functrain/compiler/later.py), and the next
    run is compiled from its first call without a trace or the compiler's imports, equal to its eager run."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(OMP_NUM_THREADS="1", FUNCTRAIN_CACHE_DIR=str(tmp_path / "memo"))

    def child(mode):
        proc = subprocess.run([sys.executable, "-c", BACKGROUND_CHILD, str(tmp_path / "cache"), mode], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = child("first")
    assert first["source"] == "worker" and first["phase"] == "compiled" and first["equal"], first
    assert first["written"] == 1 and first["built"] == 0, first  # (built by the worker)
    assert first["warm"] == 1, first  # (loaded once, by the race below, not before any trace)
    # the package, written within the run, was timed against the JIT code: the faster serves the rest of it
    assert first["runner"] in ("package", "jit") and 0 < first["ratio"] < 10 and first["races"] == 0, first
    assert first["last_is_package"] == (first["runner"] == "package") == chooses_package(first["ratio"]), first
    assert first["host"] == {"compile_runner": first["runner"], "compile_runner_ratio": round(first["ratio"], 4)}
    said = [x for x in first["notes"] if x.startswith("the package built in this run took ")]
    assert said == [f"the package built in this run took {first['ratio']:.2f}x the JIT code's time per call: " +
                    ("it served the rest of the run" if first["runner"] == "package" else
                     "the JIT code stayed (the package must take at most 0.98 of its time)")], first["notes"]
    assert len(_entries(tmp_path)) == 1 and len(list((tmp_path / "cache" / "packages").glob("*.pt2"))) == 1
    later = child("later")
    assert later["source"] == "warm" and later["warm"] == 1 and later["imported"] == [], later
    assert later["written"] == 0 and later["equal"], later  # (its entry is there: nothing built again)
    assert later["runner"] is None and later["last_is_package"], later  # (one runner from its first call: no race)


def test_a_graph_that_cannot_be_packaged_is_said_once_and_not_built_again(tmp_path, monkeypatch):
    """The package worker's build of a graph Packages refuses (here: a non-tensor attribute, which the package's
    key cannot cover) writes the refusal with the reason beside the entries; PackageLater then starts no build
    for that key (nor for a key whose entry exists), so a later run does not spend a worker on it again."""
    from functrain.compiler import later as later_mod, worker
    from functrain.compiler.package import Packages
    from functrain.compiler.settings import WorkerSettings

    monkeypatch.setenv("FUNCTRAIN_CACHE_DIR", str(tmp_path / "memo"))
    folder = tmp_path / "cache"
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    w = graph.get_attr("weight")
    graph.output([graph.call_function(torch.ops.aten.mul.Tensor, (x, w))])
    root = torch.nn.Module()
    root.weight = torch.ones(3)
    gm = torch.fx.GraphModule(root, graph)
    metas = (((3,), (1,), torch.float32, torch.device("cpu")),)
    answer = worker._package(gm, metas, {"folder": str(folder), "prekey": "k1", "plan": {}, "lock_timeout": 5.0})
    assert answer["ok"] is False and "non-tensor attributes" in answer["error"], answer
    starts = warm.WarmStarts(Packages(str(folder)), {})
    refusal = json.loads(open(starts.refusal("k1")).read())
    assert "non-tensor attributes" in refusal["why"], refusal
    assert not os.path.exists(starts.path("k1"))
    later = later_mod.PackageLater(str(folder), WorkerSettings.from_env())
    assert not later.start(gm, metas, "k1", {}, (starts.path("k1"), starts.refusal("k1")))
    open(starts.path("k2"), "w").close()
    assert not later.start(gm, metas, "k2", {}, (starts.path("k2"), starts.refusal("k2")))
    assert later.started == 0 and later.poll() == 0
