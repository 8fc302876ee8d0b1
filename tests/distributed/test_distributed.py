"""Who a process is, from its launcher's environment variables."""
import pytest

from functrain.distributed import ProcessInfo, default_timeout, process_info


@pytest.mark.parametrize("env,expected", [
    ({}, ProcessInfo(0, 1, 0, "none")),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, ProcessInfo(3, 4, 1, "torchrun")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, ProcessInfo(5, 8, 1, "slurm")),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
     ProcessInfo(2, 3, 0, "mpi")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, ProcessInfo(1, 2, 1, "pmi")),
    # torchrun's variables win over a surrounding SLURM allocation's
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "SLURM_PROCID": "7", "SLURM_NTASKS": "8"},
     ProcessInfo(0, 2, 0, "torchrun")),
])
def test_process_info_from_launcher_variables(env, expected):
    assert process_info(env) == expected


def test_bad_variables_are_named(monkeypatch):
    with pytest.raises(ValueError, match="RANK='x'"):
        process_info({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="rank 4 is outside world size 2"):
        process_info({"SLURM_PROCID": "4", "SLURM_NTASKS": "2"})
    monkeypatch.setenv("FUNCTRAIN_DIST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FUNCTRAIN_DIST_TIMEOUT='soon'"):
        default_timeout()
    monkeypatch.setenv("FUNCTRAIN_DIST_TIMEOUT", "7.5")
    assert default_timeout().total_seconds() == 7.5


def test_a_non_positive_dist_timeout_is_refused(monkeypatch):
    for raw in ("0", "-1", "nan"):
        monkeypatch.setenv("FUNCTRAIN_DIST_TIMEOUT", raw)
        with pytest.raises(ValueError, match="FUNCTRAIN_DIST_TIMEOUT must be a number > 0"):
            default_timeout()


def test_ft_launch_stays_the_function_after_the_test_command_collected_everything():
    """The test command imports every module of functrain/ for its doctests; importing the ``python -m`` entry
    point ``functrain/launch.py`` as a module rebinds ``ft.launch`` to it, so that module calls the launcher
    (issue 37: a callable module; tests/distributed/test_launch_name.py): either way ``ft.launch`` is the launcher."""
    import types

    import functrain as ft
    from functrain.distributed import spawn

    assert callable(ft.launch)
    assert ft.launch is spawn.launch or (isinstance(ft.launch, types.ModuleType) and ft.launch.__wrapped__ is spawn.launch)
