"""``ft.launch`` returns tensors, names a value it cannot send back, and explains a script without the main guard.

Before: a rank that returned a tensor made the caller fail with a bare ``FileNotFoundError`` (torch passed the
tensor as a handle to the rank's shared memory, gone once the rank exited); an unpicklable value left the caller
waiting for the job's timeout; a script that called ``ft.launch`` without ``if __name__ == "__main__":`` got
"exited with code 1 without a Python traceback". Two ranks over gloo, each subprocess with a timeout.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import functrain as ft

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tensors():
    import torch.distributed as dist

    rank = dist.get_rank()
    t = torch.arange(4.0) + 10 * rank
    w = torch.ones(2, requires_grad=True)
    return {"rank": rank, "t": t, "view": t[1:3], "nonleaf": w * 3, "int": torch.tensor(rank)}


def _lambda():
    return lambda: 1


def test_ranks_return_tensors_on_the_cpu():
    got = ft.launch(_tensors, nprocs=2, timeout=240)
    for rank, value in enumerate(got):
        assert value["rank"] == rank
        assert torch.equal(value["t"], torch.arange(4.0) + 10 * rank)
        assert torch.equal(value["view"], value["t"][1:3])
        assert value["view"].untyped_storage().data_ptr() == value["t"].untyped_storage().data_ptr()  # still a view
        assert torch.equal(value["nonleaf"].detach(), torch.full((2,), 3.0))
        assert value["int"].item() == rank and value["t"].device.type == "cpu"


def test_a_value_that_cannot_be_sent_back_is_named():
    with pytest.raises(TypeError, match=r"launch: the value fn returned on rank 0 cannot be sent back") as e:
        ft.launch(_lambda, nprocs=2, timeout=120)
    assert "pickle" in str(e.value)


SCRIPT = """
import functrain as ft

def work():
    return 1

print("RESULT", ft.launch(work, nprocs=2, timeout=120))
"""


def test_a_script_without_the_main_guard_is_explained(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                         cwd=tmp_path)
    assert out.returncode == 1 and "RESULT" not in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("functrain.distributed.spawn.LaunchError: launch: the ranks exited while starting: "
                           f"the script that calls ft.launch ({script}) must guard it with "
                           "`if __name__ == \"__main__\":`, because ft.launch starts each rank by importing"), last
    assert out.stderr.count("ft.launch: this rank, starting, ran the unguarded ft.launch call") == 2  # each rank
    guarded = textwrap.dedent(SCRIPT).replace('print("RESULT"', 'if __name__ == "__main__":\n    print("RESULT"')
    script.write_text(guarded)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0 and "RESULT [1, 1]" in out.stdout, out.stderr[-3000:]
