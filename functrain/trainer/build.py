"""How :class:`functrain.Trainer` is built: its config, its model's loss, its step (the optimizer and schedule, the
transforms, the compiled step and the runner the loop calls), its loaders and evaluation.

Kept apart from the loop (``loop.py``) because it is pure construction: a config (and the user's model, optimizer,
transforms or ready step) in, the trainer's components out, every mistake reported before training.
``Trainer.__init__`` calls these builders in order (:func:`trainer_config`, :func:`trainer_trackers`,
:func:`model_and_loss`, :func:`trainer_step`, :func:`train_loader`, :func:`evaluation`), then makes the loop's
components.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterable

import torch

from ..core.remat import marked_blocks
from ..core.validate import describe
from ..compiler.api import CompiledStep
from ..distributed import data_parallel
from ..distributed.sharding import ShardedDataParallel
from ..optim import adamw, check_optimizer, schedules
from ..core.step import Step, train_step
from ..core.transform import Transform
from ..transforms import accumulate, clip, ema, mixed_precision, skip_nonfinite
from .config import TrainConfig

__all__ = ["model_loss", "output_loss", "config_lr", "config_ema", "build_step", "trainer_config", "trainer_trackers",
           "model_and_loss", "trainer_step", "train_loader", "evaluation"]

# The config fields that only shape the built-in step (ignored with a ready ``step=``) and its optimizer
# (ignored with ``optimizer=``): a value changed from its default there would be silently unused, so it warns.
_OPTIMIZER_FIELDS = ("train_lr", "adam_betas", "weight_decay", "lr_schedule", "warmup_steps", "min_lr")
_STEP_FIELDS = _OPTIMIZER_FIELDS + ("max_grad_norm", "ema_update_every", "ema_decay", "ema_update_after_step",
                                    "ema_power", "ema_inv_gamma", "mixed_precision", "skip_nonfinite")


def _scalar(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float)):
        return True
    return torch.is_tensor(v) and v.numel() == 1 and (v.is_floating_point() or not v.dtype.is_complex)


def output_loss(out: Any) -> Any:
    """What a model (or loss function) returned, as ``train_step`` takes it: ``loss`` or ``(loss, aux)``.

    Accepted: a scalar loss tensor; ``(loss, aux_dict)``; a mapping with ``"loss"`` (its other scalar
    entries become aux metrics, ``"num_items"`` included; tensors with more than one element, such as
    logits, are left out); an object with a ``.loss`` (a Hugging Face ``ModelOutput`` is a mapping, so its
    scalar fields become metrics too). Anything else, or a ``None`` loss, raises a ``TypeError`` naming what
    came back.

    Example::

        >>> import torch
        >>> from functrain.trainer.build import output_loss
        >>> loss, aux = output_loss({"loss": torch.tensor(2.0), "acc": torch.tensor(0.5), "logits": torch.ones(3)})
        >>> float(loss), sorted(aux)
        (2.0, ['acc'])
    """
    if torch.is_tensor(out):
        return out
    if isinstance(out, tuple) and len(out) == 2 and torch.is_tensor(out[0]) and isinstance(out[1], dict):
        return out
    if isinstance(out, Mapping):
        loss = out.get("loss")
        if loss is not None:
            aux = {k: v for k, v in out.items() if k != "loss" and isinstance(k, str) and _scalar(v)}
            return (loss, aux) if aux else loss
        raise TypeError(_no_loss(out, f"a {type(out).__name__} with keys {sorted(map(str, out))} and no 'loss'"))
    loss = getattr(out, "loss", None)
    if torch.is_tensor(loss):
        return loss
    what = f"a {type(out).__name__} whose .loss is None" if hasattr(out, "loss") else _what(out)
    raise TypeError(_no_loss(out, what))


def _what(out: Any) -> str:
    """A short description of a model output (types and shapes, not values)."""
    def one(x: Any) -> str:
        return f"a tensor of shape {tuple(x.shape)}" if torch.is_tensor(x) else f"a {type(x).__name__}"

    if isinstance(out, (list, tuple)):
        items = ", ".join(one(x) for x in out[:4]) + (", ..." if len(out) > 4 else "")
        return f"a {type(out).__name__} of {len(out)} ({items})"
    return one(out)


def _no_loss(out: Any, what: str) -> str:
    hint = (" (a Hugging Face model computes its loss when the batch holds labels=..., e.g. a dict batch "
            "{'input_ids': ..., 'labels': ...})") if type(out).__module__.startswith("transformers") else ""
    return (f"the model returned {what}: the trainer needs a loss, i.e. a scalar tensor, (loss, aux_dict), a "
            f"dict with 'loss' or an object with a .loss{hint}")


def model_loss(apply_fn: Callable) -> Callable:
    """``loss_fn(params, buffers, batch)`` for a module: the batch's items are its ``forward`` arguments
    (a dict as keywords, a tuple/list as positions, else one argument) and its output goes through
    :func:`output_loss`."""

    def loss_fn(params, buffers, batch):
        if isinstance(batch, dict):
            out = apply_fn(params, buffers, **batch)
        elif isinstance(batch, (tuple, list)):
            out = apply_fn(params, buffers, *batch)
        else:
            out = apply_fn(params, buffers, batch)
        return output_loss(out)

    return loss_fn


def checked_loss(loss_fn: Callable) -> Callable:
    """A user ``loss_fn`` whose result also goes through :func:`output_loss` (so it may return a dict)."""

    def fn(params, buffers, batch):
        return output_loss(loss_fn(params, buffers, batch))

    fn.__name__ = getattr(loss_fn, "__name__", "loss_fn")
    return fn


def config_lr(config: TrainConfig) -> float | Callable:
    """The built-in AdamW's lr from the config: ``train_lr`` or a schedule covering ``train_num_steps``.

    Example::

        >>> import functrain as ft
        >>> from functrain.trainer.build import config_lr
        >>> lr = config_lr(ft.TrainConfig(train_lr=1.0, train_num_steps=10, lr_schedule="warmup_linear",
        ...                               warmup_steps=2))
        >>> [round(float(lr(t)), 3) for t in (0, 1, 2, 6, 10)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    c = config
    if c.lr_schedule == "constant":
        return schedules.linear_warmup(c.train_lr, c.warmup_steps) if c.warmup_steps else c.train_lr
    make = schedules.warmup_cosine if c.lr_schedule == "warmup_cosine" else schedules.warmup_linear_decay
    return make(c.train_lr, warmup_steps=c.warmup_steps, total_steps=c.train_num_steps, final=c.min_lr)


def config_ema(config: TrainConfig) -> Transform:
    """The trainer's EMA from the config: ``ft.ema(ema_decay, every=ema_update_every,
    start_step=ema_update_after_step, power=ema_power, inv_gamma=ema_inv_gamma)``.

    Example::

        >>> import functrain as ft
        >>> from functrain.trainer.build import config_ema
        >>> config_ema(ft.TrainConfig())
        ema(0.995, every=10, start_step=100, power=0.666667, inv_gamma=1, min_decay=0)
    """
    c = config
    return ema(c.ema_decay, every=c.ema_update_every, start_step=c.ema_update_after_step, power=c.ema_power,
               inv_gamma=c.ema_inv_gamma if c.ema_power is not None else 1.0)


def _warn_unused(config: TrainConfig, names: Iterable[str], why: str) -> None:
    default = TrainConfig()
    changed = {n: getattr(config, n) for n in names if getattr(config, n) != getattr(default, n)}
    if changed:
        warnings.warn(f"TrainConfig fields {changed} are not used: {why}", UserWarning, stacklevel=4)


def _named(step: Step, name: str) -> Transform | None:
    return next((t for t in step.transforms if t.name == name), None)


def build_step(loss: Callable, config: TrainConfig, world: int, *, optimizer: Any = None,
               transforms: Iterable[Any] = (), step: Any = None,
               module: torch.nn.Module | None = None) -> tuple[Step, CompiledStep | None]:
    """The trainer's step (and the compiled one if ``step=`` was already compiled).

    Without ``step``: ``train_step(loss, optimizer or adamw(config lr))`` with clip, EMA, accumulation,
    mixed precision and non-finite skipping from the config, then ``transforms`` (each applied once, at
    its own stage), then ``data_parallel(shard=config.shard)`` on several processes (and on one when
    ``config.shard`` is not ``"none"``). With ``step`` (a ``Step`` or an ``ft.compile``-d one): used as is,
    plus that ``data_parallel`` when it lacks it (one it has must agree with a ``config.shard`` other
    than ``"none"``). With ``shard="params"`` and a ``module`` (the one the loss runs) whose blocks are marked
    with ``ft.remat``, the blocks are gathered one at a time (``data_parallel(blocks=module)``).
    """
    c = config
    blocks = module if c.shard == "params" and module is not None and marked_blocks(module) else None
    if step is not None:
        if optimizer is not None or tuple(transforms):
            raise TypeError("Trainer(step=...) uses the step as is: build the optimizer and the transforms into it "
                            "instead of passing optimizer= or transforms=")
        compiled = step if isinstance(step, CompiledStep) else None
        base = compiled.step if compiled is not None else step
        if not isinstance(base, Step):
            raise TypeError(f"Trainer(step=...) takes a functrain Step (ft.train_step(...), wrapped in transforms) or "
                            f"ft.compile(step); got {describe(step)[:200]}")
        _warn_unused(c, _STEP_FIELDS, "Trainer(step=...) uses the given step as is")
        n = base.micro_batches  # declared: Transform.micro_batches (a streaming accumulation takes 1 per call)
        if n != c.gradient_accumulate_every:
            raise ValueError(f"the given step accumulates {n} micro-batches but TrainConfig.gradient_accumulate_every"
                             f"={c.gradient_accumulate_every}: the trainer loads batches of train_batch_size * "
                             f"gradient_accumulate_every rows; make them agree (Step.micro_batches: a streaming "
                             f"accumulate takes one micro-batch per call)")
        present = _named(base, "data_parallel")
        if present is not None:
            mode = present.shard if isinstance(present, ShardedDataParallel) else "none"
            if c.shard != "none" and mode != c.shard:  # (the default config leaves it to the step)
                raise ValueError(f"the given step has data_parallel(shard={mode!r}) but TrainConfig.shard="
                                 f"{c.shard!r}: make them agree, or leave TrainConfig.shard at 'none'")
        elif _wants_data_parallel(c, world):
            if compiled is not None:
                raise ValueError(f"Trainer(step=ft.compile(step)) on {world} processes (TrainConfig.shard="
                                 f"{c.shard!r}): the step has no data_parallel(), which cannot be added to a "
                                 f"compiled step; pass the step uncompiled, or "
                                 f"ft.compile(ft.data_parallel(shard={c.shard!r})(step))")
            base = data_parallel(shard=c.shard, blocks=blocks)(base)
        schedules.check_covers(base.optimizer, c.train_num_steps)
        return base, compiled
    if optimizer is None:
        optimizer = adamw(config_lr(c), betas=c.adam_betas, weight_decay=c.weight_decay)
    else:
        optimizer = check_optimizer(optimizer, num_steps=c.train_num_steps)  # a torch.optim one: translated
        _warn_unused(c, _OPTIMIZER_FIELDS, "Trainer(optimizer=...) brings its own lr, schedule and weight decay")
    schedules.check_covers(optimizer, c.train_num_steps)
    s = train_step(loss, optimizer)
    s = config_ema(c)(clip(c.max_grad_norm)(s))
    if c.gradient_accumulate_every > 1:
        s = accumulate(c.gradient_accumulate_every)(s)
    if c.mixed_precision != "no":
        s = mixed_precision(c.mixed_precision)(s)
    if c.skip_nonfinite and c.mixed_precision != "fp16":  # fp16's loss scaling skips non-finite steps itself
        s = skip_nonfinite()(s)
    if isinstance(transforms, Transform):
        transforms = (transforms,)
    for i, t in enumerate(transforms):
        if not isinstance(t, Transform):
            raise TypeError(f"Trainer(transforms=...)[{i}] must be a functrain Transform (e.g. ft.clip_value(1.0), "
                            f"or your own ft.Transform subclass); got {describe(t)[:200]}")
        if _named(s, t.name) is not None:
            raise ValueError(f"Trainer(transforms=...)[{i}] is {t!r}, but the trainer's step already has "
                             f"{t.name!r} from the config ({[x.name for x in s.transforms]}); set it in the "
                             f"TrainConfig, or pass a ready step=")
        s = t(s)
    if _wants_data_parallel(c, world):
        s = data_parallel(shard=c.shard, blocks=blocks)(s)
    return s, None


def _wants_data_parallel(config: TrainConfig, world: int) -> bool:
    """Several processes, or a sharded state on one: a sharded run's state is sharded (over 1 rank) on one
    process too, so its checkpoints have the same layout at every world size (and reshard when it changes)."""
    return world > 1 or config.shard != "none"


# -- the Trainer's builders (called in this order by Trainer.__init__) ---------------------------------
def trainer_config(config: TrainConfig | None, package: dict) -> tuple[TrainConfig, bool]:
    """The run's config and whether this is the package's call (``ft.Trainer(diffusion, folder, train_batch_size=32,
    ...)``: no config, its keywords build one); a config and keywords together are refused."""
    from .config import package_config

    if config is None:
        return package_config(package)[0], True
    if not isinstance(config, TrainConfig):
        raise TypeError(f"Trainer needs a functrain.TrainConfig; got {type(config).__name__}")
    if package:
        names = ", ".join(sorted(package))
        raise TypeError(f"Trainer got a TrainConfig and the keywords {names}: give one or the other (the "
                        f"keywords build the TrainConfig: ft.Trainer(model, dataset, {names}=...), or set them "
                        f"in yours: config.replace(...))")
    return config, False


def trainer_trackers(config: TrainConfig, trackers: Any, eval_dataset: Any) -> list:
    """The checked trackers of the run (the config's, then ``trackers=``); what needs an ``eval_dataset=`` is
    refused without one."""
    from .trackers import check_trackers

    if isinstance(trackers, str) or not isinstance(trackers, (list, tuple)):
        raise TypeError(f"Trainer(trackers=...) takes a list of tracker objects (log(step, metrics)) or names; "
                        f"got {type(trackers).__name__} (names can also go in TrainConfig.trackers)")
    items = check_trackers((*config.trackers, *trackers))
    if eval_dataset is None and config.eval_every:
        raise ValueError(f"TrainConfig.eval_every={config.eval_every} but the Trainer has no eval_dataset=")
    if eval_dataset is None and config.keep_best is not None:
        raise ValueError(f"TrainConfig.keep_best={config.keep_best!r} keeps the checkpoint with the best held-out "
                         f"loss, and the Trainer has no eval_dataset= to compute it "
                         f"(save_best_and_latest_only=True sets keep_best='eval_loss_ema')")
    return items


def model_and_loss(model_or_loss: Any, params: Any, buffers: Any, device: Any) -> tuple:
    """``(module or None, loss_fn, params, buffers)``: a module moved to ``device`` and functionalized, or a
    ``loss_fn(params, buffers, batch)`` with its ``params=``."""
    from ..core.module import functionalize

    if isinstance(model_or_loss, torch.nn.Module):
        module = model_or_loss.to(device)
        apply_fn, params, buffers = functionalize(module)
        return module, model_loss(apply_fn), params, buffers
    if callable(model_or_loss):
        if params is None:
            raise TypeError("Trainer(loss_fn, ...) needs params= (and buffers=): with a module they come from it")
        return None, checked_loss(model_or_loss), params, buffers
    raise TypeError(f"Trainer trains an nn.Module or a loss_fn(params, buffers, batch); "
                    f"got {type(model_or_loss).__name__}")


def trainer_step(loss: Callable, config: TrainConfig, world: int, **kwargs: Any) -> tuple:
    """``(step, compiled, run_step)``: the step (:func:`build_step`, ``kwargs`` its keywords), the
    :class:`~functrain.CompiledStep` (``None`` with ``compile=False``) and what the loop calls: the compiled
    step's runner (donating, compiling in the background) or the step."""
    from ..compiler.api import compile as compile_step

    step, compiled = build_step(loss, config, world, **kwargs)
    if compiled is None and config.compile:
        compiled = compile_step(step, background=config.compile_background, switch_at=config.compile_switch_at,
                                policy=config.compile_policy, package=config.compile_package)
    return step, compiled, compiled.runner(donate=True, background=True) if compiled is not None else step


def train_loader(dataset: Any, config: TrainConfig, world: int, per_process: int, device: Any) -> Any:
    """The training loader: ``ft.shard`` of ``dataset``, a process's batch times the accumulation, shuffled,
    incomplete last batches dropped; an empty one refused with what to change."""
    from ..data import shard

    loader = shard(dataset, batch_size=per_process * config.gradient_accumulate_every, shuffle=True,
                   seed=config.seed, drop_last=True, device=device)
    loader.check_nonempty("train dataset", remedy=(
        f"the Trainer drops an incomplete last batch, so lower TrainConfig.train_batch_size (now "
        f"{config.train_batch_size}) or gradient_accumulate_every (now {config.gradient_accumulate_every}: a "
        f"rank's batch is their product), use fewer processes (now {world}) or add data"))
    return loader


def evaluation(loss: Callable, eval_dataset: Any, config: TrainConfig, world: int, per_process: int, device: Any,
               module: torch.nn.Module | None) -> Any:
    """The run's :class:`~functrain.trainer.components.Evaluation` of ``eval_dataset``, or ``None`` without one."""
    from .components import Evaluation
    from .evaluator import Evaluator
    from .inputs import process_batch

    if eval_dataset is None:
        return None
    batch = per_process if config.eval_batch_size is None else \
        process_batch(config, world, config.eval_batch_size, "eval_batch_size")
    return Evaluation(Evaluator(loss, eval_dataset, batch, device=device, module=module, seed=config.seed),
                      every=config.eval_every or config.save_and_sample_every, last=config.train_num_steps)
