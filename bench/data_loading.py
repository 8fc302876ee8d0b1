"""Time per batch of ``ft.shard`` over in-memory data: the per-sample collate path vs the gather path vs a DataLoader.

    python bench/data_loading.py                       # W1-sized batches (32 x 32 floats + 32 x 1 targets), ~20 s
    python bench/data_loading.py --rounds 20 --batch 64 --features 256 --json /tmp/data.json

The variants, all over the same tensors, shuffled, batch ``--batch``, one process, one thread:

* ``ft.shard collate``: the tensors behind a plain ``Dataset`` (what ``ft.shard`` did for every
  dataset before: ``__getitem__`` per sample, ``default_collate`` through a DataLoader);
* ``ft.shard gather``: ``ft.shard(TensorDataset(X, y))`` -- one ``index_select`` per column per batch;
* ``ft.shard (X, y)``: ``ft.shard((X, y))``, the same path from a tuple of tensors;
* ``DataLoader``: ``DataLoader(TensorDataset(X, y), batch_size, shuffle=True)``, what users write.

Each round times one full epoch of every variant, in a rotated order (so drift and noise from other
processes fall on all of them alike); the result is the median over rounds of CPU microseconds per
batch (of this process: time spent waiting for a shared CPU does not count; wall time is shown
beside it), and the median of the per-round CPU-time ratio to the DataLoader. Before the rounds every variant
runs one epoch (warm-up) and its batches are checked to be equal to the collate path's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402

from functrain.data import shard  # noqa: E402


class Rows(Dataset):
    """A TensorDataset's rows behind an ordinary Dataset: ft.shard loads it sample by sample."""

    def __init__(self, inner: TensorDataset):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        return self.inner[i]


def variants(x: torch.Tensor, y: torch.Tensor, batch: int) -> dict:
    td = TensorDataset(x, y)
    return {
        "ft.shard collate": shard(Rows(td), batch, seed=0, world_size=1),
        "ft.shard gather": shard(td, batch, seed=0, world_size=1),
        "ft.shard (X, y)": shard((x, y), batch, seed=0, world_size=1),
        "DataLoader": DataLoader(td, batch_size=batch, shuffle=True),
    }


def epoch_us_per_batch(loader) -> tuple[float, float]:
    """(CPU time, wall time) per batch of one epoch, in microseconds."""
    c0, t0 = time.process_time(), time.perf_counter()
    n = 0
    for _ in loader:
        n += 1
    c1, t1 = time.process_time(), time.perf_counter()
    return (c1 - c0) * 1e6 / max(n, 1), (t1 - t0) * 1e6 / max(n, 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, args.features, generator=g)
    y = torch.randn(args.samples, 1, generator=g)
    loaders = variants(x, y, args.batch)

    reference = [b for b in loaders["ft.shard collate"]]
    for name in ("ft.shard gather", "ft.shard (X, y)"):
        loader = loaders[name]
        loader.set_epoch(0)
        got = list(loader)
        assert len(got) == len(reference) and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, reference)), \
            f"{name}: batches differ from the collate path"
    for loader in loaders.values():  # warm-up
        epoch_us_per_batch(loader)

    names = list(loaders)
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            c, w = epoch_us_per_batch(loaders[name])
            cpu[name].append(c)
            wall[name].append(w)
    base = cpu["DataLoader"]
    rows = []
    print(f"batch {args.batch} x {args.features} floats (+ {args.batch} x 1), {args.samples} samples, "
          f"{args.rounds} interleaved rounds, 1 thread; CPU time of this process (wall time beside it)\n")
    print("| variant | median CPU us / batch | median wall us / batch | CPU ratio to DataLoader (median of paired) |")
    print("|---|---|---|---|")
    for name in names:
        ratio = statistics.median(t / b for t, b in zip(cpu[name], base))
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        rows.append({"variant": name, "median_cpu_us": c, "median_wall_us": w, "cpu_ratio_to_dataloader": ratio})
        print(f"| {name} | {c:.1f} | {w:.1f} | {ratio:.3f} |")
    times = {"cpu_us": cpu, "wall_us": wall}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows, "times": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
