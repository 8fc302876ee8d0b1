"""Ready weight-decay masks: predicates ``mask(name, param) -> bool`` (``True`` = decay).

Pass one as ``weight_decay_mask=`` to :func:`~functrain.optim.adamw`,
:func:`~functrain.optim.adam`, :func:`~functrain.optim.sgd` or
:func:`~functrain.optim.lion`. ``name`` is the leaf's pytree path joined by
``"/"`` (for :func:`functrain.functionalize`'s flat dict, the
``named_parameters()`` name such as ``"blocks.0.ln_1.weight"``).

Example::

    >>> import torch
    >>> from functrain import optim
    >>> params = {"fc.weight": torch.ones(4, 3), "fc.bias": torch.ones(4), "ln_f.weight": torch.ones(4)}
    >>> optim.masks.resolve(optim.masks.no_decay_bias_and_norm, params)
    {'fc.weight': True, 'fc.bias': False, 'ln_f.weight': False}
    >>> opt = optim.adamw(1e-3, weight_decay=0.1, weight_decay_mask=optim.masks.no_decay_bias_and_norm)
"""
from __future__ import annotations

from typing import Any

import optree
import torch

from .groups import decay_mask

__all__ = ["no_decay_bias_and_norm", "name_tokens", "resolve"]

_NORM_PREFIXES = ("ln", "bn", "gn")


def name_tokens(name: str) -> list[str]:
    """The lower-case alphanumeric words of a parameter name.

    Args:
        name: a parameter name (a pytree path joined by ``"/"``, or a ``named_parameters()`` name).

    Returns:
        The list of words: ``"blocks.0.ln_1/weight"`` -> ``['blocks', '0', 'ln', '1', 'weight']``.

    Example::

        >>> from functrain.optim.masks import name_tokens
        >>> name_tokens("encoder.layer_norm.weight")
        ['encoder', 'layer', 'norm', 'weight']
    """
    # Plain str operations (no regex) so the predicate also runs while torch.compile traces.
    return "".join(c if c.isalnum() else " " for c in name.lower()).split()


def _is_norm_or_bias_word(word: str) -> bool:
    if word == "bias" or word.endswith("bias") or "norm" in word:
        return True
    # ln, ln1, bn2, gn: the usual short names of LayerNorm / BatchNorm / GroupNorm modules.
    for prefix in _NORM_PREFIXES:
        if word.startswith(prefix) and word[len(prefix):].isdigit() or word == prefix:
            return True
    return False


def no_decay_bias_and_norm(name: str, param: torch.Tensor) -> bool:
    """Decay only weight matrices: ``False`` (no decay) for biases, norm layers and scalars.

    The rule, precisely: no decay when ``param.ndim <= 1`` (every bias, every
    LayerNorm / RMSNorm / BatchNorm / GroupNorm weight and any scalar gain), or when
    a word of the name (:func:`name_tokens`: split on every non-alphanumeric
    character, lower-cased) is or ends with ``"bias"`` (``in_proj_bias``), contains
    ``"norm"`` (``layernorm``, ``norm1``, ``rmsnorm``), or is ``ln`` / ``bn`` / ``gn``
    optionally followed by digits (``ln_f``, ``bn1``). Everything else (linear and
    conv weights, embeddings) is decayed, as in GPT-2/nanoGPT and the Hugging Face
    Trainer.

    Args:
        name: the leaf's name (its pytree path joined by ``"/"``).
        param: the leaf tensor (only its ``ndim`` is read).

    Returns:
        ``True`` to decay the leaf, ``False`` not to.

    Example::

        >>> import torch
        >>> from functrain.optim.masks import no_decay_bias_and_norm as decay
        >>> decay("fc.weight", torch.ones(4, 3)), decay("fc.bias", torch.ones(4))
        (True, False)
        >>> decay("blocks.0.ln_1.weight", torch.ones(8)), decay("norm.scale", torch.ones(2, 8))
        (False, False)
    """
    if param.ndim <= 1:
        return False
    return not any(_is_norm_or_bias_word(w) for w in name_tokens(name))


def resolve(weight_decay_mask: Any, params: Any) -> Any:
    """The mask as a pytree of bools shaped like ``params`` (``True`` = decay), to check a rule.

    Args:
        weight_decay_mask: ``None`` (all ``True``), a pytree of bools, or a predicate
            ``callable(name, param) -> bool``.
        params: the params tree.

    Returns:
        A pytree of the structure of ``params`` with a bool per leaf.

    Raises:
        BadValue: as :func:`functrain.optim.groups.decay_mask`.

    Example::

        >>> import torch
        >>> from functrain.optim.masks import resolve
        >>> resolve(lambda name, p: name != "b", {"w": torch.ones(2), "b": torch.ones(2)})
        {'w': True, 'b': False}
    """
    return optree.tree_unflatten(optree.tree_structure(params), decay_mask(weight_decay_mask, params))
