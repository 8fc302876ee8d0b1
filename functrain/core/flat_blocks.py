"""Which buffer of the flat state each leaf lives in: the repeated blocks of a params tree, found from its names.

The flat state (:mod:`functrain.core.flat`) gives each repeated block of the params buffers of its own, so that
identical blocks have identical layouts: the same offsets in buffers of the same size. While a compiled step with
reused regions (:mod:`functrain.core.regions`) is traced, torch's fake-tensor cache keys each call of a block on
its inputs' metadata, storage offset and storage size included; with the blocks' parameters at other offsets of
one buffer every call missed it (issue 29), with a buffer per block the calls of identical blocks hit.

The blocks are found from the leaves' path names alone (``blocks.3.attn.weight``: what
:func:`functrain.functionalize` names a ``ModuleList``'s or ``Sequential``'s children), since a params tree carries
no module. Pure Python on names, dtypes and shapes.

Example::

    >>> import torch
    >>> names = ["blocks.0.fc.w", "blocks.1.fc.w", "head.w"]
    >>> blocks_by_name(names, [torch.float32] * 3, [(2, 2), (2, 2), (2,)])
    ['blocks.0', 'blocks.1', '']
    >>> buffer_key(torch.float32, "blocks.1"), buffer_key(torch.float32)
    ('float32@blocks.1', 'float32')
"""
from __future__ import annotations

import re

import torch

__all__ = ["blocks_by_name", "buffer_key"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rpartition(".")[2]


def buffer_key(dtype: torch.dtype, block: str = "") -> str:
    """The key of the buffer a leaf lives in: its dtype's name, ``"<dtype>@<block>"`` for a leaf of a repeated
    block that has buffers of its own (``"float32@blocks.3"``)."""
    return f"{_dtype_name(dtype)}@{block}" if block else _dtype_name(dtype)


_SEP = re.compile(r"([./])")


def blocks_by_name(names: list[str], dtypes: list[torch.dtype], shapes: list[tuple[int, ...]]) -> list[str]:
    """Per leaf (in order), the repeated block it belongs to (``""``: none), found from the leaves' names.

    A block is the leaves under ``<container>.<i>.`` (``/`` separates too: a nested tree's path); blocks of one
    container are *repeated* when 2 or more hold the same names after that prefix, in the same order, with the same
    dtypes and shapes, and each has submodules of its own (a name with a further separator: a lone layer is not a
    block), what :func:`functrain.core.regions.repeated_blocks` groups among a module's children. Containers are
    searched outermost first; a block's own descendants are not searched.
    """
    where: dict[str, dict[str, list[int]]] = {}  # container -> index -> leaves (in order)
    for i, name in enumerate(names):
        parts = _SEP.split(name)
        for j in range(0, len(parts) - 1, 2):  # parts[j] a token, not the last one (a top-level Sequential: "0.")
            if parts[j].isdigit():
                where.setdefault("".join(parts[:max(j - 1, 0)]), {}).setdefault("".join(parts[:j + 1]), []).append(i)
    block = [""] * len(names)
    for container in sorted(where, key=lambda c: (len(_SEP.split(c)), c)):  # outermost first
        by_sig: dict = {}
        for prefix, leaves in where[container].items():
            if any(block[i] for i in leaves):
                continue  # inside a block found already
            rest = [names[i][len(prefix) + 1:] for i in leaves]
            if not any(_SEP.search(r) for r in rest):
                continue  # a lone layer's parameters
            sig = tuple((r, dtypes[i], tuple(shapes[i])) for r, i in zip(rest, leaves))
            by_sig.setdefault(sig, []).append((prefix, leaves))
        for found in by_sig.values():
            if len(found) >= 2:
                for prefix, leaves in found:
                    for i in leaves:
                        block[i] = prefix
    return block
