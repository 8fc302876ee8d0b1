"""A folder of images as a dataset (Pillow, an optional extra): what denoising-diffusion-pytorch's Trainer reads.

Each image is opened with Pillow, converted (``convert_image_to``), resized so that its
shorter side is ``image_size`` (bilinear, Pillow's antialiasing filter) and center-cropped
to ``image_size``, then returned as a float32 ``(C, H, W)`` tensor in ``[0, 1]``: the
package's ``Resize``, ``CenterCrop``, ``ToTensor`` pipeline. The horizontal flip is not done
here: it is a transform of the step (:func:`functrain.random_flip`, see
:meth:`ImageFolder.augmentation`), drawn on the device from the state's RNG, so that it
compiles with the step and a resumed run flips what an uninterrupted one would.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.validate import BadValue, check_choice, check_int, describe
from ..transforms.flip import random_flip

__all__ = ["ImageFolder", "IMAGE_EXTENSIONS", "image_files"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "tiff")  # the package's; matched case-insensitively
_8BIT = ("1", "L", "LA", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "HSV")


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("ft.data.ImageFolder reads images with Pillow: pip install 'functrain[images]' (or "
                          "pip install Pillow)") from None
    return Image


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
        convert_image_to: a Pillow mode (``"L"``, ``"RGB"``, ``"RGBA"``) every image is converted to,
            or ``None`` to keep each file's mode (all must then give the same channels).
        exts: the file extensions read.

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
                 exts: tuple[str, ...] = IMAGE_EXTENSIONS):
        Image = _pil()
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
        if convert_image_to is not None and convert_image_to not in Image.MODES:
            raise BadValue(f"ImageFolder: convert_image_to must be None or a Pillow mode ({sorted(Image.MODES)}); "
                           f"got {describe(convert_image_to)}")
        self.convert_image_to = convert_image_to
        self.folder = os.fspath(folder)
        self.paths = image_files(folder, exts)
        if not self.paths:
            raise BadValue(f"ImageFolder: no images ({', '.join('.' + e for e in exts)}) under {self.folder!r}")

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        Image = _pil()
        path = self.paths[index]
        with Image.open(path) as img:
            if self.convert_image_to is not None and img.mode != self.convert_image_to:
                img = img.convert(self.convert_image_to)
            elif img.mode == "P":
                raise BadValue(f"ImageFolder: {str(path)!r} is a palette image (mode 'P'), whose values are colour "
                               f"indices; pass convert_image_to='RGB' (or 'L')")
            if img.mode not in _8BIT:
                raise BadValue(f"ImageFolder: {str(path)!r} has mode {img.mode!r}, not 8 bits per channel; pass "
                               f"convert_image_to (e.g. 'L' or 'RGB')")
            img = self._resize_and_crop(img, Image)
            array = np.array(img, dtype=np.uint8)  # a copy, writable
        if array.ndim == 2:
            array = array[:, :, None]
        return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1))).to(torch.float32).div_(255.0)

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
        if img.size != size:
            img = img.resize(size, Image.BILINEAR)
        w, h = img.size
        if (w, h) != (tw, th):
            top, left = int(round((h - th) / 2.0)), int(round((w - tw) / 2.0))
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
                f"{self.augment_horizontal_flip}, convert_image_to={self.convert_image_to!r}, {len(self)} images)")
