"""``TrainConfig``: the trainer's hyper-parameters, validated, saved beside checkpoints as YAML or JSON."""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ..checkpoint.bounded import load_yaml, loads_json
from ..checkpoint.safe_io import replace_file
from ..core.validate import BadValue, bounded_repr, check_choice, check_int, check_real, describe, is_real
from .trackers import TRACKERS, check_trackers

__all__ = ["TrainConfig", "package_config", "PACKAGE_DEFAULTS", "FOLDER_OPTIONS"]

_PRECISIONS = ("no", "bf16", "fp16")
_SCHEDULES = ("constant", "warmup_cosine", "warmup_linear")
_SHARDS = ("none", "optimizer", "params")
_BEST = ("eval_loss", "eval_loss_ema")  # keep_best: the metric that ranks checkpoints, lower is better
_SEED_MAX = 2**63 - 1  # the generator seeds of step.init and ft.shard
# save_timeout: a week. Far past any real save, and safe for the timers it feeds: datetime.timedelta overflows
# near 1e14 s and gloo's nanosecond clocks near 9.2e9 s (a 1e300 s timeout used to pass here, then fail at
# train() with an OverflowError on several processes)
_SAVE_TIMEOUT_MAX = 7 * 24 * 3600.0
_CONFIG_MAX_BYTES = 1 << 20  # a config file is a few hundred bytes


