"""Checkpoint save/load time: ``ft.save`` / ``ft.load`` against ``torch.save`` / ``torch.load`` of the same tensors.

    python bench/checkpoint.py                     # ~100M float32 params, 7 rounds (~2 min)
    python bench/checkpoint.py --state adam        # the same params + AdamW moments in a TrainState (3x the bytes)
    python bench/checkpoint.py --device cuda       # the state on the GPU (both sides copy it to the host)

The state is a GPT-like set of tensors (an embedding, blocks of attention/MLP
matrices, biases and LayerNorm vectors; ~100M parameters, ~400 MB in float32).
``--state params`` saves ``{"params": ...}``; ``--state adam`` saves the full
``TrainState`` of ``ft.train_step(..., ft.optim.adamw(...)).init(params)``
(params, both moments, counters, RNG state). The baseline saves the same tensor
leaves as one ``{path: tensor}`` dict with ``torch.save`` and reads it with
``torch.load`` (``weights_only=True``, its default).

Measured, interleaved in each round (the order rotates from round to round):

* save, durable: ``ft.save(path, state)`` (fsyncs its files, its folder and the parent)
  against ``torch.save`` + ``os.fsync`` of the file and the folder (the same durability);
* save, no fsync: ``ft.save(path, state, fsync=False)`` against bare ``torch.save``;
* load, new process: each load in a fresh Python process that times only the call
  (what resuming a run costs): ``ft.load(path)`` (verifies every checksum; tensors of
  1 MiB or more are copy-on-write mappings of the file, as with
  ``safetensors.torch.load_file``) and ``ft.load(path, mmap=False)`` (every tensor
  copied into memory of its own, verified) against ``torch.load`` (copies, verifies nothing);
* load, same process: the same with ``template=state``, timed in this process (where
  ``torch.load`` reuses the memory its previous call freed).

All loads read files that were just written, so from the page cache. Before each
timed save the previous outputs are deleted and ``os.sync()`` flushes dirty pages
(not timed), so every save starts from a quiet disk. Prints the median and min
per call and the ratio of medians; ``--json`` writes them to a file.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def build_state(kind: str, device: str, scale: float = 1.0):
    import torch

    import functrain as ft

    g = torch.Generator().manual_seed(0)
    d, vocab, layers = 1024, 16384, max(1, round(7 * scale))

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(device)

    params = {"embed.weight": rand(vocab, d)}
    for i in range(layers):
        p = f"blocks.{i}."
        params.update({
            p + "ln1.weight": torch.ones(d, device=device), p + "ln1.bias": torch.zeros(d, device=device),
            p + "attn.qkv.weight": rand(3 * d, d), p + "attn.qkv.bias": rand(3 * d),
            p + "attn.proj.weight": rand(d, d), p + "attn.proj.bias": rand(d),
            p + "ln2.weight": torch.ones(d, device=device), p + "ln2.bias": torch.zeros(d, device=device),
            p + "mlp.fc.weight": rand(4 * d, d), p + "mlp.fc.bias": rand(4 * d),
            p + "mlp.out.weight": rand(d, 4 * d), p + "mlp.out.bias": rand(d),
        })
    params["ln_f.weight"] = torch.ones(d, device=device)
    if kind == "params":
        return {"params": params}
    step = ft.train_step(lambda p, b, x: sum(v.sum() for v in p.values()), ft.optim.adamw(1e-3))
    state = step.init(params, seed=0)
    # non-zero moments, as after training
    return state.replace(opt_state=state.opt_state._replace(
        count=state.opt_state.count + 1000,
        exp_avg={k: rand(*v.shape) for k, v in params.items()},
        exp_avg_sq={k: rand(*v.shape).abs() for k, v in params.items()}))


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


LOAD_ONCE = """
import sys, time
sys.path.insert(0, {root!r})
import torch
from functrain import checkpoint as ck
which, path, device = sys.argv[1], sys.argv[2], sys.argv[3]
t = time.perf_counter()
if which == "torch.load":
    out = torch.load(path, map_location=device)
else:
    out = ck.load(path, device=device, mmap=which == "ft.load")
if device.startswith("cuda"):
    torch.cuda.synchronize()
