"""``python -m functrain.launch --nproc N script.py [args]``: the command-line launcher (see :mod:`functrain.cli`).

``functrain/__init__.py`` does not import this module (so ``python -m`` runs it
without a warning); the in-process launcher lives in :mod:`functrain.spawn` and is
``ft.launch``. Importing this module makes the package attribute
``functrain.launch`` this module, so the module is callable and forwards to
:func:`functrain.spawn.launch`: ``ft.launch(fn, nprocs=2)`` works either way.
"""
import sys
import types

from .spawn import LaunchError, free_port, launch

__all__ = ["launch", "free_port", "LaunchError"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return launch(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    from functrain.cli import main

    raise SystemExit(main())
