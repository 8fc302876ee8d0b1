"""ft.distributed's process helpers (print once, main process first, barrier, split) on 2 gloo ranks and on one
process."""
import contextlib
import io
import os

import pytest
import torch

import functrain as ft
from functrain import distributed as ftd


def _worker(folder):
    import torch.distributed as dist

    r = dist.get_rank()
    report = {"rank": r, "main": ftd.is_main_process(), "local_main": ftd.is_local_main_process()}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ftd.print_main("hello from", r)
    report["printed"] = out.getvalue()

    # main_process_first: rank 0 runs the block while rank 1 waits; rank 1 enters only after rank 0 left it
    with ftd.main_process_first():
        others = [f for f in os.listdir(folder) if f.startswith("entered")]
        report["seen_on_entry"] = sorted(others)
        open(os.path.join(folder, f"entered-{r}"), "w").close()
        if r == 0:
            open(os.path.join(folder, "cache-written"), "w").close()
    # wait_for_everyone: what rank 1 wrote before the barrier is there for rank 0 after it
    if r == 1:
        open(os.path.join(folder, "before-barrier-1"), "w").close()
    ftd.wait_for_everyone()
    report["after_barrier"] = os.path.exists(os.path.join(folder, "before-barrier-1"))
    ftd.wait_for_everyone()  # rank 0 has checked before the file folder is left to the test

    # tensors go back as (type, rows): plain values, no shared-memory file descriptors to hand over at exit
    def plain(x):
        return (type(x).__name__, x.tolist()) if isinstance(x, torch.Tensor) else x

    report["splits"] = {
        n: (ftd.split_between_processes(list(range(n))), ftd.split_between_processes(tuple(range(n))),
            plain(ftd.split_between_processes(torch.arange(2 * n).reshape(n, 2))),
            {k: plain(v) for k, v in ftd.split_between_processes({"x": list(range(n)), "y": torch.arange(n)}).items()})
        for n in (0, 1, 4, 5)}
    report["padded"] = {n: (ftd.split_between_processes(list(range(n)), pad=True),
                            plain(ftd.split_between_processes(torch.arange(n), pad=True))) for n in (4, 5)}
    return report


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks")
    return ft.launch(_worker, nprocs=2, args=(str(folder),), timeout=240, dist_timeout=60)


def test_main_process_and_print_main(reports):
    assert [(r["main"], r["local_main"]) for r in reports] == [(True, True), (False, False)]
    assert reports[0]["printed"] == "hello from 0\n" and reports[1]["printed"] == ""


def test_main_process_first_runs_rank_0_first_then_the_others(reports):
    assert reports[0]["seen_on_entry"] == []  # rank 1 had not entered while rank 0 ran the block
    assert reports[1]["seen_on_entry"] == ["entered-0"]  # rank 1 entered after rank 0 was through


def test_wait_for_everyone_is_a_barrier(reports):
    assert reports[0]["after_barrier"] and reports[1]["after_barrier"]


@pytest.mark.parametrize("n", [0, 1, 4, 5])
def test_split_between_processes_parts_concatenate_to_the_input(reports, n):
    (l0, t0, x0, d0), (l1, t1, x1, d1) = (r["splits"][n] for r in reports)
    assert l0 + l1 == list(range(n)) and isinstance(l0, list)
    assert t0 + t1 == tuple(range(n)) and isinstance(t0, tuple)
    assert x0[0] == "Tensor" and x0[1] + x1[1] == torch.arange(2 * n).reshape(n, 2).tolist()
    assert d0["x"] + d1["x"] == list(range(n)) and d0["y"][1] + d1["y"][1] == list(range(n))
    assert len(l0) == (n + 1) // 2 and len(l1) == n // 2  # uneven: the first rank gets one more
    assert len(d0["x"]) == len(d0["y"][1]) == len(l0)


def test_split_between_processes_pad_repeats_the_last_row(reports):
    (l0, t0), (l1, t1) = (r["padded"][4] for r in reports)
    assert (l0, l1) == ([0, 1], [2, 3]) and t0[1] + t1[1] == [0, 1, 2, 3]
    (l0, t0), (l1, t1) = (r["padded"][5] for r in reports)
    assert (l0, l1) == ([0, 1, 2], [3, 4, 4])  # every rank 3 long: rank 1 repeats its last row
    assert t0 == ("Tensor", [0, 1, 2]) and t1 == ("Tensor", [3, 4, 4])


def test_one_process_is_main_waits_for_nobody_and_gets_everything(tmp_path, capsys):
    assert ftd.is_main_process() and ftd.is_local_main_process()
    ftd.print_main("once")
    assert capsys.readouterr().out == "once\n"
    ftd.wait_for_everyone()
    ran = []
    with ftd.main_process_first():
        ran.append(1)
    assert ran == [1]
    data = {"a": [1, 2, 3], "b": torch.arange(3)}
    got = ftd.split_between_processes(data, pad=True)
    assert got["a"] == [1, 2, 3] and torch.equal(got["b"], torch.arange(3))


def test_split_between_processes_refuses_bad_input():
    with pytest.raises(TypeError, match="data is a set; expected a list, tuple, tensor"):
        ftd.split_between_processes({1, 2})
    with pytest.raises(ValueError, match=r"different lengths \{'a': 2, 'b': 3\}"):
        ftd.split_between_processes({"a": [1, 2], "b": [1, 2, 3]})
    with pytest.raises(ValueError, match="0-d tensor"):
        ftd.split_between_processes(torch.tensor(1.0))
    with pytest.raises(TypeError, match="pad must be a bool; got 1"):
        ftd.split_between_processes([1], pad=1)


def _rank_1_skips_the_barrier(folder):
    import time

    import torch.distributed as dist

    done = os.path.join(folder, "rank-0-done")
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            ftd.wait_for_everyone()
            outcome = "returned"
        except Exception as e:  # gloo's timeout error
            outcome = f"{type(e).__name__}: {e}"
        open(done, "w").close()
        return outcome, time.monotonic() - start
    deadline = time.monotonic() + 60  # stay in the job (without calling the barrier) until rank 0 has its answer
    while not os.path.exists(done):
        assert time.monotonic() < deadline, "rank 0 never reported its barrier"
        time.sleep(0.05)
    return None


def test_wait_for_everyone_fails_after_the_group_timeout_when_a_rank_never_arrives(tmp_path):
    (outcome, waited), _ = ft.launch(_rank_1_skips_the_barrier, nprocs=2, args=(str(tmp_path),), timeout=120,
                                     dist_timeout=3)
    assert "timed out" in outcome.lower() and 2.5 < waited < 60, (outcome, waited)  # gloo: "Timed out waiting 3000ms"
