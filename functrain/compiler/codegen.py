"""Loading what another process compiled, with inductor's code generation refused.

A background compile worker (:mod:`functrain.compiler.background`) writes a graph's entries into the shared caches;
the training process then loads them with code generation refused (:func:`refuse_codegen`), so a miss (a corrupt
or missing entry, a key that differs) is an error it can act on (:class:`NotCached`), never a compile that blocks
training without saying so.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["NotCached", "refuse_codegen"]


class NotCached(RuntimeError):
    """Inductor would have had to generate code for a graph that was to be loaded from the caches."""


@contextlib.contextmanager
def refuse_codegen() -> Iterator[None]:
    """While loading a graph from the caches: compiling it raises :class:`NotCached` instead.

    AOTAutograd's and inductor's caches hit as usual (reading an entry traces nothing and generates
    no code); a miss reaches AOTAutograd's ``create_aot_state`` (the trace of the graph) or inductor's
    ``fx_codegen_and_compile``, which are replaced for the duration. (Process-wide: only the training
    thread loads, and nothing else compiles in this process then.)
    """
    patched = []
    for module_name, attr in (("torch._functorch.aot_autograd", "create_aot_state"),
                              ("torch._inductor.compile_fx", "fx_codegen_and_compile")):
        try:
            import importlib
            module = importlib.import_module(module_name)
            patched.append((module, attr, getattr(module, attr)))
        except (ImportError, AttributeError):  # pragma: no cover - another torch layout: that part unguarded
            continue

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotCached("the compile caches hold no usable entry for this graph (it would be compiled here)")

    for module, attr, _ in patched:
        setattr(module, attr, refuse)
    try:
        yield
    finally:
        for module, attr, original in patched:
            setattr(module, attr, original)
