"""``CheckpointManager(keep_best=True)``: rotation keeps the checkpoint with the lowest score beside the newest
``keep`` (denoising-diffusion-pytorch's ``save_best_and_latest_only``), and a kill mid-rotation leaves the best and the
newest loadable."""
from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functrain as ft
from functrain.checkpoint import manager as manager_module


def _state(step):
    return {"w": torch.full((3,), float(step))}


def _template():
    return {"w": torch.zeros(3)}


scores = st.one_of(st.none(), st.just(float("nan")), st.floats(0.0, 4.0, width=16))


@settings(max_examples=25, deadline=None)
@given(st.lists(scores, min_size=1, max_size=8), st.integers(1, 3))
def test_rotation_keeps_the_newest_and_the_best(tmp_path_factory, seq, keep):
    """After every save: the kept steps are the newest ``keep`` and the lowest finite score (the oldest of equal
    ones), computed here from the scores given; ``best()`` is that step, and it loads as saved."""
    manager = ft.CheckpointManager(tmp_path_factory.mktemp("ck"), keep=keep, keep_best=True, fsync=False)
    for i, score in enumerate(seq):
        step = i + 1
        manager.save(step, _state(step), score=score)
        scored = [(s, j + 1) for j, s in enumerate(seq[:step]) if s is not None and math.isfinite(s)]
        best = min(scored)[1] if scored else None
        newest = set(range(max(1, step - keep + 1), step + 1))
        assert manager.steps() == sorted(newest | ({best} if best else set()))
        assert manager.best() == best
    if best is not None:
        loaded = ft.load(manager.path(best), _template())
        assert torch.equal(loaded["w"], _state(best)["w"])


def test_score_is_refused_without_keep_best_and_checked(tmp_path):
    with pytest.raises(ValueError, match=r"score=0.5 ranks checkpoints for keep_best.*keep_best=False"):
        ft.CheckpointManager(tmp_path / "a").save(1, _state(1), score=0.5)
    with pytest.raises(TypeError, match="score must be a number"):
        ft.CheckpointManager(tmp_path / "b", keep_best=True).save(1, _state(1), score="low")
    with pytest.raises(TypeError, match="keep_best must be True or False"):
        ft.CheckpointManager(tmp_path / "c", keep_best="eval_loss")


class Killed(BaseException):
    """A kill planted in the rotation (not an Exception: nothing catches it, as nothing catches SIGKILL)."""


@pytest.mark.parametrize("where", ["before_remove", "mid_remove"])
def test_a_kill_mid_rotation_leaves_the_best_and_the_newest_loadable(tmp_path, monkeypatch, where):
    """keep=1: steps 1 (score 0.3, the best) then 2 (0.5), then step 3 (0.1, the new best) is killed while it rotates:
    before any removal, or inside the removal of a demoted checkpoint (half of its files deleted). A new manager
    (the restarted run) finds the newest (3) and the best (3) whole and loads both; the next save tidies what the kill
    left and rotates to the newest and the best."""
    folder = tmp_path / "ck"
    manager = ft.CheckpointManager(folder, keep=1, keep_best=True, fsync=False)
    manager.save(1, _state(1), score=0.3)
    manager.save(2, _state(2), score=0.5)
    assert manager.steps() == [1, 2]

    if where == "before_remove":
        def kill(self, path):
            raise Killed()
        monkeypatch.setattr(manager_module.CheckpointManager, "_remove", kill)
    else:
        real = shutil.rmtree

        def kill(path, ignore_errors=False):
            files = sorted(os.listdir(path))
            os.remove(os.path.join(path, files[0]))  # part of it gone, then the kill
            raise Killed()
        monkeypatch.setattr(manager_module.shutil, "rmtree", kill)
    with pytest.raises(Killed):
        manager.save(3, _state(3), score=0.1)
    monkeypatch.undo()

    again = ft.CheckpointManager(folder, keep=1, keep_best=True, fsync=False)
    assert again.best() == 3
    restored = again.load_latest(template=_template(), fallback=False)
    assert restored.step == 3 and torch.equal(restored.state["w"], _state(3)["w"])
    assert torch.equal(ft.load(again.path(again.best()), _template())["w"], _state(3)["w"])
    again.save(4, _state(4), score=0.9)
    assert again.steps() == [3, 4] and again.best() == 3
    assert sorted(os.listdir(folder)) == ["step_00000003", "step_00000004"]  # the kill's leftovers tidied


@pytest.mark.parametrize("edited", ["NaN", "Infinity", "-Infinity", "1e999", "-1" + "0" * 400, '"0.1"', "true",
                                    "null", "[0.1]"],
                         ids=["nan", "inf", "-inf", "1e999", "-10**400", "string", "true", "null", "list"])
def test_a_mark_whose_score_is_not_a_finite_number_is_not_ranked(tmp_path, edited):
    """The best checkpoint's completion mark edited on disk to a score that is not a finite number: it is not the
    best from then on (before: NaN stayed "best" for good over 0.9 and then 0.7, -Infinity too, and an int past a
    float's range raised OverflowError out of save), rotation removes it once it is old, and the next scores rank
    as the manager computes them here."""
    folder = tmp_path / "ck"
    manager = ft.CheckpointManager(folder, keep=1, keep_best=True, fsync=False)
    manager.save(1, _state(1), score=0.1)
    mark = folder / "step_00000001" / "COMPLETE.json"
    text = mark.read_text()
    assert text.count('"score":0.1') == 1, text
    mark.write_text(text.replace('"score":0.1', f'"score":{edited}'))
    assert manager.best() is None
    manager.save(2, _state(2), score=0.9)
    assert manager.best() == 2 and manager.steps() == [2]  # step 1: neither the newest nor the best
    manager.save(3, _state(3), score=0.7)
    assert manager.best() == 3 and manager.steps() == [3]
    manager.save(4, _state(4), score=0.8)
    assert manager.best() == 3 and manager.steps() == [3, 4]
    assert torch.equal(ft.load(manager.path(manager.best()), _template())["w"], _state(3)["w"])


def test_an_edited_mark_with_a_finite_score_still_ranks(tmp_path):
    """(The other side: an edit to a finite number is a score like any other.)"""
    folder = tmp_path / "ck"
    manager = ft.CheckpointManager(folder, keep=1, keep_best=True, fsync=False)
    manager.save(1, _state(1), score=0.5)
    mark = folder / "step_00000001" / "COMPLETE.json"
    mark.write_text(mark.read_text().replace('"score":0.5', '"score":-3'))
    manager.save(2, _state(2), score=0.1)
    assert manager.best() == 1 and manager.steps() == [1, 2]
