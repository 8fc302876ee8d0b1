"""``python -m functrain.launch --nproc N script.py [args]``: the command-line launcher.

The implementation is :mod:`functrain.distributed.cli`; this file is only its ``python -m`` entry
point. The in-process launcher is ``ft.launch`` (:func:`functrain.distributed.launch`), and the name
``functrain.launch`` stays that function even when this file is imported.

Why that needs care: importing a submodule binds it on its package, so a plain module here would,
once imported (``import functrain.launch`` by a user, a doctest or documentation run over the
package, ``importlib.import_module`` over ``pkgutil.walk_packages``), replace the function
``functrain.launch`` with the module, and ``ft.launch(fn, nprocs=2)`` would fail with
``TypeError: 'module' object is not callable``.

How: imported under its own name, this file puts the function in its own place in ``sys.modules``
and defines nothing else. CPython's import system reads ``sys.modules[name]`` again after executing a
module, and that object is what the import returns and what it binds on the parent package
(``importlib._bootstrap._load_unlocked`` then ``_find_and_load_unlocked``, the same in 3.10 to 3.13;
the language reference mentions a module replacing itself in ``sys.modules`` as CPython behaviour).
So ``import functrain.launch`` and ``importlib.import_module("functrain.launch")`` give the function
and leave ``functrain.launch`` bound to it; ``from functrain import launch`` finds the attribute and
imports nothing. Run as ``python -m functrain.launch`` this file's name is ``__main__``: it runs the
command line, as before. Tested in tests/distributed/test_launch_name.py.
"""
import sys

if __name__ == "__main__":
    from functrain.distributed.cli import main

    raise SystemExit(main())
elif __name__ == "functrain.launch":
    from functrain.distributed import launch as _launch

    sys.modules[__name__] = _launch
