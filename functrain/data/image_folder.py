"""A folder of images as a dataset (Pillow, an optional extra): what denoising-diffusion-pytorch's Trainer reads.

Each image is opened with Pillow, converted (``convert_image_to``), resized so that its
shorter side is ``image_size`` (bilinear, Pillow's antialiasing filter) and center-cropped
to ``image_size``, then returned as a float32 ``(C, H, W)`` tensor in ``[0, 1]``: the
package's ``Resize``, ``CenterCrop``, ``ToTensor`` pipeline. The horizontal flip is not done
here: it is a transform of the step (:func:`functrain.random_flip`, see
:meth:`ImageFolder.augmentation`), drawn on the device from the state's RNG, so that it
compiles with the step and a resumed run flips what an uninterrupted one would.

Memory is bounded by ``max_pixels`` (:data:`MAX_PIXELS` by default): a file with more pixels is
refused from its header, before it is decoded; an image whose shorter-side resize would have
more (an extreme aspect ratio: a 200000x1 PNG at ``image_size=64`` resizes to 12800000x64) has
only its crop's source region resized (Pillow's ``resize(box=...)``), never the whole.
"""
from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.validate import BadValue, check_choice, check_int, describe
from ..transforms.flip import random_flip

__all__ = ["ImageFolder", "IMAGE_EXTENSIONS", "MAX_PIXELS", "image_files"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "tiff")  # the package's; matched case-insensitively
MAX_PIXELS = 2 ** 26  # ImageFolder's default max_pixels: an 8192x8192 image (192 MiB as 8-bit RGB)
_8BIT = ("1", "L", "LA", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "HSV")
_16BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # integer grey read as 16 bits: v * 257 is 8-bit v
_PALETTE = ("P", "PA")


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("ft.data.ImageFolder reads images with Pillow: pip install 'functrain[images]' (or "
                          "pip install Pillow)") from None
    return Image


def _decode_errors(Image: Any) -> tuple[type[BaseException], ...]:
    """What Pillow raises for a file it cannot open or decode (truncated, corrupt, not an image, a bomb)."""
    return (OSError, SyntaxError, ValueError, EOFError, MemoryError, struct.error, zlib.error,
            Image.DecompressionBombError)


def image_files(folder: str | os.PathLike, exts: tuple[str, ...] = IMAGE_EXTENSIONS) -> list[Path]:
    """The image files under ``folder`` (recursively, by extension, case-insensitive), sorted by path.

    Example::

        >>> import tempfile
        >>> from functrain.data.image_folder import image_files
        >>> image_files(tempfile.mkdtemp())
        []
    """
    wanted = {"." + e.lower().lstrip(".") for e in exts}
    root = Path(folder)
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in wanted and p.is_file())


