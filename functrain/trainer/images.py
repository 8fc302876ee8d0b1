"""PNG output without a plotting library: sample grids (captioned with a tiny built-in font) and loss curves.

zlib + numpy only. For metric plots with axes, ticks and labels use :mod:`functrain.trainer.plots`
(``loss_curve`` here is the old unlabelled sketch, kept for compatibility).
"""
from __future__ import annotations

import math
import os
import struct
import zlib
from typing import Sequence

import numpy as np

from ..checkpoint.safe_io import replace_file

__all__ = ["write_png", "image_grid", "loss_curve", "text_bitmap", "caption", "write_sample_grid", "sample_path"]


def write_png(path: str | os.PathLike, image: np.ndarray) -> None:
    """Write an ``(H, W)`` gray or ``(H, W, 3)`` RGB uint8 array as a PNG file (atomically; a symbolic link at
    ``path`` is refused with :class:`functrain.checkpoint.LinkRefused`)."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] != 3):
        raise ValueError(f"write_png expects uint8 (H, W) or (H, W, 3); got {image.dtype} {image.shape}")
    h, w = image.shape[:2]
    color = 2 if image.ndim == 3 else 0
    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(h))  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    # a new temporary file, then renamed: a viewer never sees half an image, and no link is written through
    replace_file(os.fspath(path), png, what="an image")


def image_grid(images: np.ndarray, pad: int = 1, scale: int = 1) -> np.ndarray:
    """Tile ``n`` images (a perfect square) into a ``sqrt(n) x sqrt(n)`` uint8 grid.

    ``images`` is ``(n, H, W)``, ``(n, 1, H, W)`` or ``(n, 3, H, W)`` with values in
    [0, 1] (clipped). Each image is enlarged ``scale`` times; ``pad`` pixels of
    black separate them.
    """
    images = np.asarray(images, dtype=np.float32)
    if images.ndim == 4 and images.shape[1] == 1:
        images = images[:, 0]
    n = images.shape[0]
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(f"image_grid needs a perfect square number of images; got {n}")
    rgb = images.ndim == 4
    if rgb:
        if images.shape[1] != 3:
            raise ValueError(f"image_grid expects 1 or 3 channels; got {images.shape[1]}")
        images = images.transpose(0, 2, 3, 1)
    images = np.clip(images, 0.0, 1.0)
    images = images.repeat(scale, axis=1).repeat(scale, axis=2)
    h, w = images.shape[1:3]
    shape = (side * (h + pad) + pad, side * (w + pad) + pad) + ((3,) if rgb else ())
    grid = np.zeros(shape, dtype=np.float32)
    for i in range(n):
        r, c = divmod(i, side)
        y, x = pad + r * (h + pad), pad + c * (w + pad)
        grid[y:y + h, x:x + w] = images[i]
    return (grid * 255.0 + 0.5).astype(np.uint8)


def loss_curve(values: Sequence[float], width: int = 640, height: int = 360) -> np.ndarray:
    """An RGB plot of ``values`` (log scale when all positive) as a uint8 array, axes in gray."""
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    margin = 20
    img[height - margin, margin:width - margin] = 128
    img[margin:height - margin, margin] = 128
    if v.size < 2:
        return img
    if (v > 0).all():
        v = np.log10(v)
    lo, hi = float(v.min()), float(v.max())
    span = hi - lo if hi > lo else 1.0
    xs = np.linspace(margin, width - margin - 1, v.size)
    ys = (height - margin - 1) - (v - lo) / span * (height - 2 * margin - 1)
    for x0, y0, x1, y1 in zip(xs[:-1], ys[:-1], xs[1:], ys[1:]):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for t in np.linspace(0.0, 1.0, n):
            x, y = int(round(x0 + t * (x1 - x0))), int(round(y0 + t * (y1 - y0)))
            img[max(y - 1, 0):y + 1, x:x + 1] = (31, 119, 180)
    return img


# A 3 x 5 pixel font: each glyph is five rows, each row a 3-bit number (4 = left pixel, 1 = right pixel).
# Letters are drawn as capitals; enough for captions such as "step 1200" or "ema, step 1200".
_FONT = {
    "0": "75557", "1": "26227", "2": "61247", "3": "61216", "4": "55711", "5": "74616", "6": "34757",
    "7": "71222", "8": "75757", "9": "75716",
    "a": "25755", "b": "65656", "c": "34443", "d": "65556", "e": "74647", "f": "74644", "g": "34553",
    "h": "55755", "i": "72227", "j": "11152", "k": "55655", "l": "44447", "m": "57755", "n": "65555",
    "o": "25552", "p": "65644", "q": "25563", "r": "65655", "s": "34216", "t": "72222", "u": "55557",
    "v": "55552", "w": "55775", "x": "55255", "y": "55222", "z": "71247",
    " ": "00000", "-": "00700", ".": "00002", ":": "02020", "=": "07070", "_": "00007", "/": "11244",
    "(": "12221", ")": "42224", ",": "00024", "+": "02720", "#": "57575",
}


def text_bitmap(text: str, scale: int = 1) -> np.ndarray:
    """``text`` in the built-in 3x5 font as a bool array ``(5 * scale, (4 * len(text) - 1) * scale)``.

    Letters render as capitals; a character outside the font (digits, a-z, space and
    ``-.:=_/(),+#``) raises ``ValueError`` naming it.

    Example::

        >>> text_bitmap("10").astype(int)
        array([[0, 1, 0, 0, 1, 1, 1],
               [1, 1, 0, 0, 1, 0, 1],
               [0, 1, 0, 0, 1, 0, 1],
               [0, 1, 0, 0, 1, 0, 1],
               [1, 1, 1, 0, 1, 1, 1]])
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"text_bitmap needs a non-empty string; got {text!r}")
    bad = sorted({ch for ch in text.lower() if ch not in _FONT})
    if bad:
        raise ValueError(f"text_bitmap: no glyph for {bad}; the font has digits, a-z, space and -.:=_/(),+#")
    out = np.zeros((5, 4 * len(text) - 1), dtype=bool)
    for i, ch in enumerate(text.lower()):
        for r, row in enumerate(_FONT[ch]):
            bits = int(row)
            out[r, 4 * i:4 * i + 3] = [(bits >> 2) & 1, (bits >> 1) & 1, bits & 1]
    return out.repeat(scale, axis=0).repeat(scale, axis=1)


