"""How inductor's C++ units are built: a package's two units side by side; a graph's entry function at the wrapper's
level.

**Side by side.** An AOTInductor package's two C++ units are built on two cores, not one after the other.

AOTInductor compiles a package's wrapper (the code that allocates and calls, ``*.wrapper.o``), then its kernels
(``*.kernel.o``), then its constants, each a single compiler process, then links them. The wrapper and the kernels
do not read each other: :func:`side_by_side` starts the wrapper's compile on a thread (the compiler is a child
process, so the thread waits without the GIL) and returns at once, the kernels' compile runs meanwhile, and any
other build (the constants' object, which failed to compile when started early; the link) first waits for the
wrapper, and so does the end of the block. On the 2-rank main job's package the wrapper takes ~6.5 s and the
kernels ~1.5 s: the package is ready ~1.5 s sooner (bench/README.md, issue 41). The same compilers run with the
same flags and inputs: the objects and what is linked from them do not change. (Used by
:class:`~functrain.compiler.package.Packages` only: a graph compiled in the process builds one unit.)

A failure of a deferred compile is raised by the next link, or at the end of the block, with its own error.

**The entry function at the wrapper's level.** A CPU graph compiled in the process is one C++ unit (inductor's
``cpp_wrapper``): its kernels and the function that calls them (``inductor_entry_impl``: allocations, handles, one
call per kernel), all at ``-O3``. For a large graph nearly all of the unit's time is GCC optimising that function,
not the kernels: the seed's ``Unet`` (159 kernels, an entry function of ~8,000 lines) 95.5 s by hand, its kernels
alone 12.7 s, the unit with the entry function at ``-O1`` 42.8 s, at ``-O0`` 14.3 s (bench/README.md, issue 41).
An AOTInductor package builds the same code as a separate wrapper unit at ``aot_inductor.compile_wrapper_opt_level``
(``-O1`` by default). :func:`entry_at_wrapper_level` applies that level to the JIT unit's entry function too, by a
GCC pragma around it (:func:`with_entry_level`); the kernels in the same unit keep ``-O3`` and stay visible to the
compiler.
The level is read from inductor's configuration when the unit is loaded (``-O1`` by default; ``options`` or
``AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL`` change it), and the compiled unit is keyed by its source, pragma
included: a unit built with another level, or by a plain ``torch.compile``, is another file, never this one. At
``-O1`` the per-call time is unchanged (W1 paired 0.99-1.0); ``-O0`` costs W1 ~4 %. The entry function does no
arithmetic on the tensors' values, so the numbers are the same bit for bit (tests/compiler/test_cpp_units.py). A
compiler other than GCC ignores the pragma (``-Wno-unknown-pragmas``): the unit is then built as before. A unit
whose source has no single entry function to put the pragmas around (a torch that names it otherwise) is built as
inductor wrote it, entry at ``-O3``, with a warning: slower to compile, the same numbers.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from concurrent.futures import Future
from typing import Any, Iterator

__all__ = ["side_by_side", "entry_at_wrapper_level", "with_entry_level", "LEVELS"]


@contextlib.contextmanager
def side_by_side() -> Iterator[None]:
    """While building packages on this thread: a package's wrapper unit compiles beside its kernels; the rest
    waits for it.

    Process-wide for the block's duration (inductor's ``CppBuilder.build``); builds started by other threads in
    the meantime run as before."""
    try:
        from torch._inductor import cpp_builder
    except ImportError:  # pragma: no cover - a torch without inductor
        yield
        return
    original = cpp_builder.CppBuilder.build
    owner = threading.get_ident()
    pending: list[Future] = []

    def wait() -> None:
        while pending:
            pending.pop(0).result()

    def build(self: Any) -> Any:
        if threading.get_ident() != owner:
            return original(self)
        try:
            target = str(self.get_target_file_path())
        except Exception:  # noqa: BLE001 - not a build this knows: as before
            target = ""
        if target.endswith(".kernel.o"):
            return original(self)  # the kernels: compiled now, beside the wrapper started before them
        wait()  # anything else (the link, the constants' object) after the wrapper, in AOTInductor's order
        if not target.endswith(".wrapper.o"):
            return original(self)
        done: Future = Future()  # the wrapper's object: compiled on a thread, waited for by whatever comes next

        def run() -> None:
            try:
                done.set_result(original(self))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
                done.set_exception(e)

        pending.append(done)
        threading.Thread(target=run, name="functrain-cxx-unit", daemon=True).start()
        return None

    cpp_builder.CppBuilder.build = build
    try:
        yield
        wait()
    finally:
        cpp_builder.CppBuilder.build = original
        for f in pending:  # (an error left the block: the compile still ends, its result is not needed)
            with contextlib.suppress(BaseException):
                f.result()


LEVELS = ("O0", "O1", "O2", "O3", "Os", "Og", "Oz")
"""The optimisation levels an entry function can be given (GCC's ``-O`` levels)."""

_ENTRY_START = "void inductor_entry_impl("   # inductor's JIT entry function (torch 2.13, 2.14), one per unit
_ENTRY_END = "} // inductor_entry_impl"
_PUSH = '#pragma GCC push_options\n#pragma GCC optimize ("{level}")'
_POP = "#pragma GCC pop_options"


def with_entry_level(source: str, level: str) -> str:
    """``source`` (the C++ of a JIT ``cpp_wrapper`` unit) with its entry function between GCC pragmas that build it
    at ``-<level>``; the rest of the unit is untouched. ``O3`` (the unit's own level), or a source without exactly
    one entry function (its start before its end), is returned as it is. Raises ``ValueError`` for a level not in
    :data:`LEVELS`."""
    if level not in LEVELS:
        raise ValueError(f"the entry function's optimisation level must be one of {', '.join(LEVELS)}; got {level!r}")
    if level == "O3":
        return source
    lines = source.split("\n")
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(_ENTRY_START)]
    ends = [i for i, line in enumerate(lines) if line.strip() == _ENTRY_END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        return source
    start, end = starts[0], ends[0]
    return "\n".join(lines[:start] + [_PUSH.format(level=level)] + lines[start:end + 1] + [_POP] + lines[end + 1:])


def _at_level(source: str, level: str) -> str:
    """:func:`with_entry_level` for a unit inductor's JIT loader is about to build, which has one entry function:
    where it cannot be placed, a warning says that this unit's entry is built at ``-O3``."""
    placed = with_entry_level(source, level)
    if placed is source and level != "O3":
        warnings.warn(f"ft.compile: this graph's C++ unit has no single {_ENTRY_START[:-1]!r} ... {_ENTRY_END!r} "
                      f"to build at -{level} (a torch that generates it otherwise): its entry function is built at "
                      f"-O3, as inductor wrote it; the results are the same, the C++ compile slower",
                      RuntimeWarning, stacklevel=2)
    return placed


_ENTRY_LOCK = threading.Lock()
_entry_depth = [0]   # blocks open now
_entry_saved: list = []  # what the outermost block replaced (``None``: an inherited method)


@contextlib.contextmanager
def entry_at_wrapper_level() -> Iterator[None]:
    """While compiling or loading CPU graphs: each JIT C++ wrapper unit inductor loads has its entry function built
    at ``aot_inductor.compile_wrapper_opt_level`` (inductor's configuration when the unit is loaded).

    Process-wide for the block's duration (inductor's ``CppWrapperCodeCache.load_pybinding``, the one call that
    hands a JIT wrapper unit's source to the compiler), installed by the outermost of nested or concurrent blocks
    and removed when the last ends. A unit loaded outside any block keeps the entry at ``-O3``: a different source,
    so a different entry in inductor's caches, never a wrong one."""
    try:
        from torch._inductor import codecache
    except ImportError:  # pragma: no cover - a torch without inductor
        yield
        return
    loader = codecache.CppWrapperCodeCache
    with _ENTRY_LOCK:
        _entry_depth[0] += 1
        if _entry_depth[0] == 1:
            own = loader.__dict__.get("load_pybinding")  # (torch 2.14 defines its own; 2.13 inherits its parent's)
            original = loader.load_pybinding.__func__

            def load_pybinding(klass: Any, *args: Any, **kwargs: Any) -> Any:
                from torch._inductor import config
                level = str(config.aot_inductor.compile_wrapper_opt_level)
                if "main_code" in kwargs:
                    kwargs["main_code"] = _at_level(kwargs["main_code"], level)
                elif len(args) > 1:
                    args = (args[0], _at_level(args[1], level), *args[2:])
                return original(klass, *args, **kwargs)

            loader.load_pybinding = classmethod(load_pybinding)
            _entry_saved[:] = [own]
    try:
        yield
    finally:
        with _ENTRY_LOCK:
            _entry_depth[0] -= 1
            if _entry_depth[0] == 0:
                own = _entry_saved.pop()
                if own is None:
                    del loader.load_pybinding
                else:
                    loader.load_pybinding = own
