"""Bounded parsing: a crafted checkpoint JSON file costs at most a few times its size in memory, and error
messages that quote a value are cut.

The attacks re-forge a checkpoint's file and rewrite its completion mark to match (size and sha256), as whoever
can write the folder can. Memory is measured in a fresh subprocess (peak RSS, ``VmHWM``, against the RSS just
before the load), with a timeout.
"""
import json
import os
import resource
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import functrain as ft
from functrain.checkpoint import CheckpointError
from functrain.checkpoint.bounded import estimate, loads_json
from functrain.checkpoint.folder import sha256
from functrain.core.validate import bounded_repr, check_int, describe

pytest.importorskip("safetensors")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20


def _forge(ckpt, name, data):
    """Replace ``ckpt/name`` with ``data`` and rewrite the completion mark to match it."""
    with open(os.path.join(ckpt, name), "wb") as f:
        f.write(data)
    mark_path = os.path.join(ckpt, "COMPLETE.json")
    mark = json.load(open(mark_path))
    mark["files"][name] = {"size": len(data), "sha256": sha256(data)}
    with open(mark_path, "w") as f:
        json.dump(mark, f)


PEAK = textwrap.dedent("""
    import json, sys
    import functrain as ft

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    path, what = sys.argv[1], sys.argv[2]
    before = status("VmRSS")
    try:
        if what == "extra":
            ft.load_extra(path)
        else:
            ft.load(path)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"delta": status("VmHWM") - before, "error": error}))
""")