@dataclass(frozen=True)
class TrainConfig:
    """The hyper-parameters of :class:`functrain.Trainer`, checked when constructed.

    Field names follow the trainers users know (``train_batch_size``,
    ``gradient_accumulate_every``, ...: denoising-diffusion-pytorch's); a name this
    config does not have is refused with the functrain name that does the job
    (``amp`` -> ``mixed_precision``) or says it is not provided (``calculate_fid``).

    Batch size, one rule: an optimizer update sees ``train_batch_size *
    gradient_accumulate_every`` samples *per process* (so ``* processes`` in all):
    ``train_batch_size`` is one micro-step of one process. ``split_batches=True``
    makes it global, as denoising-diffusion-pytorch's Trainer (accelerate's
    ``split_batches``): each process takes ``train_batch_size / processes`` samples per
    micro-step, an update sees ``train_batch_size * gradient_accumulate_every`` samples
    whatever the process count (the Trainer refuses a ``train_batch_size`` that does not
    divide by the processes, and ``eval_batch_size`` is global too).

    EMA: ``ema(ema_decay, every=ema_update_every)`` counted in applied updates, copying
    the params for the first ``ema_update_after_step`` updates, then warming the decay
    up as ``1 - (1 + t / ema_inv_gamma) ** -ema_power`` (``t`` updates after the copies),
    capped at ``ema_decay``: ema-pytorch's defaults, with which denoising-diffusion-pytorch
    trains (``ema_power=None``: the constant ``ema_decay`` from the first update).

    Checkpoints: the newest ``keep_checkpoints`` are kept; ``keep_best`` (``"eval_loss"`` or ``"eval_loss_ema"``)
    also keeps the one whose step's evaluation was the lowest (every save must evaluate: ``eval_every`` 0 or a
    divisor of ``save_and_sample_every``); ``keep_best="eval_loss_ema", keep_checkpoints=1`` is the package's
    ``save_best_and_latest_only``.

    ``num_samples`` must be a
    perfect square: samples are tiled into a ``sqrt(n) x sqrt(n)`` grid. Every
    field is checked here (a :class:`ValueError` that is also a ``TypeError``
    names the field, what is allowed and the value), not later in ``train()``.

    Faults: ``skip_nonfinite`` (default on) drops an update whose loss or
    gradient is not finite (fp16 does it through its loss scale), and the
    trainer warns with the count; ``max_consecutive_nonfinite`` such updates in
    a row stop the run with an error. ``save_timeout`` is how many seconds the
    other processes wait for rank 0 to write a checkpoint and its samples.

    Learning rate: ``lr_schedule`` is ``"constant"`` (``train_lr``, after a linear
    warmup over ``warmup_steps`` updates if > 0), ``"warmup_cosine"`` or
    ``"warmup_linear"`` (linear warmup from 0 to ``train_lr`` over
    ``warmup_steps``, then a cosine or linear decay to ``min_lr`` at
    ``train_num_steps``). The lr of each update is logged as ``lr``.

    Evaluation (with ``Trainer(eval_dataset=...)``): every ``eval_every`` updates
    (0: at every save) and at the end, the mean loss over the whole eval set
    (each sample once, across processes) with the params (``eval_loss``) and the
    EMA params (``eval_loss_ema``), in batches of ``eval_batch_size`` per
    process (``None``: ``train_batch_size``).

    Compiling (``compile``, default on): the step is compiled whole (:func:`functrain.compile`).
    With ``compile_background`` (default on) the first steps run eagerly while it compiles in a
    worker process, and the compiled step takes over when it is ready (on several processes, at the
    same step on every rank): training starts at once, and the last bits of the run depend on the
    step at which the switch happened. ``compile_switch_at=N`` makes that step fixed, for a run that
    must be reproducible bit for bit (its resume included): steps up to ``N`` run eagerly, step
    ``N + 1`` on waits for the compiled code. ``compile_background=False``: the first step compiles
    and training waits for it. Whether a background compile starts at all is the compile policy's
    decision after the first steps (``compile_policy``: ``"auto"``; ``"always"`` or ``"never"`` force
    it; ``None``: ``FUNCTRAIN_COMPILE_POLICY``, default ``"auto"``; see docs/compiling.md).
    ``compile_package=True`` (default off): :meth:`~functrain.Trainer.precompile` builds the step as a package in
    functrain's private folder, and a later run of the same model and shapes (any length, learning rate,
    warm-up, ...) runs it from its first step, without a trace or the compiler's imports (checked against the
    eager step at that step); a run that compiles in the background leaves a package for the next run
    (:mod:`functrain.compiler.later`). On a GPU a step with collectives (several processes) is not packaged. Off:
    a precompile fills inductor's caches, which a later run loads after its trace.

    Args:
        **fields: keyword arguments, one per field (the dataclass fields below: ``train_batch_size``, ``train_lr``,
            ``train_num_steps``, ``gradient_accumulate_every``, ``ema_decay``, ... each with its default); the table of
            every field, its default and what it allows is docs/trainer.md, "The config". Positional arguments
            follow the fields' order; an unknown name is refused naming the functrain name that does the job.

    Example::

        >>> from functrain import TrainConfig
        >>> cfg = TrainConfig(train_batch_size=32, train_num_steps=1000, num_samples=16)
        >>> cfg.replace(train_lr=3e-4).train_lr
        0.0003
        >>> TrainConfig(num_samples=10)
        Traceback (most recent call last):
        ...
        functrain.core.validate.BadValue: TrainConfig.num_samples must be a perfect square (samples are tiled into a square grid); got 10
    """

    train_batch_size: int = 16
    gradient_accumulate_every: int = 1
    train_lr: float = 1e-4
    train_num_steps: int = 100_000
    adam_betas: tuple = (0.9, 0.99)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    ema_update_every: int = 10
    ema_decay: float = 0.995
    ema_update_after_step: int = 100
    ema_power: float | None = 2 / 3
    ema_inv_gamma: float = 1.0
    save_and_sample_every: int = 1000
    num_samples: int = 25
    mixed_precision: str = "no"
    results_folder: str = "./results"
    seed: int = 0
    log_every: int = 10
    keep_checkpoints: int = 3
    keep_best: str | None = None
    compile: bool = True
    trackers: tuple = field(default=("jsonl",))
    skip_nonfinite: bool = True
    max_consecutive_nonfinite: int = 100
    save_timeout: float = 1800.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    eval_every: int = 0
    eval_batch_size: int | None = None
    shard: str = "none"
    compile_background: bool = True
    compile_package: bool = False
    compile_switch_at: int | None = None
    compile_policy: str | None = None
    split_batches: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "TrainConfig":
        # before the dataclass __init__ sees the names: an unknown one gets its functrain name, not
        # Python's bare "unexpected keyword argument"
        check_names(kwargs, "TrainConfig")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        def name(n: str) -> str:
            return f"TrainConfig.{n}"

        for n in ("train_batch_size", "gradient_accumulate_every", "train_num_steps", "ema_update_every",
                  "save_and_sample_every", "num_samples", "log_every", "keep_checkpoints",
                  "max_consecutive_nonfinite"):
            object.__setattr__(self, n, check_int(name(n), getattr(self, n), minimum=1, what="a positive int"))
        for n in ("train_lr", "max_grad_norm"):
            object.__setattr__(self, n, check_real(name(n), getattr(self, n), lo=0.0, lo_open=True,
                                                  what="a positive number (finite)"))
        object.__setattr__(self, "save_timeout", check_real(
            name("save_timeout"), self.save_timeout, lo=0.0, hi=_SAVE_TIMEOUT_MAX, lo_open=True,
            what=f"a positive number of seconds, at most {_SAVE_TIMEOUT_MAX:g} (a week: the other processes' wait "
                 f"for a save stays a bounded wait, within what the collectives' timers can hold)"))
        object.__setattr__(self, "weight_decay", check_real(name("weight_decay"), self.weight_decay, lo=0.0,
                                                            what="a finite number >= 0"))
        root = math.isqrt(self.num_samples)
        if root * root != self.num_samples:
            raise BadValue(f"TrainConfig.num_samples must be a perfect square (samples are tiled into a square "
                           f"grid); got {self.num_samples}")
        object.__setattr__(self, "ema_decay", check_real(name("ema_decay"), self.ema_decay, lo=0.0, hi=1.0,
                                                         lo_open=True, hi_open=True, what="in (0, 1)"))
        object.__setattr__(self, "ema_update_after_step", check_int(
            name("ema_update_after_step"), self.ema_update_after_step, minimum=0,
            what="an int >= 0 (updates that copy the params before the EMA averages)"))
        if self.ema_power is not None:
            object.__setattr__(self, "ema_power", check_real(name("ema_power"), self.ema_power, lo=0.0, lo_open=True,
                                                             what="a number > 0 (finite), or None: no warm-up"))
        object.__setattr__(self, "ema_inv_gamma", check_real(name("ema_inv_gamma"), self.ema_inv_gamma, lo=0.0,
                                                             lo_open=True, what="a positive number (finite)"))
        if self.ema_power is None and self.ema_inv_gamma != 1.0:
            raise BadValue(f"TrainConfig.ema_inv_gamma shapes the EMA warm-up, which ema_power turns on; with "
                           f"ema_power=None it would be unused; got {self.ema_inv_gamma}")
        betas = tuple(self.adam_betas) if isinstance(self.adam_betas, (list, tuple)) else None
        if betas is None or len(betas) != 2 or not all(is_real(b) and 0.0 <= b < 1.0 for b in betas):
            raise BadValue(f"TrainConfig.adam_betas must be two numbers in [0, 1); got {describe(self.adam_betas)}")
        object.__setattr__(self, "adam_betas", tuple(float(b) for b in betas))
        check_choice(name("mixed_precision"), self.mixed_precision, _PRECISIONS)
        object.__setattr__(self, "seed", check_int(name("seed"), self.seed, minimum=0, maximum=_SEED_MAX,
                                                   what="an int in [0, 2**63)"))
        folder = self.results_folder
        if not isinstance(folder, (str, os.PathLike)) or not isinstance(os.fspath(folder), str) \
                or not os.fspath(folder).strip() or "\0" in os.fspath(folder):
            raise BadValue(f"TrainConfig.results_folder must be a non-empty path (str or os.PathLike); got "
                           f"{describe(folder)}")
        object.__setattr__(self, "results_folder", os.fspath(folder))
        for n in ("compile", "skip_nonfinite", "compile_background", "split_batches"):
            check_choice(name(n), getattr(self, n), (True, False))
        if self.compile_switch_at is not None:
            object.__setattr__(self, "compile_switch_at", check_int(
                name("compile_switch_at"), self.compile_switch_at, minimum=0,
                what="an int >= 0 (the updates run eagerly before the compiled step takes over) or None"))
            if not (self.compile and self.compile_background):
                raise BadValue(f"TrainConfig.compile_switch_at={self.compile_switch_at} is when a background compile "
                               f"takes over; it needs compile=True and compile_background=True (got compile="
                               f"{self.compile}, compile_background={self.compile_background})")
        check_choice(name("compile_policy"), self.compile_policy, (None, "auto", "always", "never"))
        check_choice(name("lr_schedule"), self.lr_schedule, _SCHEDULES)
        check_choice(name("shard"), self.shard, _SHARDS)
        object.__setattr__(self, "warmup_steps", check_int(name("warmup_steps"), self.warmup_steps, minimum=0,
                                                           what="an int >= 0 (updates)"))
        object.__setattr__(self, "min_lr", check_real(name("min_lr"), self.min_lr, lo=0.0, hi=self.train_lr,
                                                      what=f"a number in [0, train_lr={self.train_lr:g}]"))
        if self.lr_schedule == "constant":
            if self.min_lr:
                raise BadValue(f"TrainConfig.min_lr is the final lr of a decaying lr_schedule ('warmup_cosine' or "
                               f"'warmup_linear'); with lr_schedule='constant' it would be unused; got {self.min_lr}")
            if self.warmup_steps > self.train_num_steps:
                raise BadValue(f"TrainConfig.warmup_steps must be <= train_num_steps={self.train_num_steps}; got "
                               f"{self.warmup_steps}")
        elif self.warmup_steps >= self.train_num_steps:
            raise BadValue(f"TrainConfig.warmup_steps must be < train_num_steps={self.train_num_steps} with "
                           f"lr_schedule={self.lr_schedule!r} (the decay needs at least one update); got "
                           f"{self.warmup_steps}")
        object.__setattr__(self, "eval_every", check_int(name("eval_every"), self.eval_every, minimum=0,
                                                         what="an int >= 0 (updates; 0: at every save)"))
        if self.keep_best is not None:
            check_choice(name("keep_best"), self.keep_best, _BEST + (None,))
            if self.eval_every and self.save_and_sample_every % self.eval_every:
                raise BadValue(f"TrainConfig.keep_best={self.keep_best!r} ranks each checkpoint by its step's "
                               f"evaluation, so every save must evaluate: eval_every=0 (at each save) or a divisor "
                               f"of save_and_sample_every={self.save_and_sample_every}; got eval_every="
                               f"{self.eval_every}")
        if self.eval_batch_size is not None:
            object.__setattr__(self, "eval_batch_size", check_int(name("eval_batch_size"), self.eval_batch_size,
                                                                  minimum=1, what="a positive int or None"))
        trackers = (self.trackers,) if isinstance(self.trackers, str) else self.trackers
        if not isinstance(trackers, (tuple, list)):
            raise BadValue(f"TrainConfig.trackers must be a tracker name or a tuple of them from {TRACKERS}; "
                           f"got {describe(self.trackers)}")
        objects = [t for t in trackers if not isinstance(t, str)]
        if objects:
            raise BadValue(f"TrainConfig.trackers holds tracker names only (the config is saved as JSON); pass "
                           f"tracker objects as Trainer(trackers=[...]); got {describe(objects[0], 120)}")
        try:
            check_trackers(trackers)
        except ValueError as e:
            raise BadValue(f"TrainConfig.trackers: {e}") from None
        if len(set(trackers)) != len(trackers):
            raise BadValue(f"TrainConfig.trackers: each tracker once; got {tuple(trackers)}")
        object.__setattr__(self, "trackers", tuple(trackers))

    # -- conversions -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Plain JSON/YAML-able values (tuples become lists)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """Build from a dict; an unknown key raises ``ValueError`` naming it."""
        if not isinstance(data, dict):
            raise ValueError(f"TrainConfig.from_dict expects a mapping; got {type(data).__name__}")
        check_names(data, "TrainConfig.from_dict")
        values = dict(data)
        for key in ("adam_betas", "trackers"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        return cls(**values)

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def save(self, path: str | os.PathLike) -> None:
        """Write as YAML (``.yaml``/``.yml``, needs PyYAML) or JSON (anything else), atomically.

        Written through a new temporary file renamed over ``path``; a symbolic link at ``path`` is refused
        (:class:`functrain.checkpoint.LinkRefused`, an ``OSError``), nothing is written through it.
        """
        path = os.fspath(path)
        if path.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        else:
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        replace_file(path, text.encode("utf-8"), fsync=True, what="the run's config")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrainConfig":
        """Read a YAML or JSON file written by :meth:`save` (or by hand).

        Plain data only, bounded: at most 1 MiB; YAML through a safe loader that refuses every tag but
        plain data (``!!python/...`` included) and documents whose aliases expand past 10,000 values, JSON
        under :func:`functrain.checkpoint.bounded.loads_json`'s memory bound. A refusal is a ``ValueError``
        naming the file, the line and why.
        """
        path = os.fspath(path)
        with open(path, "rb") as f:
            raw = f.read(_CONFIG_MAX_BYTES + 1)
        if len(raw) > _CONFIG_MAX_BYTES:
            raise BadValue(f"{path}: more than {_CONFIG_MAX_BYTES} bytes: not a TrainConfig file")
        if path.endswith((".yaml", ".yml")):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadValue(f"{path}: not UTF-8 text ({e})") from None
            data = load_yaml(text, path, error=BadValue)
        else:
            data = loads_json(raw, path, error=BadValue)
        return cls.from_dict(data)

    def diff(self, other: "TrainConfig") -> dict:
        """``{field: (self's value, other's value)}`` for every field that differs."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


# Names of other trainers (denoising-diffusion-pytorch's Trainer first, then accelerate / Hugging Face /
# ema-pytorch) and what does their job here; anything else gets difflib's closest field names.
_RENAMED = {
    "lr": "train_lr", "learning_rate": "train_lr",
    "batch_size": "train_batch_size", "per_device_train_batch_size": "train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulate_every",
    "num_steps": "train_num_steps", "max_steps": "train_num_steps",
    "betas": "adam_betas", "clip_grad_norm": "max_grad_norm", "grad_clip": "max_grad_norm",
    "beta": "ema_decay", "ema_beta": "ema_decay", "update_every": "ema_update_every",
    "update_after_step": "ema_update_after_step", "inv_gamma": "ema_inv_gamma", "power": "ema_power",
    "results_dir": "results_folder", "output_dir": "results_folder", "save_every": "save_and_sample_every",
    "warmup": "warmup_steps", "lr_warmup_steps": "warmup_steps",
}
_NO_FID = "not provided: ft.Trainer computes no FID (Trainer(eval_dataset=...) logs the held-out loss of the " \
          "params and the EMA; an on_save hook can score the sample grids): FID needs Inception-v3 weights, which " \
          "pytorch-fid, torch-fidelity and the package download at run time"
_ELSEWHERE = {
    "amp": "use mixed_precision='bf16' or 'fp16' (amp=True, mixed_precision_type=X is mixed_precision=X)",
    "mixed_precision_type": "use mixed_precision ('no', 'bf16' or 'fp16')",
    "fp16": "use mixed_precision='fp16'", "bf16": "use mixed_precision='bf16'",
    "calculate_fid": _NO_FID, "num_fid_samples": _NO_FID, "inception_block_idx": _NO_FID,
    "save_best_and_latest_only": "use keep_best='eval_loss_ema' and keep_checkpoints=1 (the checkpoint with the best "
                                 "held-out loss beside the newest; needs Trainer(eval_dataset=...))",
    "augment_horizontal_flip": "an argument of the dataset, ft.data.ImageFolder(folder, image_size, "
                               "augment_horizontal_flip=True); a folder given to ft.Trainer flips, as the package's "
                               "Trainer does",
    "convert_image_to": "an argument of the dataset, ft.data.ImageFolder(folder, image_size, convert_image_to='RGB')",
    "folder": "the dataset argument: ft.Trainer(model, folder, config)",
    "diffusion_model": "the model argument: ft.Trainer(model, dataset, config)",
}


def _hint(name: Any, known: list[str]) -> str:
    if not isinstance(name, str):
        return "field names are strings"
    if name in _RENAMED:
        return f"use {_RENAMED[name]}"
    if name in _ELSEWHERE:
        return _ELSEWHERE[name]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f"did you mean {' or '.join(close)}?" if close else "no such field"


def check_names(names: Any, where: str) -> None:
    """Raise :class:`BadValue` for names that are not :class:`TrainConfig` fields, saying what to use instead.

    Args:
        names: the names given (keyword arguments, or a dict's keys).
        where: what was given them, for the message (``"TrainConfig"``, ``"TrainConfig.from_dict"``).

    Example::

        >>> from functrain.trainer.config import check_names
        >>> check_names({"amp": True}, "TrainConfig")
        Traceback (most recent call last):
        ...
        functrain.core.validate.BadValue: TrainConfig has no field 'amp': use mixed_precision='bf16' or 'fp16' ...
    """
    known = [f.name for f in fields(TrainConfig)]
    unknown = [n for n in names if n not in known]
    if len(unknown) == 1 and where in ("TrainConfig", "ft.Trainer(...)"):
        what = "field" if where == "TrainConfig" else "keyword (a TrainConfig field or the package's)"
        raise BadValue(f"{where} has no {what} {bounded_repr(unknown[0])}: {_hint(unknown[0], known)}")
    if unknown:  # bounded: a document may hold many (or huge) names
        hints = "; ".join(f"{bounded_repr(n, 80)}: {_hint(n, known)}" for n in unknown[:8])
        more = f"; {len(unknown) - 8} more" if len(unknown) > 8 else ""
        raise BadValue(f"{where}: unknown fields {bounded_repr(sorted(map(str, unknown[:64])))} ({hints}{more}); "
                       f"the fields are {known}")


# ---------------------------------------------------------------------------------------------- the package's call
# ft.Trainer(model, folder, **keywords): denoising-diffusion-pytorch's own Trainer line. Its defaults are TrainConfig's
# but for these (the package's train_batch_size is global: accelerate's split_batches=True)
PACKAGE_DEFAULTS = {"split_batches": True}
FOLDER_OPTIONS = ("augment_horizontal_flip", "convert_image_to")  # how the Trainer reads a folder (a path)
_FID_OPTIONS = ("num_fid_samples", "inception_block_idx")


def package_config(keywords: dict) -> tuple[TrainConfig, dict]:
    """The :class:`TrainConfig` that ``ft.Trainer(model, folder, **keywords)`` trains with, and how it reads the folder.

    ``keywords`` are denoising-diffusion-pytorch's ``Trainer`` arguments: the fields they share with
    :class:`TrainConfig` (the same names and defaults, but ``split_batches=True``, the package's), ``amp`` and
    ``mixed_precision_type`` (``mixed_precision``), ``save_best_and_latest_only=True`` (``keep_best="eval_loss_ema",
    keep_checkpoints=1``), ``calculate_fid=False`` (with ``num_fid_samples`` / ``inception_block_idx``, unused as in
    the package), ``augment_horizontal_flip`` and ``convert_image_to`` (returned: how the Trainer reads a folder); any
    other :class:`TrainConfig` field too. What cannot be honoured (``calculate_fid=True``) is refused, each keyword
    named with why and where its job is done, as are unknown names (with :class:`TrainConfig`'s hints).

    Returns:
        ``(config, folder_options)``: ``folder_options`` holds the ``FOLDER_OPTIONS`` given.

    Example::

        >>> from functrain.trainer.config import package_config
        >>> config, folder = package_config({"train_batch_size": 32, "amp": True, "mixed_precision_type": "bf16",
        ...                                  "augment_horizontal_flip": False})
        >>> config.train_batch_size, config.mixed_precision, config.split_batches, folder
        (32, 'bf16', True, {'augment_horizontal_flip': False})
        >>> package_config({"calculate_fid": True})
        Traceback (most recent call last):
        ...
        functrain.core.validate.BadValue: ft.Trainer(...) cannot honour calculate_fid=True (bool): not provided: ...
    """
    given = dict(keywords)
    folder = {k: given.pop(k) for k in FOLDER_OPTIONS if k in given}
    refused: list[str] = []
    values = dict(PACKAGE_DEFAULTS)
    amp, kind = given.pop("amp", None), given.pop("mixed_precision_type", None)
    if amp is not None or kind is not None:
        if "mixed_precision" in given:
            refused.append(f"amp={amp!r}, mixed_precision_type={kind!r} together with mixed_precision="
                           f"{given['mixed_precision']!r}: give one of the two (mixed_precision is functrain's)")
        elif amp not in (None, True, False):
            refused.append(f"amp={describe(amp)}: amp is True or False")
        elif kind is not None and kind not in _PRECISIONS:
            refused.append(f"mixed_precision_type={describe(kind)}: one of {_PRECISIONS} (it becomes "
                           f"TrainConfig.mixed_precision)")
        else:
            values["mixed_precision"] = (kind or "fp16") if amp else "no"
    fid = given.pop("calculate_fid", None)
    fid_options = [k for k in _FID_OPTIONS if k in given]
    for k in fid_options:
        given.pop(k)
    if fid is not None and fid is not False:
        refused.append(f"calculate_fid={describe(fid)}: {_NO_FID}; pass calculate_fid=False")
    elif fid_options and fid is None:
        refused.append(f"{', '.join(fid_options)}: settings of the package's FID, which is {_NO_FID}; pass "
                       f"calculate_fid=False (then they are unused, as in the package)")
    best = given.pop("save_best_and_latest_only", None)
    if best is True:
        clash = [k for k in ("keep_best", "keep_checkpoints") if k in given]
        if clash:
            refused.append(f"save_best_and_latest_only=True together with {', '.join(clash)}: it sets keep_best="
                           f"'eval_loss_ema', keep_checkpoints=1; give one or the other")
        values.update(keep_best="eval_loss_ema", keep_checkpoints=1)
    elif best not in (None, False):
        refused.append(f"save_best_and_latest_only={describe(best)}: True or False")
    if refused:
        raise BadValue("ft.Trainer(...) cannot honour " + "; ".join(refused) + ". The keywords build an "
                       "ft.TrainConfig(...), which may also be passed whole: ft.Trainer(model, folder, config)")
    check_names(given, "ft.Trainer(...)")
    values.update(given)
    return TrainConfig(**values), folder
