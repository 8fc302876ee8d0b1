"""ft.data.ImageFolder: a folder of images as (C, H, W) float tensors in [0, 1] (resize the shorter side, center
crop, convert), in a fixed order; clear errors for what it cannot read. The package's own Dataset is compared in
tests/examples/test_ddpm.py (it needs torchvision)."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import functrain as ft

Image = pytest.importorskip("PIL.Image")


def _save(path, array, mode=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array, mode=mode).save(path)


def test_images_of_the_size_come_back_exactly_in_path_order(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"b/{i}.png": rng.integers(0, 256, (6, 6), dtype=np.uint8) for i in range(3)}
    arrays["a.PNG"] = rng.integers(0, 256, (6, 6), dtype=np.uint8)  # the extension in capitals counts
    for name, a in arrays.items():
        _save(tmp_path / name, a)
    (tmp_path / "notes.txt").write_text("not an image")
    data = ft.data.ImageFolder(tmp_path, 6, convert_image_to="L")
    assert [p.relative_to(tmp_path).as_posix() for p in data.paths] == ["a.PNG", "b/0.png", "b/1.png", "b/2.png"]
    for i, name in enumerate(["a.PNG", "b/0.png", "b/1.png", "b/2.png"]):
        x = data[i]
        assert x.dtype == torch.float32 and tuple(x.shape) == (1, 6, 6)
        assert torch.equal(x[0], torch.from_numpy(arrays[name]).float() / 255)


def test_the_shorter_side_is_resized_then_center_cropped(tmp_path):
    """A 6x10 (h x w) image with image_size=6 is not resized (its shorter side is 6): the crop is columns 2..7,
    torchvision's int(round((10 - 6) / 2)) = 2. A 12x20 one is halved first (bilinear): constant rows stay exact."""
    a = np.tile(np.arange(10, dtype=np.uint8) * 20, (6, 1))
    _save(tmp_path / "wide.png", a)
    rows = np.repeat(np.array([[10], [200]], dtype=np.uint8), 6, axis=0).repeat(20, axis=1)  # 12 x 20, two bands
    _save(tmp_path / "wider.png", rows)
    data = ft.data.ImageFolder(tmp_path, 6)
    wide, wider = data[0], data[1]
    assert torch.equal(wide[0], torch.from_numpy(a[:, 2:8]).float() / 255)
    assert tuple(wider.shape) == (1, 6, 6)
    assert torch.allclose(wider[0, 0], torch.full((6,), 10 / 255)) and torch.allclose(wider[0, -1],
                                                                                      torch.full((6,), 200 / 255))
    pair = ft.data.ImageFolder(tmp_path, (3, 5))  # (height, width): resized to it, nothing cropped
    assert tuple(pair[0].shape) == (1, 3, 5)


@pytest.mark.parametrize("mode,channels", [("L", 1), ("RGB", 3), ("RGBA", 4)])
def test_convert_image_to_sets_the_channels(tmp_path, mode, channels):
    _save(tmp_path / "c.png", np.full((4, 4, 3), 128, np.uint8))
    x = ft.data.ImageFolder(tmp_path, 4, convert_image_to=mode)[0]
    assert tuple(x.shape) == (channels, 4, 4)


def test_what_it_cannot_read_is_named(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"ImageFolder: no images \(.jpg, .jpeg, .png, .tiff\) under"):
        ft.data.ImageFolder(tmp_path, 4)
    with pytest.raises(ValueError, match="must be a folder of images; got .* \\(no such folder\\)"):
        ft.data.ImageFolder(tmp_path / "missing", 4)
    Image.fromarray(np.zeros((4, 4), np.uint8)).convert("P").save(tmp_path / "p.png")
    with pytest.raises(ValueError, match=r"palette image \(mode 'P'\).*convert_image_to='RGB'"):
        ft.data.ImageFolder(tmp_path, 4)[0]
    with pytest.raises(ValueError, match="image_size must be a positive int or \\(height, width\\); got 0"):
        ft.data.ImageFolder(tmp_path, 0)
    with pytest.raises(ValueError, match="convert_image_to must be None or a Pillow mode"):
        ft.data.ImageFolder(tmp_path, 4, convert_image_to="rgb")
    assert ft.data.ImageFolder(tmp_path, 4, augment_horizontal_flip=False).augmentation() == ()
    monkeypatch.setitem(sys.modules, "PIL", None)  # Pillow not installed
    with pytest.raises(ImportError, match=r"pip install 'functrain\[images\]'"):
        ft.data.ImageFolder(tmp_path, 4)


def test_ft_shard_batches_an_image_folder(tmp_path):
    for i in range(10):
        _save(tmp_path / f"{i}.png", np.full((5, 5), i * 20, np.uint8))
    loader = ft.shard(ft.data.ImageFolder(tmp_path, 5), batch_size=4, shuffle=False, drop_last=True)
    batches = list(loader)
    assert len(batches) == 2 and tuple(batches[0].shape) == (4, 1, 5, 5)
    assert torch.allclose(batches[1][:, 0, 0, 0], torch.tensor([80, 100, 120, 140]) / 255)