def _peak(path, what):
    out = subprocess.run([sys.executable, "-c", PEAK, str(path), what], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


NESTED_EMPTY = b"[" + b",".join([b"[]"] * (32 * MiB // 3)) + b"]"  # 32 MiB of empty lists


@pytest.mark.parametrize("name, what", [("extra.json", "extra"), ("tree.json", "load")])
def test_a_crafted_json_file_costs_at_most_a_few_times_its_size(tmp_path, name, what):
    """32 MiB of nested empty lists cost +726 MiB to parse before; now refused, at <= 4 x size + 64 MiB."""
    ckpt = ft.save(str(tmp_path / "ckpt"), {"w": torch.ones(3)}, extra={"epoch": 1})
    _forge(ckpt, name, NESTED_EMPTY)
    report = _peak(ckpt, what)
    size = len(NESTED_EMPTY)
    assert report["error"] and report["error"].startswith("CheckpointError"), report
    assert name in report["error"] and "would cost up to" in report["error"], report
    assert report["delta"] <= 4 * size + 64 * MiB, f"+{report['delta'] / MiB:.0f} MiB for a {size / MiB:.0f} MiB file"


def test_the_bound_is_an_upper_bound_and_functrain_files_fit_it():
    """The estimate is at least what CPython's parser allocates, for every dense shape (measured with
    tracemalloc), and what functrain writes (the packed history, a tree.json) estimates far below the refusal."""
    import tracemalloc

    shapes = {"empty lists": "[" + ",".join(["[]"] * 20000) + "]", "dicts": "[" + ",".join(['{"a":1}'] * 20000) + "]",
              "floats": "[" + ",".join(["0.5"] * 20000) + "]", "strings": "[" + ",".join(['"ab"'] * 20000) + "]",
              "keys": "{" + ",".join(f'"{i:x}":"ab"' for i in range(20000)) + "}",
              "pairs": "[" + ",".join(["[1,2]"] * 20000) + "]", "nested": "[" + ",".join(["[[]]"] * 20000) + "]",
              "ints": "[" + ",".join(["100000"] * 20000) + "]"}
    for shape, text in shapes.items():
        data = text.encode()
        tracemalloc.start()
        value = json.loads(data)
        used = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del value
        assert estimate(data) >= used, (shape, estimate(data), used)
    from functrain.trainer.plots import MetricHistory

    history = MetricHistory()
    for s in range(1, 20001):
        history.add(s, {"loss": 1.0 / s, "lr": 0.0, "grad_norm": float(s)})
    data = json.dumps({"history": history.to_json(), "data": {"epoch": 3}}).encode()
    assert estimate(data) <= 1.2 * len(data) + 4096, estimate(data) / len(data)
    assert MetricHistory.from_json(loads_json(data, "extra.json")["history"]).as_dict() == history.as_dict()


def test_a_long_packed_history_round_trips_through_a_checkpoint(tmp_path):
    """A history of 3 x 200k points (a long run) saves and loads under the bound; the old [step, value] pairs
    still load (checkpoints written before the packed format)."""
    from functrain.trainer.plots import MetricHistory

    history = MetricHistory()
    for s in range(1, 200001):
        history.add(s, {"loss": 1.0 / s, "lr": 0.0, "skipped": float("nan") if s % 7 == 0 else 0.0})
    ckpt = ft.save(str(tmp_path / "ckpt"), {"w": torch.ones(3)}, extra={"history": history.to_json()})
    again = MetricHistory.from_json(ft.load_extra(ckpt)["history"])
    assert {k: [(s, repr(v)) for s, v in pts] for k, pts in again.as_dict().items()} == \
        {k: [(s, repr(v)) for s, v in pts] for k, pts in history.as_dict().items()}
    old = {"loss": [[10, 0.5], [20, "nan"]]}
    assert MetricHistory.from_json(old).as_dict()["loss"][0] == (10, 0.5)
    with pytest.raises(ValueError, match="packed int64"):
        MetricHistory.from_json({"format": MetricHistory.PACKED, "metrics": {"loss": {"steps": "!!", "values": ""}}})


def test_nesting_is_bounded(tmp_path):
    ckpt = ft.save(str(tmp_path / "ckpt"), {"w": torch.ones(3)}, extra=None)
    _forge(ckpt, "extra.json", b"[" * 500 + b"]" * 500)
    with pytest.raises(CheckpointError, match="nests deeper than 128 levels"):
        ft.load_extra(ckpt)


def test_error_messages_quote_a_bounded_repr():
    """A value that shares its parts (what YAML aliases build): a few hundred bytes whose whole repr is
    hundreds of megabytes. The message is cut at a few hundred characters, and built in milliseconds."""
    v = ["lol"] * 9
    for _ in range(8):
        v = [v] * 9  # 9**9 = 387M leaves
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        check_int("TrainConfig.train_batch_size", v, minimum=1)
    took = time.perf_counter() - t0
    assert len(str(e.value)) < 500 and str(e.value).endswith("... (list)"), str(e.value)[:600]
    assert took < 1.0, took
    assert describe(10 ** 5000).startswith("<int of 16610 bits>")
    assert bounded_repr({"a": (1,), "b": frozenset()}) == repr({"a": (1,), "b": frozenset()})
    assert len(bounded_repr("x" * 10**7)) <= 310


def test_the_file_size_limit_message_counts_the_safetensors_header(tmp_path):
    """Many small tensors: the header is most of the file. Under ``ulimit -f`` between the data's size and the
    file's, the refusal names the file's true size (data + header), before anything is written."""
    state = {f"t{i:05d}": torch.zeros(40) for i in range(3000)}  # 480 KB of data, ~200 KB of header
    full = ft.save(str(tmp_path / "full"), state)
    size = os.path.getsize(os.path.join(full, "tensors.safetensors"))
    data = 3000 * 40 * 4
    assert os.path.getsize(os.path.join(full, "tree.json")) < data < size  # the tensor file is the largest
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch, functrain as ft
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, ({(data + size) // 2}, resource.RLIM_INFINITY))
        state = {{f"t{{i:05d}}": torch.zeros(40) for i in range(3000)}}
        try:
            ft.save(sys.argv[1], state)
        except ft.checkpoint.CheckpointSpaceError as e:
            print("REFUSED", e)
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "limited")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED" in out.stdout, out.stdout
    assert f"in files of up to {size} bytes" in out.stdout, out.stdout
    assert not os.path.exists(tmp_path / "limited")
    assert [e for e in os.listdir(tmp_path) if e.startswith(".")] == [], "a temporary folder was left"
