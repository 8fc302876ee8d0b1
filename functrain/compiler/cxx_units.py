"""An AOTInductor package's two C++ units built side by side, on two cores, not one after the other.

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
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from typing import Any, Iterator

__all__ = ["side_by_side"]


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
