"""``python -m functrain.launch --nproc N script.py [args]``: the command-line launcher.

The implementation is :mod:`functrain.distributed.cli`; this module is only its
``python -m`` entry point. The in-process launcher is ``ft.launch``
(:func:`functrain.distributed.launch`).
"""
if __name__ == "__main__":
    from functrain.distributed.cli import main

    raise SystemExit(main())
