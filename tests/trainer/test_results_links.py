"""A results folder is written only through names it owns: attacks by another user's planted symlinks.

The attacker is another uid (``setpriv --reuid --regid --clear-groups``; the tests run as root) that can write
into a shared results folder (mode 0777). It plants a symbolic link where the Trainer writes (``.lock``,
``metrics.jsonl``, ``config.json``, ``metrics.png``, a sample grid, ``model.safetensors``, a checkpoint name)
or at a temporary name it predicts (``config.json.tmp-<pid>``, ``.metrics.png.tmp-<pid>``, ...), pointing at a
file of ours outside the folder. The real Trainer runs (eager, a few steps): the outside file is never written
or truncated, and a link where a file should be is refused with LinkRefused naming it.
"""
import json
import os
import shutil
import subprocess
import tempfile
import warnings

import pytest
import torch

import functrain as ft
from functrain.checkpoint import LinkRefused

pytest.importorskip("safetensors")

ATTACKER = 54321  # a uid that owns nothing here
PRECIOUS = "precious: not to be written by functrain\n"


def _as_attacker(*argv):
    subprocess.run(["setpriv", f"--reuid={ATTACKER}", f"--regid={ATTACKER}", "--clear-groups", *map(str, argv)],
                   check=True, timeout=30)


@pytest.fixture
def shared():
    """``(results, victim)``: a results folder anyone may write (0777), and a file of ours outside it."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as another user")
    base = tempfile.mkdtemp(prefix="ft-links-", dir="/tmp")
    os.chmod(base, 0o755)  # (pytest's own tmp folders are private: the attacker could not reach in)
    results = os.path.join(base, "results")
    os.mkdir(results)
    os.chmod(results, 0o777)
    victim = os.path.join(base, "outside.txt")
    with open(victim, "w") as f:
        f.write(PRECIOUS)
    yield results, victim
    shutil.rmtree(base, ignore_errors=True)


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


def _trainer(results, steps=4, **kw):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    config = ft.TrainConfig(train_batch_size=8, train_num_steps=steps, save_and_sample_every=2, num_samples=4,
                            results_folder=results, compile=False, log_every=1, trackers=("jsonl",), **kw)
    torch.manual_seed(0)
    return ft.Trainer(Linear(), data, config, sample_fn=lambda ema, n: torch.rand(n, 1, 2, 2))


def _unchanged(victim):
    with open(victim) as f:
        assert f.read() == PRECIOUS, "the file outside the results folder was written through a link"


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "config.json", "metrics.png", "sample-2.png",
                                  "model.safetensors"])
def test_a_link_where_the_trainer_writes_a_file_is_refused(shared, name):
    results, victim = shared
    link = os.path.join(results, name)
    _as_attacker("ln", "-s", victim, link)
    trainer = _trainer(results)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(LinkRefused, match=f"{link} is a symbolic link") as e:
            trainer.train()
    assert e.value.filename == link and isinstance(e.value, OSError)
    _unchanged(victim)
    assert os.readlink(link) == victim  # left as it was: neither followed nor replaced


def test_predicted_temporary_names_are_never_used(shared):
    """The old writers used ``<name>.tmp-<pid>``: links planted at every such name are never touched."""
    results, victim = shared
    pid = os.getpid()
    planted = [f"config.json.tmp-{pid}", f".metrics.png.tmp-{pid}", f".sample-2.png.tmp-{pid}",
               f".sample-4.png.tmp-{pid}", f"trackers.json.tmp-{pid}", f".model.safetensors.tmp-{pid}"]
    for name in planted:
        _as_attacker("ln", "-s", victim, os.path.join(results, name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(results).train()
    _unchanged(victim)
    for name in ("config.json", "metrics.png", "sample-2.png", "sample-4.png", "model.safetensors", "metrics.jsonl"):
        path = os.path.join(results, name)
        assert os.path.isfile(path) and not os.path.islink(path), name
    for name in planted:
        assert os.readlink(os.path.join(results, name)) == victim


def test_metrics_jsonl_is_not_rewritten_in_place_on_resume(shared):
    """Resuming drops the log lines after the checkpoint by writing a new file renamed over the name: a hard
    link to the old file (another name for the same bytes) keeps the old contents, and a link planted
    between two runs is refused."""
    results, victim = shared
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(results, steps=4).train()
        log = os.path.join(results, "metrics.jsonl")
        before = open(log).read()
        shutil.rmtree(ft.CheckpointManager(os.path.join(results, "checkpoints")).path(4))
        alias = os.path.join(os.path.dirname(results), "alias.jsonl")
        os.link(log, alias)
        _trainer(results, steps=4).train()  # resumes at step 2, drops the lines of steps 3 and 4, logs them again
        assert open(alias).read() == before, "metrics.jsonl was rewritten in place"
        losses = lambda text: [(r["step"], r["loss"]) for r in map(json.loads, text.splitlines())]  # noqa: E731
        assert losses(open(log).read()) == losses(before)  # (the same losses: the resume is bit-exact)
        os.remove(log)
        _as_attacker("ln", "-s", victim, log)
        shutil.rmtree(ft.CheckpointManager(os.path.join(results, "checkpoints")).path(4))
        with pytest.raises(LinkRefused, match="metrics.jsonl is a symbolic link"):
            _trainer(results, steps=4).train()
    _unchanged(victim)


def test_a_link_named_like_a_checkpoint_is_never_loaded_or_rotated(shared):
    """A planted ``checkpoints/step_*`` link to a complete checkpoint elsewhere (the newest step): resume skips it
    by name, rotation never removes what it points to, and no save goes through it."""
    results, victim = shared
    outside = os.path.join(os.path.dirname(results), "their-checkpoint")
    ft.save(outside, {"w": torch.ones(2)})
    folder = os.path.join(results, "checkpoints")
    os.mkdir(folder)
    os.chmod(folder, 0o777)
    link = os.path.join(folder, "step_00000009")
    _as_attacker("ln", "-s", outside, link)
    manager = ft.CheckpointManager(folder, keep=1)
    for n in (2, 3, 4):
        manager.save(n, {"w": torch.full((2,), float(n))})
    assert manager.steps() == [4] and os.readlink(link) == outside  # rotation left the link (and its target)
    assert sorted(os.listdir(outside)) == ["COMPLETE.json", "extra.json", "tensors.safetensors", "tree.json"]
    with pytest.warns(RuntimeWarning, match=r"skipping checkpoint .*step_00000009: a symbolic link"):
        restored = manager.load_latest(template={"w": torch.zeros(2)})
    assert restored.step == 4
    with pytest.raises(LinkRefused, match="step_00000009 is a symbolic link"):  # nor saved through
        manager.save(9, {"w": torch.zeros(2)})
    assert ft.tree.tree_equal(ft.load(outside), {"w": torch.ones(2)})
