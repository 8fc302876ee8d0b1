"""Where a cold compile's seconds go, by phase, in CPU seconds: W1, a 2-layer Llama, the main job's precompile.

    python bench/compile_phases.py                          # W1, llama2, mainjob; each a fresh process, cold caches
    python bench/compile_phases.py --what W1 --memo         # W1 with the machine's probe memo (a second compile)
    python bench/compile_phases.py --what W1 --opts '{"cpp_wrapper": true}'  # inductor options to try (JSON)

Each configuration runs in a new process with an empty ``TORCHINDUCTOR_CACHE_DIR`` and (unless ``--memo``) an
empty probe memo (``FUNCTRAIN_CACHE_DIR``) and temp folder (``TMPDIR``, where inductor keeps its precompiled
header): a compile on a new machine. ``--memo`` runs once cold to fill the memo and the precompiled header, then
measures a new graph with them (a machine that has compiled before). Inductor's ``compile_threads`` is 1 by default here (``--threads`` to change): every C++
translation unit is then built by a child of the measured process, so ``resource.getrusage(RUSAGE_CHILDREN)``
counts the compiler's CPU seconds, which a loaded machine changes least (other agents share its 2 cores).

The phases, each in CPU seconds of the process plus its waited-for children (wall seconds beside):

* ``import_torch``, ``import_functrain``, ``import_inductor`` (``torch._inductor.compile_fx``: what a first compile
  imports);
* ``trace``: functrain's ``make_fx`` of the step (``Graphs.trace``: the compile's own, not a second one);
* ``isa_probe``: inductor's CPU vector-ISA probes (``VecISA.check_build``: builds and loads a test program each);
* ``aot_autograd``, ``inductor`` (passes, lowering, scheduling, codegen), ``kernels`` (loading the generated
  module, which builds its C++ kernels), from torch's own timers (:mod:`functrain.bench.phases`); ``inductor`` is
  split further into ``pre/joint/post-grad passes``, ``lowering`` (``GraphLowering.run``) and ``codegen``;
* ``cxx``: every C++ translation unit built (``CppBuilder.build``; the ISA probes' apart): count, CPU seconds
  (the compiler's, from ``RUSAGE_CHILDREN``), and each one's;
* the kernels: how many C++ kernels the generated code asks for, how many distinct sources (inductor builds each
  distinct source once), and how many of those are the same kernel at another offset or size (equal once their
  integer literals are blanked).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, re, resource, sys, time
what, repo, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime

marks = []
def mark(name):
    own, kids = cpu()
    marks.append((name, time.perf_counter(), own, kids))

mark("start")
import torch
mark("import_torch")
import functrain as ft
mark("import_functrain")
import torch._inductor.compile_fx  # noqa: F401 - what a first compile imports
import torch._inductor.config as ic
mark("import_inductor")
torch.set_num_threads(1)
for k, v in opts.items():
    obj = ic
    *path, last = k.split(".")
    for p in path:
        obj = getattr(obj, p)
    setattr(obj, last, v)
sys.path.insert(0, repo)

from torch._inductor import cpu_vec_isa, cpp_builder, async_compile
probe = {"n": 0, "cpu": 0.0, "wall": 0.0}
in_probe = [False]
orig_check = cpu_vec_isa.VecISA.check_build
def check_build(self, code):
    o, k = cpu(); t = time.perf_counter(); in_probe[0] = True
    try:
        return orig_check(self, code)
    finally:
        in_probe[0] = False
        o2, k2 = cpu()
        probe["n"] += 1; probe["cpu"] += (o2 - o) + (k2 - k); probe["wall"] += time.perf_counter() - t
cpu_vec_isa.VecISA.check_build = check_build

tus = []
def unit_kernels(text):
    # the C++ kernels defined in one unit (a C++ wrapper's: kernels and the code calling them), each with its own
    # name blanked, into ``sources`` (what the per-kernel count below reads)
    for part in re.split(r'(?=extern "C"[^\n(]*\bvoid\s+cpp_fused_)', text)[1:]:
        if part.find("{") < 0 or part.find(";") < part.find("{"):
            continue  # a declaration (the unit declares every kernel before the code that calls them)
        end = re.search(r"^}", part, re.M)
        body = part[:end.end()] if end else part
        sources.append(re.sub(r"\bcpp_fused_\w+", "KERNEL", body, count=1))
orig_build = cpp_builder.CppBuilder.build
def build(self):
    o, k = cpu(); t = time.perf_counter()
    try:
        return orig_build(self)
    finally:
        o2, k2 = cpu()
        if not in_probe[0]:
            cmd = self.get_command_line()
            for src in cmd.split():  # a C++ wrapper's unit holds the graph's kernels: count them there
                if src.endswith(".cpp") and "TORCH_INDUCTOR_CPP_WRAPPER" in cmd and os.path.exists(src):
                    with open(src) as f:
                        unit_kernels(f.read())
            tus.append({"cxx_cpu": k2 - k, "own_cpu": o2 - o, "wall": time.perf_counter() - t,
                        "cmd": cmd if len(tus) == 0 else None})
cpp_builder.CppBuilder.build = build

sources = []
orig_pyb = async_compile.AsyncCompile.cpp_pybinding
def cpp_pybinding(self, argtypes, source_code):
    sources.append(source_code)
    return orig_pyb(self, argtypes, source_code)
async_compile.AsyncCompile.cpp_pybinding = cpp_pybinding
orig_cpp = async_compile.AsyncCompile.cpp
def cpp_(self, source_code):
    sources.append(source_code)
    return orig_cpp(self, source_code)
async_compile.AsyncCompile.cpp = cpp_

from functrain.bench.phases import snapshot
from functrain.compiler import runtime
trace_t = {"cpu": 0.0, "wall": 0.0}
orig_trace = runtime.Graphs.trace
def trace(self, *a, **k):
    o, kk = cpu(); t = time.perf_counter()
    try:
        return orig_trace(self, *a, **k)
    finally:
        o2, k2 = cpu(); trace_t["cpu"] += (o2 - o) + (k2 - kk); trace_t["wall"] += time.perf_counter() - t
runtime.Graphs.trace = trace

import torch._dynamo.utils as du
timed = {}
def wrap_timer(owner, name, key):
    fn = getattr(owner, name)
    def w(*a, **k):
        o, kk = cpu(); t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            o2, k2 = cpu(); d = timed.setdefault(key, [0.0, 0.0])
            d[0] += (o2 - o) + (k2 - kk); d[1] += time.perf_counter() - t
    setattr(owner, name, w)

before = snapshot()
if what == "W1":
    from bench.workloads import WORKLOADS, build as wbuild, functrain_step
    wl = wbuild(WORKLOADS["W1"], torch.device("cpu"))
    step, params, buffers = functrain_step(wl)
    state = step.init(params, buffers)
    batch = wl.batches[0]
elif what == "llama2":
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    apply_fn, params, buffers = ft.functionalize(model)
    def loss_fn(p, b, ids):
        return apply_fn(p, b, input_ids=ids, labels=ids).loss
    step = ft.train_step(loss_fn, ft.optim.adamw(1e-3))
    state = step.init(params, buffers)
    batch = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
elif what == "unet":  # denoising-diffusion-pytorch's small Unet (issue 41's anchor): batch 32 x accumulate(2)
    from denoising_diffusion_pytorch import GaussianDiffusion, Unet
    torch.manual_seed(0)
    diffusion = GaussianDiffusion(Unet(dim=16, dim_mults=(1, 2), channels=1, flash_attn=False), image_size=16,
                                  timesteps=100)
    apply_fn, params, buffers = ft.functionalize(diffusion)
    def loss_fn(p, b, images):
        return apply_fn(p, b, images)
    step = ft.ema(0.995)(ft.accumulate(2)(ft.train_step(loss_fn, ft.optim.adam(1e-4, betas=(0.9, 0.99)))))
    state = step.init(params, buffers)
    batch = torch.rand(64, 1, 16, 16, generator=torch.Generator().manual_seed(1))
mark("build")
before = snapshot()
t0 = time.perf_counter(); o0, k0 = cpu()
if what == "mainjob":
    import runpy
    sys.argv = [os.path.join(repo, "examples", "diffusion.py"), "--precompile", "--results",
                os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "results")]
    mark("build")
    t0 = time.perf_counter(); o0, k0 = cpu()
    runpy.run_path(sys.argv[0], run_name="__main__")
else:
    cstep = ft.compile(step)
    s, m = cstep(state, batch)
    float(m["loss"])
mark("first_call")
o1, k1 = cpu()
after = snapshot()
first = {"wall": time.perf_counter() - t0, "cpu": (o1 - o0) + (k1 - k0)}
from torch._dynamo.utils import compilation_time_metrics as ctm
times = {n: after["times"].get(n, 0.0) - before["times"].get(n, 0.0) for n in after["times"]}
norm = [re.sub(r"\b\d+\b", "N", s) for s in sources]
print("RESULT " + json.dumps({
    "marks": marks, "first": first, "trace": trace_t, "probe": probe, "tus": tus, "torch_times": times,
    "cache": {k: after["cache"].get(k, 0) - before["cache"].get(k, 0) for k in after["cache"]},
    "kernels": len(sources), "distinct": len(set(sources)), "distinct_modulo_constants": len(set(norm)),
    "source_lines": [s.count("\n") for s in set(sources)],
    "compile_threads": ic.compile_threads, "opts": opts}))
"""

