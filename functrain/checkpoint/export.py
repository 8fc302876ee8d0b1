"""Final weights as plain ``state_dict`` files: ``.safetensors`` any PyTorch user can load without functrain.

:func:`export_state_dict` writes ``{name: tensor}`` (nested dicts, lists and tuples
flattened with ``"."`` as ``nn.Module`` names them) to one safetensors file;
:func:`export_weights` writes a training state's ``model.safetensors`` (params +
buffers) and ``ema.safetensors`` (EMA params + the same buffers). Both files load with::

    model.load_state_dict(safetensors.torch.load_file("results/model.safetensors"), strict=True)

Every tensor is written as a contiguous CPU copy of its own, so tensors that share
storage (tied weights, views) are fine: safetensors itself refuses shared storage,
and ``load_state_dict`` wants every name, the tied ones included. Pass ``module=``
to make the keys exactly ``module.state_dict()``'s: tied aliases are filled in from
the parameter they share, and non-persistent buffers (which a state dict leaves
out) are dropped; a name the module expects and the tree lacks is an error.

The write is atomic: a temporary file beside the target, fsynced, renamed over it,
and the folder fsynced, so a reader sees the old file or the new one, never half. The temporary
file is created new (``O_EXCL``, a random name) and a symbolic link at the target is refused
(:class:`functrain.checkpoint.LinkRefused`): nothing is written through a link.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from ..core.flat import unflat
from .safe_io import replace_created
from .tensorfile import write_tensors

__all__ = ["export_state_dict", "export_weights", "flat_state_dict"]


def _flatten(tree: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        if not prefix:
            raise TypeError("export_state_dict needs a tree of named tensors ({name: tensor}); got a bare tensor")
        if prefix in out:
            raise ValueError(f"export_state_dict: the name {prefix!r} occurs twice (params and buffers overlap?)")
        out[prefix] = tree
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            if not isinstance(k, str) or not k:
                raise TypeError(f"export_state_dict: keys must be non-empty strings; got {k!r} under {prefix or '<root>'}")
            _flatten(v, f"{prefix}.{k}" if prefix else k, out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)
    elif tree is None:
        return  # an absent optional entry
    else:
        raise TypeError(f"export_state_dict: {prefix or '<root>'} is a {type(tree).__name__}, not a tensor; "
                        f"only tensors can go in a state_dict file")


def flat_state_dict(*trees: Any, module: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """``{dotted name: tensor}`` from one or more trees (params, buffers), as ``nn.Module.state_dict()`` names them.

    With ``module``, the keys are exactly ``module.state_dict()``'s (see the module docstring).
    The tensors are the originals (not copies).

    Example::

        >>> import torch
        >>> sorted(flat_state_dict({"fc": {"weight": torch.ones(1), "bias": torch.zeros(1)}}))
        ['fc.bias', 'fc.weight']
    """
    flat: dict[str, torch.Tensor] = {}
    for tree in trees:
        _flatten(unflat(tree), "", flat)  # flat params (ft.flat) by name
    if module is None:
        return flat
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"export_state_dict: module= must be an nn.Module; got {type(module).__name__}")
    # Names that are one tensor in the module (tied weights): any one of them present in the tree serves all.
    aliases: dict[int, list[str]] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        aliases.setdefault(id(t), []).append(name)
    group = {name: names for names in aliases.values() for name in names}
    wanted = list(module.state_dict().keys())
    out: dict[str, torch.Tensor] = {}
    missing = []
    for key in wanted:
        source = next((n for n in [key, *group.get(key, [])] if n in flat), None)
        if source is None:
            missing.append(key)
        else:
            out[key] = flat[source]
    if missing:
        raise ValueError(f"export_state_dict: the module's state_dict has {missing} but the tree does not")
    unknown = sorted(set(flat) - set(out) - {n for k in out for n in group.get(k, [])}
                     - {n for n, _ in module.named_buffers()})  # non-persistent buffers are expected extras
    if unknown:
        raise ValueError(f"export_state_dict: {unknown} are not in the module's state_dict")
    return out


def export_state_dict(path: str | os.PathLike, params: Any, buffers: Any = None, *,
                      module: torch.nn.Module | None = None, metadata: Mapping[str, str] | None = None) -> str:
    """Write ``params`` (and ``buffers``) as a plain state_dict ``.safetensors`` file, atomically.

    The file is created beside the target and renamed over it (a link at the target is
    refused), then the folder is fsynced.

    Args:
        path: the file to write.
        params: a ``{name: tensor}`` tree (``state.params`` or ``state.ema``); nested containers
            are flattened with ``"."``.
        buffers: the buffers tree (``state.buffers``), or ``None`` (default: none).
        module: ``None`` (default), or the ``torch.nn.Module`` the weights are for: the keys then
            match ``module.state_dict()`` exactly (tied aliases filled in, non-persistent buffers dropped).
        metadata: str -> str pairs for the file's header (default ``None``), after
            ``{"format": "pt"}`` as Hugging Face tools expect.

    Returns:
        The path written, a str.

    Raises:
        ValueError: there are no tensors to write, or (with ``module``) the tree and the module's
            state_dict differ; the message names the keys.

    Example::

        >>> import tempfile, torch, safetensors.torch, functrain as ft
        >>> model = torch.nn.Linear(2, 1)
        >>> _, params, buffers = ft.functionalize(model)
        >>> path = ft.export_state_dict(tempfile.mkdtemp() + "/model.safetensors", params, buffers, module=model)
        >>> model.load_state_dict(safetensors.torch.load_file(path), strict=True)
        <All keys matched successfully>
    """
    flat = flat_state_dict(params, buffers, module=module)
    if not flat:
        raise ValueError("export_state_dict: there are no tensors to write")
    # Own contiguous CPU copies: safetensors refuses shared or non-contiguous storage, and the file must
    # not depend on what the training loop does to its tensors afterwards.
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in flat.items()}
    meta = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
    def create(tmp: str) -> None:  # a new file (O_EXCL, never through a link), in the safetensors format
        write_tensors(tmp, list(tensors.items()), "crc32", True, metadata=meta)

    # then renamed over the target (a link at the target is refused), and the folder fsynced
    return replace_created(os.fspath(path), create, fsync=True, what="exported weights")


def export_weights(folder: str | os.PathLike, state: Any, *, module: torch.nn.Module | None = None,
                   metadata: Mapping[str, str] | None = None) -> dict[str, str]:
    """Write a training state's final weights: ``folder/model.safetensors`` and, with an EMA, ``folder/ema.safetensors``.

    The EMA file holds the EMA params with the state's buffers, so it loads strictly into
    the same module. Each file's header records ``"step"`` (when the state has a tensor
    ``step``) and ``"weights"`` (``"params"`` or ``"ema"``).

    Args:
        folder: the folder to write into.
        state: a :class:`functrain.TrainState` (or anything with ``params``, ``buffers`` and
            optionally ``ema``).
        module: as in :func:`export_state_dict` (default ``None``).
        metadata: extra str -> str header pairs for both files (default ``None``).

    Returns:
        ``{"model": path}``, plus ``"ema": path`` when the state has an EMA.

    Raises:
        ValueError: as :func:`export_state_dict`.

    Example::

        >>> import tempfile, torch, functrain as ft
        >>> model = torch.nn.Linear(2, 1)
        >>> _, params, buffers = ft.functionalize(model)
        >>> step = ft.ema(0.9)(ft.train_step(lambda p, b, x: (p["weight"] * x).sum(), ft.optim.sgd(0.1)))
        >>> paths = ft.export_weights(tempfile.mkdtemp(), step.init(params, buffers), module=model)
        >>> sorted(paths)
        ['ema', 'model']
    """
    folder = os.fspath(folder)
    meta = {"step": str(int(state.step))} if isinstance(getattr(state, "step", None), torch.Tensor) else {}
    meta.update(metadata or {})
    out = {"model": export_state_dict(os.path.join(folder, "model.safetensors"), state.params, state.buffers,
                                      module=module, metadata={**meta, "weights": "params"})}
    ema = getattr(state, "ema", None)
    if ema is not None:
        out["ema"] = export_state_dict(os.path.join(folder, "ema.safetensors"), ema, state.buffers,
                                       module=module, metadata={**meta, "weights": "ema"})
    return out
