"""PNG output without a plotting library: sample grids and loss curves (zlib + numpy only)."""
from __future__ import annotations

import math
import os
import struct
import zlib
from typing import Sequence

import numpy as np

__all__ = ["write_png", "image_grid", "loss_curve"]


def write_png(path: str | os.PathLike, image: np.ndarray) -> None:
    """Write an ``(H, W)`` gray or ``(H, W, 3)`` RGB uint8 array as a PNG file."""
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
    with open(path, "wb") as f:
        f.write(png)


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
