"""``python -m functrain.launch --nproc N script.py [args]``: the command-line launcher.

The implementation is :mod:`functrain.distributed.cli`; this file is its ``python -m`` entry point. The
in-process launcher is ``ft.launch`` (:func:`functrain.distributed.launch`).

Why this module is callable: importing a submodule binds it on its package, so once ``functrain.launch`` is
imported (``import functrain.launch`` by a user, a doctest run over the package, ``pkgutil.walk_packages``) the
name ``ft.launch`` is this module, no longer the function. This module's type is therefore a
:class:`types.ModuleType` whose call is the function's (the language allows assigning a module's
``__class__`` to a subclass of ``ModuleType``): ``ft.launch(fn, nprocs=2)`` works either way, ``sys.modules``
holds a real module with its ``__file__`` (pydoc, Sphinx, pytest's doctest collection read it), and
``inspect.signature(ft.launch)`` is the function's (``__wrapped__``). Tested in
tests/distributed/test_launch_name.py.

Example::

    >>> import functrain as ft, functrain.launch, inspect, sys, types
    >>> isinstance(sys.modules["functrain.launch"], types.ModuleType), callable(ft.launch)
    (True, True)
    >>> list(inspect.signature(ft.launch).parameters)[:2]
    ['fn', 'nprocs']
"""
import sys
import types
from typing import Any

from functrain.distributed import launch as __wrapped__


class _LaunchModule(types.ModuleType):
    """This module's type: calling it calls :func:`functrain.distributed.launch`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return __wrapped__(*args, **kwargs)


if __name__ == "__main__":
    from functrain.distributed.cli import main

    raise SystemExit(main())
sys.modules[__name__].__class__ = _LaunchModule
