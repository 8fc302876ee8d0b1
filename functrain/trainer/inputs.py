"""What :class:`functrain.Trainer` is given, resolved before anything runs: the dataset (a folder of images
becomes an :class:`~functrain.data.ImageFolder`, a string that is not one is refused), the batch each process
loads (``TrainConfig.split_batches``), the module's final and EMA weights.
"""
from __future__ import annotations

import copy
import os
from typing import Any

import torch

from ..core.module import to_module
from ..core.transform import Transform
from ..core.validate import BadValue
from ..data.image_folder import IMAGE_EXTENSIONS, ImageFolder, image_files
from .config import TrainConfig

__all__ = ["resolve_dataset", "augmentation", "with_augmentation", "process_batch", "batch_line", "load_weights",
           "ema_copy"]

_ACCEPTED = ("a map-style dataset (len and getitem), an iterable dataset, a torch DataLoader, in-memory columns (a "
             "TensorDataset, a tuple or dict of tensors / numpy arrays), or a folder of images (its path, or "
             "ft.data.ImageFolder(folder, image_size))")
_CHANNELS_MODE = {1: "L", 3: "RGB", 4: "RGBA"}  # denoising-diffusion-pytorch's default convert_image_to


def resolve_dataset(dataset: Any, model: Any, **folder_options: Any) -> Any:
    """``dataset`` as the trainer loads it: a path (``str`` / ``os.PathLike``) must be a folder of images and
    becomes ``ImageFolder(path, model.image_size, convert_image_to=<from model.channels>)`` with horizontal
    flips, as denoising-diffusion-pytorch's ``Trainer(diffusion, folder)`` reads it (its ``GaussianDiffusion``
    has ``image_size`` and ``channels``); anything else is returned as it is. ``folder_options``
    (``augment_horizontal_flip``, ``convert_image_to``: the package's ``Trainer`` arguments) replace those defaults
    and are refused for a dataset that is not a path.

    Raises ``ValueError`` naming what is accepted for a path that is not a folder of images, or when the model
    does not say the image size.

    Example::

        >>> from functrain.trainer.inputs import resolve_dataset
        >>> resolve_dataset("no/such/folder", None)
        Traceback (most recent call last):
        ...
        functrain.core.validate.BadValue: Trainer(dataset='no/such/folder'): a path is read as a folder of images, and this one is not there. ...
    """
    if not isinstance(dataset, (str, bytes, os.PathLike)):
        if folder_options:
            names = ", ".join(f"{k}={v!r}" for k, v in folder_options.items())
            raise BadValue(f"Trainer({names}) says how the Trainer reads a folder of images (a path); this dataset "
                           f"is a {type(dataset).__name__}: make it ft.data.ImageFolder(folder, image_size, {names})")
        return dataset
    dataset = shown = os.fsdecode(dataset)
    exts = ", ".join("." + e for e in IMAGE_EXTENSIONS)
    if not os.path.isdir(dataset):
        what = "a file" if os.path.isfile(dataset) else "not there"
        raise BadValue(f"Trainer(dataset={shown!r}): a path is read as a folder of images, and this one is {what}. "
                       f"The dataset may be {_ACCEPTED}")
    if not image_files(dataset):
        raise BadValue(f"Trainer(dataset={shown!r}): a path is read as a folder of images, and it has no {exts} "
                       f"files. The dataset may be {_ACCEPTED}")
    size = getattr(model, "image_size", None)  # denoising-diffusion-pytorch's GaussianDiffusion says it
    if size is None:
        raise BadValue(f"Trainer(dataset={shown!r}): to read a folder of images the trainer needs their size, and "
                       f"the model has no image_size (denoising-diffusion-pytorch's GaussianDiffusion has one): pass "
                       f"ft.data.ImageFolder({shown!r}, image_size=...)")
    size = tuple(size) if isinstance(size, (tuple, list)) else size
    options = {"augment_horizontal_flip": True,
               "convert_image_to": _CHANNELS_MODE.get(getattr(model, "channels", None))}
    options.update({k: v for k, v in folder_options.items() if v is not None})  # (None: the model's channels)
    return ImageFolder(dataset, size, **options)


def augmentation(dataset: Any) -> tuple:
    """The step transforms the dataset asks for (an :class:`ImageFolder`'s flips, also inside a DataLoader)."""
    inner = dataset.dataset if isinstance(dataset, torch.utils.data.DataLoader) else dataset
    return inner.augmentation() if isinstance(inner, ImageFolder) else ()


def with_augmentation(dataset: Any, transforms: Any, step: Any) -> Any:
    """The user's ``transforms`` plus the dataset's augmentation (an ImageFolder's flips happen in the step)."""
    extra = augmentation(dataset)
    if not extra:
        return transforms
    names = ", ".join(repr(t) for t in extra)
    if step is not None:
        raise ValueError(f"the dataset augments inside the step ({names}), and Trainer(step=...) uses its step as "
                         f"is: build {names} into that step, or make the dataset with augment_horizontal_flip=False")
    transforms = (transforms,) if isinstance(transforms, Transform) else tuple(transforms)
    clash = [t for t in transforms if isinstance(t, Transform) and t.name in {x.name for x in extra}]
    if clash:
        raise ValueError(f"Trainer(transforms=...) has {clash[0]!r} and the dataset adds {names} too: drop one "
                         f"(ImageFolder(augment_horizontal_flip=False) keeps yours)")
    return (*extra, *transforms)


