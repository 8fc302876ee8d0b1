"""The allow-list of node types a saved state may hold: ``NamedTuple`` classes registered by name.

A checkpoint's ``tree.json`` names each ``NamedTuple`` node by the name it was
registered under, and loading looks that name up here; nothing named in a file is
ever imported. Types register themselves where they are defined, with the
decorator form::

    @register_checkpoint_type("functrain.optim.AdamState")
    class AdamState(NamedTuple): ...

This module sits in the core layer, so optimizers and transforms can register
their state types without importing the checkpoint package above them.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["register_checkpoint_type", "type_name", "type_by_name"]

_TYPES: dict[str, type] = {}      # name in tree.json -> NamedTuple class
_NAMES: dict[type, str] = {}      # class -> name


def _is_namedtuple_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, tuple) and isinstance(getattr(obj, "_fields", None), tuple)


def _register(cls: type, name: str | None) -> type:
    if not _is_namedtuple_class(cls):
        raise TypeError(f"register_checkpoint_type takes a NamedTuple class; got {cls!r}")
    name = f"{cls.__module__}.{cls.__qualname__}" if name is None else name
    if not isinstance(name, str) or not name:
        raise TypeError(f"the registered name must be a non-empty str; got {name!r}")
    if _TYPES.get(name, cls) is not cls:
        raise ValueError(f"checkpoint type name {name!r} is already registered for {_TYPES[name]!r}")
    _TYPES[name] = cls
    _NAMES.setdefault(cls, name)
    return cls


def register_checkpoint_type(cls: Any = None, name: str | None = None) -> Any:
    """Allow a ``NamedTuple`` class as a node of saved states.

    Three forms: ``register_checkpoint_type(Cls)``, ``register_checkpoint_type(Cls,
    name="x")``, and as a class decorator ``@register_checkpoint_type`` or
    ``@register_checkpoint_type("x")``. Loading looks the recorded name up among the
    registered classes and never imports anything named in a file.

    Args:
        cls: the ``NamedTuple`` class; or, in the decorator form, the name (a str) or ``None``.
        name: what ``tree.json`` records (default ``None``: ``"<module>.<qualname>"``); registering
            the same class again under its name is allowed.

    Returns:
        The class itself (so the call works as a decorator), or, given only a name, the decorator.

    Raises:
        TypeError: ``cls`` is not a ``NamedTuple`` class, or the name is not a non-empty str.
        ValueError: the name is already registered for another class.

    Example::

        >>> from typing import NamedTuple
        >>> import tempfile, torch, functrain as ft
        >>> @ft.register_checkpoint_type("example.Momentum")
        ... class Momentum(NamedTuple):
        ...     velocity: torch.Tensor
        >>> path = ft.save(tempfile.mkdtemp() + "/c", {"m": Momentum(torch.ones(2))})
        >>> ft.load(path)["m"]
        Momentum(velocity=tensor([1., 1.]))
    """
    if isinstance(cls, str):  # @register_checkpoint_type("name")
        label = cls

        def decorate(c: type) -> type:
            return _register(c, label)

        return decorate
    if cls is None:  # @register_checkpoint_type(name="x")
        return lambda c: _register(c, name)
    return _register(cls, name)


def type_name(cls: type) -> str | None:
    """The registered name of ``cls``, or ``None`` if it is not allowed."""
    return _NAMES.get(cls)


def type_by_name(name: str) -> type | None:
    """The class registered under ``name``, or ``None``."""
    return _TYPES.get(name)


def unregister(name: str) -> Callable[[], None]:
    """Remove a registration. Used by the tests only, kept here: it is the inverse of :func:`register` and touches
    the registry's private tables, which a test must not reach into; a test that registers a class removes it."""
    cls = _TYPES.pop(name, None)
    if cls is not None and _NAMES.get(cls) == name:
        del _NAMES[cls]
    return None