def caption(image: np.ndarray, text: str, scale: int = 2) -> np.ndarray:
    """``image`` (uint8 gray or RGB) with ``text`` written in black on a white strip above it.

    The strip is ``7 * scale`` pixels high; the canvas widens (image centred) when the
    text is wider than the image.

    Example::

        grid = caption(image_grid(images, scale=4), "step 1200")
    """
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim not in (2, 3):
        raise ValueError(f"caption expects a uint8 (H, W) or (H, W, 3) image; got {image.dtype} {image.shape}")
    glyphs = text_bitmap(text, scale)
    h, w = image.shape[:2]
    margin = scale
    width = max(w, glyphs.shape[1] + 2 * margin)
    strip = glyphs.shape[0] + 2 * margin
    out = np.full((strip + h, width) + image.shape[2:], 255, dtype=np.uint8)
    x = (width - w) // 2
    out[strip:, x:x + w] = image
    gx = (width - glyphs.shape[1]) // 2
    region = out[margin:margin + glyphs.shape[0], gx:gx + glyphs.shape[1]]
    region[glyphs] = 0
    return out


def sample_path(folder: str | os.PathLike, step: int) -> str:
    """``folder/sample-<step, 8 digits>.png``: names that sort by step."""
    return os.path.join(os.fspath(folder), f"sample-{int(step):08d}.png")


def write_sample_grid(path: str | os.PathLike, images: np.ndarray, *, step: int | None = None,
                      text: str | None = None, scale: int = 4) -> str:
    """Tile ``images`` (see :func:`image_grid`), caption it with ``text`` or ``"step <step>"``, write a PNG.

    Returns the path. Without ``step`` and ``text`` the grid is written uncaptioned.

    Example::

        write_sample_grid(sample_path("results", 1200), images, step=1200)   # results/sample-00001200.png
    """
    grid = image_grid(images, scale=scale)
    label = text if text is not None else (None if step is None else f"step {int(step)}")
    if label is not None:
        grid = caption(grid, label, scale=max(1, min(scale, 3)))
    write_png(path, grid)
    return os.fspath(path)
