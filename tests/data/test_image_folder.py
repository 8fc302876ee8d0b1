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


# ------------------------------------------------------------------------------------------ bounded, every mode
def _whole_resize_then_crop(img, size):
    """What ImageFolder did for every image before the bound (torchvision's Resize(size) + CenterCrop(size) on a
    PIL image): the shorter side resized to ``size`` (bilinear), then the centered square cut out of it."""
    w, h = img.size
    new = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
    if new != img.size:
        img = img.resize(new, Image.BILINEAR)
    w, h = img.size
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return np.asarray(img.crop((left, top, left + size, top + size)), dtype=np.float32) / 255


def test_ordinary_images_are_the_whole_resize_then_crop_and_beyond_max_pixels_only_the_crop_is_resized(tmp_path):
    """Images whose resized whole fits in max_pixels are resized whole, then cropped: bitwise what ImageFolder
    (and the package's Dataset) always gave. Beyond it only the crop's source region is resized (Pillow's
    resize with a box): the same sampling positions, equal to the whole resize within resampling rounding
    (one step of 1/255), without allocating the whole."""
    rng = np.random.default_rng(1)
    shapes = [(20, 30), (33, 17), (9, 40), (40, 30), (7, 7), (5, 100), (100, 6), (4, 150), (150, 4)]
    for i, (h, w) in enumerate(shapes):
        _save(tmp_path / f"{i}.png", rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    size = 12
    whole = ft.data.ImageFolder(tmp_path, size)
    cropped = ft.data.ImageFolder(tmp_path, size, max_pixels=2_000)  # 5x100 resizes to 12x240: the crop
    assert cropped.max_pixels == 2_000 and whole.max_pixels == ft.data.image_folder.MAX_PIXELS
    for i, path in enumerate(whole.paths):
        with Image.open(path) as img:
            expected = torch.from_numpy(_whole_resize_then_crop(img.convert("RGB"), size)).permute(2, 0, 1)
        assert torch.equal(whole[i], expected), path.name
        assert (cropped[i] - expected).abs().max() <= 1.0001 / 255, path.name
    resized = [size * int(size * max(h, w) / min(h, w)) for h, w in shapes]
    assert [i for i, n in enumerate(resized) if n > 2_000] == [5, 6, 7, 8]  # these four went through the box


_PROBE = r"""
import resource, sys
try:  # keep a regression from taking the shared machine's memory: at most ~1 GiB more address space
    vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
except (OSError, StopIteration, ValueError):
    pass
import functrain as ft
data = ft.data.ImageFolder(sys.argv[1], 64, convert_image_to="RGB")
first = data[0]  # an ordinary image first: what a sample costs anyway is in the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
wide = data[1]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
values = [sorted(set(c.mul(255).round().int().flatten().tolist())) for c in wide]  # per channel
print("GROWTH_KIB", after - before, tuple(wide.shape), values, flush=True)
"""


def test_a_200000_by_1_png_is_read_in_little_memory(tmp_path):
    """A 200000x1 PNG (about 1 KiB, under Pillow's decompression-bomb check) at image_size=64 resized whole is
    12800000x64 pixels (2.4 GB as RGB); only its crop is resized now. Measured in a subprocess: the peak
    resident memory grows by less than 64 MiB over reading an ordinary image."""
    import subprocess

    folder = tmp_path / "images"
    _save(folder / "a.png", np.full((64, 64, 3), 7, np.uint8))
    Image.new("RGB", (200_000, 1), (10, 200, 30)).save(folder / "b.png")
    assert (folder / "b.png").stat().st_size < 4096
    out = subprocess.run([sys.executable, "-c", _PROBE, str(folder)], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    line = next(s for s in out.stdout.splitlines() if s.startswith("GROWTH_KIB"))
    _, growth, *rest = line.split(" ", 2)
    assert int(growth) < 64 * 1024, line
    assert rest == ["(3, 64, 64) [[10], [200], [30]]"], line


def test_an_image_over_max_pixels_is_refused_naming_it_and_both_sizes(tmp_path):
    _save(tmp_path / "small.png", np.zeros((10, 10), np.uint8))
    _save(tmp_path / "tall.png", np.zeros((300, 20), np.uint8))
    data = ft.data.ImageFolder(tmp_path, 8, max_pixels=5_000)
    assert tuple(data[0].shape) == (1, 8, 8)
    with pytest.raises(ValueError, match=r"ImageFolder: '.*tall\.png' is 20x300 pixels \(6000\), more than "
                                         r"max_pixels=5000.*max_pixels="):
        data[1]
    with pytest.raises(ValueError, match=r"max_pixels must be an int >= 1; got 0"):
        ft.data.ImageFolder(tmp_path, 8, max_pixels=0)
    with pytest.raises(ValueError, match=r"image_size \(100, 60\) gives samples of 6000 pixels, more than "
                                         r"max_pixels=5000"):
        ft.data.ImageFolder(tmp_path, (100, 60), max_pixels=5_000)


def test_a_file_that_cannot_be_decoded_is_named(tmp_path):
    import io

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "JPEG")
    (tmp_path / "cut.jpg").write_bytes(buffer.getvalue()[:len(buffer.getvalue()) // 2])
    (tmp_path / "junk.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    data = ft.data.ImageFolder(tmp_path, 8, convert_image_to="RGB")
    for i, name in enumerate(["cut.jpg", "junk.png"]):
        with pytest.raises(OSError, match=rf"ImageFolder: cannot read '.*{name}' \(\w+: .+\)"):
            data[i]


def _cmyk_jpeg(path):
    rng = np.random.default_rng(2)
    Image.fromarray(rng.integers(0, 256, (6, 6, 4), dtype=np.uint8), mode="CMYK").save(path, quality=95)


@pytest.mark.parametrize("target", ["L", "RGB", "RGBA"])
def test_every_mode_becomes_the_configured_channels(tmp_path, target):
    """CMYK JPEG, palette PNG, 16-bit PNG (I;16), 32-bit int TIFF (I), LA, L, RGBA and 1-bit files all give the
    configured channels; 16-bit values are scaled to 8 bits (v * 257 -> v), not clipped at 255."""
    rng = np.random.default_rng(3)
    grey = rng.integers(0, 256, (6, 6), dtype=np.uint8)
    _cmyk_jpeg(tmp_path / "cmyk.jpg")
    Image.fromarray(grey).convert("P").save(tmp_path / "palette.png")
    Image.fromarray(grey.astype(np.uint16) * 257).save(tmp_path / "sixteen.png")
    Image.fromarray(grey.astype(np.int32) * 257, mode="I").save(tmp_path / "thirtytwo.tiff")
    Image.fromarray(np.stack([grey, 255 - grey], -1), mode="LA").save(tmp_path / "la.png")
    _save(tmp_path / "l.png", grey)
    _save(tmp_path / "rgba.png", np.stack([grey, grey, grey, 255 - grey], -1))
    Image.fromarray(grey > 127).save(tmp_path / "one.png")
    data = ft.data.ImageFolder(tmp_path, 6, convert_image_to=target, augment_horizontal_flip=False)
    with Image.open(tmp_path / "sixteen.png") as img:
        assert img.mode == "I;16"
    with Image.open(tmp_path / "thirtytwo.tiff") as img:
        assert img.mode == "I"
    channels = len(target)
    samples = {p.name: data[i] for i, p in enumerate(data.paths)}
    for name, x in samples.items():
        assert tuple(x.shape) == (channels, 6, 6), name
    g = torch.from_numpy(grey).float() / 255
    for name in ("palette.png", "sixteen.png", "thirtytwo.tiff", "l.png", "la.png", "rgba.png"):
        assert torch.equal(samples[name][0], g), name  # the grey (or red) channel, exactly
    assert torch.equal(samples["one.png"][0], (g > 127 / 255).float())  # 1-bit: 0 or 1.0
    if target != "L":
        assert torch.equal(samples["sixteen.png"][2], g)
    with Image.open(tmp_path / "cmyk.jpg") as img:
        assert img.mode == "CMYK"
        expected = np.asarray(img.convert(target), dtype=np.float32).reshape(6, 6, channels) / 255
    assert torch.equal(samples["cmyk.jpg"], torch.from_numpy(expected).permute(2, 0, 1))
    if target == "RGBA":
        alpha = torch.from_numpy(255 - grey).float() / 255
        assert torch.equal(samples["la.png"][3], alpha) and torch.equal(samples["rgba.png"][3], alpha)


def test_without_convert_image_to_a_file_of_other_channels_is_named(tmp_path):
    """convert_image_to=None keeps each file's channels; a file whose channels differ from the first file's (a
    CMYK JPEG among RGB files) is refused naming both, where the batch would otherwise fail later, unnamed."""
    _save(tmp_path / "a.png", np.zeros((6, 6, 3), np.uint8))
    _cmyk_jpeg(tmp_path / "b.jpg")
    Image.fromarray(np.full((6, 6), 255, np.uint8)).convert("1").save(tmp_path / "c.png")
    data = ft.data.ImageFolder(tmp_path, 6)
    assert tuple(data[0].shape) == (3, 6, 6)
    with pytest.raises(ValueError, match=r"ImageFolder: '.*b\.jpg' has mode 'CMYK' \(4 channels\) where the "
                                         r"folder's first image '.*a\.png' has 3 \(mode 'RGB'\).*"
                                         r"convert_image_to='RGB'"):
        data[1]
    grey = ft.data.ImageFolder(tmp_path, 6, convert_image_to="L")
    assert float(grey[2].min()) == 1.0  # a 1-bit image's white is 1.0 (not 1/255)