class ImageFolder(torch.utils.data.Dataset):
    """The images under ``folder`` as ``(C, H, W)`` float32 tensors in ``[0, 1]``.

    Args:
        folder: a folder; every ``.jpg``/``.jpeg``/``.png``/``.tiff`` file under it (recursively,
            sorted by path, so the order is the same on every machine) is one sample.
        image_size: an int (the shorter side is resized to it, then a centered square crop) or
            ``(height, width)`` (resized to it, as torchvision's ``Resize`` of a pair).
        augment_horizontal_flip: flip each image horizontally with probability 1/2 at each step
            (denoising-diffusion-pytorch's Trainer default); done by the step, see :meth:`augmentation`.
        convert_image_to: a Pillow mode of 8 bits per channel (``"L"``, ``"RGB"``, ``"RGBA"``, ...) every
            image is converted to, whatever its own mode (CMYK, palette, 16-bit grey, grey with alpha, ...;
            16-bit values are scaled to 8 bits, not clipped), or ``None`` to keep each file's mode (a palette
            or 16-bit file is then refused, and a file whose channels differ from the first file's too,
            naming both).
        exts: the file extensions read.
        max_pixels: the bound on the pixels of one image (default :data:`MAX_PIXELS`, 2**26, an
            8192x8192 image): a file with more is refused, naming it, its size and the bound, from its
            header, before it is decoded; a sample (``image_size``) may not have more either. An image
            whose shorter-side resize would have more has only its crop's source region resized (the
            same pixels within resampling rounding, one step of 1/255); below it the image is resized
            whole, then cropped, exactly as torchvision's ``Resize`` and ``CenterCrop`` do. Raise it for
            larger images (Pillow's own ``PIL.Image.MAX_IMAGE_PIXELS`` check applies as well).

    Raises (when a sample is read):
        ValueError: a file over ``max_pixels``, a palette or 16-bit file without ``convert_image_to``, or
            other channels than the first file's, naming the file.
        OSError: a file Pillow cannot decode (truncated, corrupt), naming it and Pillow's error.

    Example::

        >>> import tempfile, numpy as np
        >>> from PIL import Image
        >>> import functrain as ft
        >>> folder = tempfile.mkdtemp()
        >>> Image.fromarray(np.full((8, 12), 255, np.uint8)).save(f"{folder}/a.png")
        >>> data = ft.data.ImageFolder(folder, image_size=4, convert_image_to="L")
        >>> len(data), tuple(data[0].shape), float(data[0].max())
        (1, (1, 4, 4), 1.0)
        >>> data.augmentation()
        (random_flip(p=0.5, dim=-1),)
    """

    def __init__(self, folder: str | os.PathLike, image_size: int | tuple[int, int], *,
                 augment_horizontal_flip: bool = True, convert_image_to: str | None = None,
                 exts: tuple[str, ...] = IMAGE_EXTENSIONS, max_pixels: int = MAX_PIXELS):
        _pil()  # without Pillow: the error now, not at the first sample
        if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
            raise BadValue(f"ImageFolder: folder must be a folder of images; got {describe(folder)}"
                           + ("" if not isinstance(folder, (str, os.PathLike)) else " (no such folder)"))
        if isinstance(image_size, (tuple, list)) and len(image_size) == 2:
            self.image_size: tuple[int, int] | int = tuple(
                check_int("ImageFolder: image_size", s, minimum=1, what="a positive int or (height, width)")
                for s in image_size)
        else:
            self.image_size = check_int("ImageFolder: image_size", image_size, minimum=1,
                                        what="a positive int or (height, width)")
        self.augment_horizontal_flip = check_choice("ImageFolder: augment_horizontal_flip", augment_horizontal_flip,
                                                    (True, False))
        if convert_image_to is not None and convert_image_to not in _8BIT:
            raise BadValue(f"ImageFolder: convert_image_to must be None or a Pillow mode of 8 bits per channel "
                           f"{_8BIT}; got {describe(convert_image_to)}")
        self.convert_image_to = convert_image_to
        self.max_pixels = check_int("ImageFolder: max_pixels", max_pixels, minimum=1)
        th, tw = self.image_size if isinstance(self.image_size, tuple) else (self.image_size,) * 2
        if th * tw > self.max_pixels:
            raise BadValue(f"ImageFolder: image_size {self.image_size} gives samples of {th * tw} pixels, more than "
                           f"max_pixels={self.max_pixels}; pass a larger max_pixels= or a smaller image_size")
        self._first: tuple[str, str, int] | None = None  # without convert_image_to: the first file's mode
        self.folder = os.fspath(folder)
        self.paths = image_files(folder, exts)
        if not self.paths:
            raise BadValue(f"ImageFolder: no images ({', '.join('.' + e for e in exts)}) under {self.folder!r}")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        Image = _pil()
        path = self.paths[index]
        try:
            with Image.open(path) as img:
                w, h = img.size  # from the header: nothing is decoded yet
                if w * h > self.max_pixels:
                    raise BadValue(f"ImageFolder: {str(path)!r} is {w}x{h} pixels ({w * h}), more than "
                                   f"max_pixels={self.max_pixels} (the bound on one image); pass "
                                   f"ImageFolder(..., max_pixels=) at least {w * h} to read it")
                img = self._converted(path, img, Image)
                img = self._resize_and_crop(img, Image)
                if img.mode == "1":
                    img = img.convert("L")  # 0 or 255, not 0 or 1
                array = np.array(img, dtype=np.uint8)  # a copy, writable
        except BadValue:
            raise
        except _decode_errors(Image) as e:
            raise OSError(f"ImageFolder: cannot read {str(path)!r} ({type(e).__name__}: {e})") from e
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))).to(torch.float32).div_(255.0)

    def _converted(self, path: Path, img: Any, Image: Any) -> Any:
        """``img`` in ``convert_image_to`` (any mode: 16-bit grey scaled to 8 bits), or checked without it."""
        target = self.convert_image_to
        if target is None:
            if img.mode in _PALETTE:
                raise BadValue(f"ImageFolder: {str(path)!r} is a palette image (mode {img.mode!r}), whose values are "
                               f"colour indices; pass convert_image_to='RGB' (or 'L')")
            if img.mode not in _8BIT:
                raise BadValue(f"ImageFolder: {str(path)!r} has mode {img.mode!r}, not 8 bits per channel; pass "
                               f"convert_image_to (e.g. 'L' or 'RGB')")
            self._check_channels(path, img.mode, Image)
            return img
        if img.mode == target:
            return img
        if img.mode in _16BIT:
            grey = np.asarray(img).astype(np.int32).clip(0, 65535)
            img = Image.fromarray(((grey + 128) // 257).astype(np.uint8), mode="L")  # round(v / 257)
            if target == "L":
                return img
        try:
            return img.convert(target)
        except ValueError:  # no direct conversion (LAB -> L, La -> RGB): through RGBA, or LA
            via = "LA" if img.mode == "La" else "RGBA"
            return img.convert(via).convert(target)

    def _check_channels(self, path: Path, mode: str, Image: Any) -> None:
        """Without ``convert_image_to``: this file's channels must be the folder's first file's."""
        if self._first is None:
            first = self.paths[0]
            try:
                with Image.open(first) as img:  # its header: the mode
                    self._first = (str(first), img.mode, Image.getmodebands(img.mode))
            except _decode_errors(Image):
                return  # the first file's own read names it
        name, first_mode, channels = self._first
        mine = Image.getmodebands(mode)
        if mine != channels:
            suggest = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}.get(channels, "RGB")
            raise BadValue(f"ImageFolder: {str(path)!r} has mode {mode!r} ({mine} channels) where the folder's first "
                           f"image {name!r} has {channels} (mode {first_mode!r}): samples of other channels cannot "
                           f"be batched together; pass convert_image_to={suggest!r}")

    def _resize_and_crop(self, img: Any, Image: Any) -> Any:
        w, h = img.size
        if isinstance(self.image_size, tuple):
            th, tw = self.image_size
            size = (tw, th)
        else:
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = self.image_size, int(self.image_size * long / short)
            size = (new_short, new_long) if w <= h else (new_long, new_short)
            th = tw = self.image_size
        top, left = int(round((size[1] - th) / 2.0)), int(round((size[0] - tw) / 2.0))
        if size[0] * size[1] > self.max_pixels:
            # only the crop's source region: the same sample positions as the whole resize, never allocated
            sx, sy = w / size[0], h / size[1]
            return img.resize((tw, th), Image.BILINEAR, box=(left * sx, top * sy, (left + tw) * sx, (top + th) * sy))
        if img.size != size:
            img = img.resize(size, Image.BILINEAR)
        if size != (tw, th):
            img = img.crop((left, top, left + tw, top + th))
        return img

    def augmentation(self) -> tuple:
        """The step transforms this dataset's augmentation needs (``ft.Trainer`` adds them to its step).

        Returns:
            ``(ft.random_flip(),)`` with ``augment_horizontal_flip``, else ``()``.
        """
        return (random_flip(0.5, dim=-1),) if self.augment_horizontal_flip else ()

    def __repr__(self) -> str:
        return (f"ImageFolder({self.folder!r}, image_size={self.image_size}, augment_horizontal_flip="
                f"{self.augment_horizontal_flip}, convert_image_to={self.convert_image_to!r}, "
                f"max_pixels={self.max_pixels}, {len(self)} images)")