print(time.perf_counter() - t)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state", choices=("params", "adam"), default="params")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--scale", type=float, default=1.0, help="number of blocks x this (1.0: ~100M params)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder, removed at the end)")
    p.add_argument("--checksum", default="crc32", choices=("crc32", "sha256"))
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args()
    root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root_dir)

    import optree
    import torch

    from functrain import checkpoint as ck  # ft.save / ft.load
    from functrain.core.tree import tree_equal

    state = build_state(args.state, args.device, args.scale)
    leaves = optree.tree_leaves(state)
    paths = ["/".join(map(str, q)) for q in optree.tree_paths(state)]
    flat = dict(zip(paths, leaves))
    n_params = sum(t.numel() for t in optree.tree_leaves(state.params if hasattr(state, "params") else state["params"]))
    n_bytes = sum(t.numel() * t.element_size() for t in leaves)

    root = args.dir or tempfile.mkdtemp(prefix="ft-bench-ckpt-")
    os.makedirs(root, exist_ok=True)
    ft_path, pt_path = os.path.join(root, "ft_ckpt"), os.path.join(root, "torch_ckpt.pt")

    def clear():
        shutil.rmtree(ft_path, ignore_errors=True)
        if os.path.exists(pt_path):
            os.remove(pt_path)

    def torch_save_sync():
        torch.save(flat, pt_path)
        fsync_path(pt_path)
        fsync_path(root)

    def sync_dev():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def fresh(which: str, path: str):
        def run():
            out = subprocess.run([sys.executable, "-c", LOAD_ONCE.format(root=root_dir), which, path, args.device],
                                 check=True, capture_output=True, text=True)
            return float(out.stdout.split()[-1])
        return run

    saves = {
        "ft.save": lambda: ck.save(ft_path, state, checksum=args.checksum),
        "torch.save+fsync": torch_save_sync,
        "ft.save(fsync=False)": lambda: ck.save(ft_path, state, checksum=args.checksum, fsync=False),
        "torch.save": lambda: torch.save(flat, pt_path),
    }
    loads = {  # timed in this process
        "ft.load": lambda: ck.load(ft_path, template=state),
        "ft.load(mmap=False)": lambda: ck.load(ft_path, template=state, mmap=False),
        "torch.load": lambda: torch.load(pt_path, map_location=args.device),
    }
    fresh_loads = {  # each in a new process that times only the call: what resuming a run costs
        "ft.load [new process]": fresh("ft.load", ft_path),
        "ft.load(mmap=False) [new process]": fresh("ft.load(mmap=False)", ft_path),
        "torch.load [new process]": fresh("torch.load", pt_path),
    }
    times: dict[str, list[float]] = {k: [] for k in [*saves, *loads, *fresh_loads]}

    # correctness once, outside the timing
    clear()
    ck.save(ft_path, state, checksum=args.checksum)
    assert tree_equal(ck.load(ft_path, template=state), state), "ft.load(ft.save(state)) != state"
    assert tree_equal(ck.load(ft_path, template=state, mmap=False), state), "ft.load(ft.save(state)) != state"

    def rotated(names: list, r: int) -> list:
        return names[r % len(names):] + names[:r % len(names)]

    for r in range(args.rounds):
        for name in rotated(list(saves), r):
            clear()
            os.sync()
            sync_dev()
            t = time.perf_counter()
            saves[name]()
            sync_dev()
            times[name].append(time.perf_counter() - t)
        # both files exist now (the last ft and torch saves of this round); time the loads
        if not os.path.isdir(ft_path):
            ck.save(ft_path, state, checksum=args.checksum)
        if not os.path.exists(pt_path):
            torch.save(flat, pt_path)
        os.sync()
        for name in rotated(list(loads), r):
            t = time.perf_counter()
            out = loads[name]()
            sync_dev()
            times[name].append(time.perf_counter() - t)
            del out
        for name in rotated(list(fresh_loads), r):
            times[name].append(fresh_loads[name]())
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()),
              flush=True)
    clear()
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    pairs = [("save (durable)", "ft.save", "torch.save+fsync"),
             ("save (no fsync)", "ft.save(fsync=False)", "torch.save"),
             ("load, new process", "ft.load [new process]", "torch.load [new process]"),
             ("  copying", "ft.load(mmap=False) [new process]", "torch.load [new process]"),
             ("load, same process", "ft.load", "torch.load"),
             ("  copying", "ft.load(mmap=False)", "torch.load")]
    print(f"\nstate: {args.state}, {n_params / 1e6:.1f}M params, {len(leaves)} tensors, {n_bytes / 1e6:.0f} MB, "
          f"device {args.device}, checksum {args.checksum}, {args.rounds} rounds, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'':20}{'functrain':>34}{'median':>8}{'min':>7}   {'torch':>24}{'median':>8}{'min':>7}   ratio")
    rows = []
    for label, a, b in pairs:
        ratio = med[a] / med[b]
        rows.append({"what": label.strip(), "functrain": a, "torch": b, "functrain_s": med[a], "torch_s": med[b],
                     "ratio": ratio, "functrain_min_s": min(times[a]), "torch_min_s": min(times[b])})
        print(f"{label:20}{a:>34}{med[a]:8.3f}{min(times[a]):7.3f}   {b:>24}{med[b]:8.3f}{min(times[b]):7.3f}   "
              f"{ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"state": args.state, "params": n_params, "bytes": n_bytes, "device": args.device,
                       "checksum": args.checksum, "rounds": args.rounds, "torch": torch.__version__,
                       "cpus": os.cpu_count(), "rows": rows, "times": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