INDUCTOR_KEYS = {  # torch's timer names (compilation_time_metrics) -> a sub-phase of "inductor"
    "pre_grad_passes": ("_recursive_pre_grad_passes",),
    "joint_graph_passes": ("_recursive_joint_graph_passes",),
    "post_grad_passes": ("_recursive_post_grad_passes",),
    "lowering": ("GraphLowering.run",),
    "codegen": ("GraphLowering.codegen", "GraphLowering.compile_to_module.codegen"),
}


def run_one(what: str, root: str, opts: dict, threads: int, memo: str, timeout: float) -> dict:
    """One cold compile of ``what`` in a new process: an empty inductor cache; ``memo``: the "machine's" folder,
    holding functrain's probe memo and the temp folder (``TMPDIR``: inductor keeps its precompiled headers in
    ``<tmp>/torchinductor_<user>/precompiled_headers`` whatever ``TORCHINDUCTOR_CACHE_DIR`` says)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cache = tempfile.mkdtemp(prefix=f"phases-{what}-", dir=root)
    tmp = os.path.join(memo, "tmp")
    os.makedirs(tmp, exist_ok=True)
    # the machine keeps its probe memo and precompiled header, not the packages an earlier run of the same graph
    # left: with them this run would be a warm start (no compile at all), not a cold compile
    shutil.rmtree(os.path.join(memo, "packages"), ignore_errors=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1", "FUNCTRAIN_CACHE_DIR": memo,
           "TMPDIR": tmp,
           "TORCHINDUCTOR_COMPILE_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    load0 = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-c", CHILD, what, repo, json.dumps(opts)], env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=repo)  # (-c puts the cwd first on sys.path)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{what} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    r = json.loads(lines[-1][7:])
    r["what"], r["load"] = what, (load0, os.getloadavg()[0])
    return r


def table(r: dict) -> dict:
    """The phase table of one run: ``{phase: (cpu_s, wall_s)}`` and the counts."""
    marks = r["marks"]
    rows = {}
    for (_, t0, o0, k0), (name, t1, o1, k1) in zip(marks, marks[1:]):
        if name.startswith("import"):
            rows[name] = ((o1 - o0) + (k1 - k0), t1 - t0)
    tt = r["torch_times"]

    def spent(*names: str) -> float:
        return sum(tt.get(n, 0.0) for n in names)
    backend = spent("compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler")
    load = spent("PyCodeCache.load_by_key_path")
    aot = max(0.0, spent("create_aot_dispatcher_function") - backend)
    tu_cpu = sum(t["cxx_cpu"] + t["own_cpu"] for t in r["tus"])
    tu_wall = sum(t["wall"] for t in r["tus"])
    rows["trace"] = (r["trace"]["cpu"], r["trace"]["wall"])
    rows["isa_probe"] = (r["probe"]["cpu"], r["probe"]["wall"])
    rows["aot_autograd (wall)"] = (None, aot)
    sub = {k: spent(*v) for k, v in INDUCTOR_KEYS.items()}
    for k, v in sub.items():
        rows[f"  inductor {k} (wall)"] = (None, v)
    rows["inductor total less kernels (wall)"] = (None, max(0.0, backend - load))
    rows[f"C++ translation units ({len(r['tus'])})"] = (tu_cpu, tu_wall)
    rows["kernels: module load incl. C++ (wall)"] = (None, load)
    rows["first call (ft.compile + 1 step)"] = (r["first"]["cpu"], r["first"]["wall"])
    return rows


def show(r: dict) -> None:
    print(f"\n### {r['what']}  opts {r['opts']}  compile_threads {r['compile_threads']}  load "
          f"{r['load'][0]:.1f}-{r['load'][1]:.1f}")
    print("| phase | CPU s | wall s |\n|---|---|---|")
    for k, (c, w) in table(r).items():
        print(f"| {k} | {'' if c is None else f'{c:.2f}'} | {w:.2f} |")
    proc = sum(v[0] for k, v in table(r).items() if k.startswith("import")) + r["first"]["cpu"]
    print(f"| **process start to first step, CPU** | **{proc:.2f}** | |")
    cxx = sorted((t["cxx_cpu"] for t in r["tus"]), reverse=True)
    print(f"kernels asked for {r['kernels']}, distinct sources {r['distinct']}, distinct modulo integer "
          f"constants {r['distinct_modulo_constants']}; C++ units {len(r['tus'])}, compiler CPU s each: "
          + ", ".join(f"{x:.2f}" for x in cxx[:12]) + (" ..." if len(cxx) > 12 else ""))
    print(f"cache counts {r['cache']}")
    first_cmd = next((t["cmd"] for t in r["tus"] if t["cmd"]), None)
    if first_cmd:
        print(f"first unit's command: {first_cmd[:600]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", default="W1,llama2,mainjob")
    p.add_argument("--opts", default="{}", help="inductor config to set (JSON; dotted keys for sub-configs)")
    p.add_argument("--threads", type=int, default=1, help="inductor compile_threads (default 1: see above)")
    p.add_argument("--memo", action="store_true", help="measure with the probe memo of a first cold run")
    p.add_argument("--machine", default=None,
                   help="a folder kept across runs as the machine's probe memo and temp folder (precompiled header): "
                        "empty, the first compile is a new machine's; then each later one is a new graph on it")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--out-json", default=None)
    p.add_argument("--keep", action="store_true", help="keep the inductor caches (the generated code) and say where")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="ft-phases-")
    rows = []
    try:
        for what in [w.strip() for w in args.what.split(",") if w.strip()]:
            memo = args.machine or tempfile.mkdtemp(prefix="memo-", dir=root)
            os.makedirs(memo, mode=0o700, exist_ok=True)
            if args.memo:
                run_one(what, root, json.loads(args.opts), args.threads, memo, args.timeout)
            r = run_one(what, root, json.loads(args.opts), args.threads, memo, args.timeout)
            r["memo"] = args.memo or bool(args.machine)
            show(r)
            rows.append(r)
            sys.stdout.flush()
    finally:
        if args.keep:
            print(f"kept the inductor caches (generated code) in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