def process_batch(config: TrainConfig, world: int, size: int | None = None, field: str = "train_batch_size") -> int:
    """The rows one process loads per micro-step for ``size`` (default ``config.train_batch_size``).

    ``split_batches=False`` (the default): ``size`` itself, per process. ``split_batches=True``: ``size`` is
    global, ``size / world`` per process, and a size that does not divide is an error naming the numbers.

    Example::

        >>> import functrain as ft
        >>> from functrain.trainer.inputs import process_batch
        >>> process_batch(ft.TrainConfig(train_batch_size=32, split_batches=True), world=2)
        16
    """
    size = config.train_batch_size if size is None else size
    if not config.split_batches or world == 1:
        return size
    if size % world:
        a = config.gradient_accumulate_every
        options = sorted({max(world, size - size % world), size - size % world + world})
        if field == "train_batch_size":
            raise BadValue(
                f"TrainConfig(split_batches=True) makes train_batch_size global: an update takes train_batch_size * "
                f"gradient_accumulate_every = {size} * {a} = {size * a} samples, which must divide by processes * "
                f"gradient_accumulate_every = {world} * {a} = {world * a} (each process loads train_batch_size / "
                f"processes rows per micro-step); train_batch_size={size} does not divide by {world} processes. Use a "
                f"multiple of {world} (e.g. {' or '.join(map(str, options))}), or split_batches=False "
                f"(train_batch_size per process)")
        raise BadValue(f"TrainConfig(split_batches=True) makes {field} global: {field}={size} must divide by the "
                       f"{world} processes; use a multiple of {world} (e.g. {' or '.join(map(str, options))})")
    return size // world


def batch_line(config: TrainConfig, world: int, per_process: int) -> str:
    """The batch rule as numbers, printed by rank 0 of a multi-process trainer.

    Example::

        >>> import functrain as ft
        >>> from functrain.trainer.inputs import batch_line
        >>> batch_line(ft.TrainConfig(train_batch_size=32, gradient_accumulate_every=2), 2, 32)
        'functrain: 128 samples per update = 32 per process per micro-step x 2 processes x gradient_accumulate_every 2 (train_batch_size=32 is per process; TrainConfig(split_batches=True) makes it global)'
    """
    a = config.gradient_accumulate_every
    meaning = "global (split_batches=True)" if config.split_batches else \
        "per process; TrainConfig(split_batches=True) makes it global"
    return (f"functrain: {per_process * a * world} samples per update = {per_process} per process per micro-step "
            f"x {world} processes x gradient_accumulate_every {a} (train_batch_size={config.train_batch_size} is "
            f"{meaning})")


def load_weights(module: torch.nn.Module, params: dict, buffers: dict | None, initial: dict,
                 initial_buffers: dict | None) -> tuple[dict, dict | None]:
    """The trained ``params`` (and ``buffers``) into ``module``'s own tensors, in place (``ft.to_module``).

    ``initial`` / ``initial_buffers`` (the trainer's initial params, which share the module's storage as
    :func:`functrain.functionalize` made them) are returned as copies first where they do share it, so
    that the trainer's initial state is still the initial one. Returns them.
    """
    ptrs = {t.data_ptr() for t in [*module.parameters(), *module.buffers()] if t.numel()}

    def keep(tree: dict | None) -> dict | None:
        if tree is None:
            return None
        return {k: v.clone() if isinstance(v, torch.Tensor) and v.numel() and v.data_ptr() in ptrs else v
                for k, v in tree.items()}

    initial, initial_buffers = keep(initial), keep(initial_buffers)
    to_module(module, dict(params), dict(buffers or {}))
    return initial, initial_buffers


def ema_copy(module: torch.nn.Module | None, cached: torch.nn.Module | None, ema: dict | None,
             state: Any) -> torch.nn.Module:
    """A copy of ``module`` (``cached``, or a deep copy made now) holding ``ema`` (default: ``state.ema``, with
    ``state.buffers``), in eval mode, its parameters not requiring grad (as ema-pytorch's ``ema_model``)."""
    if module is None:
        raise TypeError("Trainer.ema_module() needs a Trainer built from an nn.Module (this one trains a loss_fn; "
                        "use ft.to_module(your_module, state.ema))")
    buffers = None
    if ema is None:
        if state is None:
            raise ValueError("Trainer.ema_module(): no EMA yet: call train() first, or pass ema_params")
        ema, buffers = state.ema, state.buffers
        if ema is None:
            raise ValueError("Trainer.ema_module(): this trainer's step has no ft.ema (a step= without one)")
    if cached is None:
        cached = copy.deepcopy(module)
        for p in cached.parameters():
            p.requires_grad_(False)
    to_module(cached, dict(ema), dict(buffers or {}))
    return cached.eval()
