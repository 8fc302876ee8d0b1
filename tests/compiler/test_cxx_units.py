"""A package's wrapper unit compiles beside its kernel unit, and every other build waits for it
(:func:`functrain.compiler.cxx_units.side_by_side`).

The builds are inductor's ``CppBuilder.build`` calls as AOTInductor makes them (wrapper ``.o``, kernel ``.o``,
constants ``.o``, then the link); the compiler itself is replaced by a stand-in that reports what ran when, so
that the order is a fact the test sees, not a timing: the wrapper's build does not end until the kernels' has
started, which only an overlap allows (one after the other, it would wait for its bounded timeout and fail). The constants' object is
not started early (tried: started beside the wrapper, it failed to compile in a real package build).
"""
from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch._inductor.cpp_builder")
from torch._inductor import cpp_builder  # noqa: E402

from functrain.compiler.cxx_units import side_by_side  # noqa: E402

WAIT_S = 30.0  # bound on every wait below: a failure, never a hang


class Builds:
    """The stand-in compiler: events for what started and ended, and the order of the ends."""

    def __init__(self, fail_wrapper: bool = False, objects: int = 3):
        self.objects = objects
        self.kernel_started = threading.Event()
        self.ended: list[str] = []
        self.fail_wrapper = fail_wrapper

    def build(self, builder) -> None:
        target = builder.get_target_file_path()
        if target.endswith(".wrapper.o"):
            if not self.kernel_started.wait(WAIT_S):
                raise AssertionError("the wrapper's build ran alone: the kernels' build never started beside it")
            if self.fail_wrapper:
                raise RuntimeError("the wrapper's compile failed")
        elif target.endswith(".kernel.o"):
            self.kernel_started.set()
        elif target.endswith(".so"):
            assert len(self.ended) == self.objects, self.ended  # the link reads every object
        self.ended.append(target.rsplit(".", 2)[-2] + "." + target.rsplit(".", 1)[-1])


def builder(name: str):
    b = object.__new__(cpp_builder.CppBuilder)
    b._functrain_test_target = name
    return b


@pytest.fixture
def fake_compiler(monkeypatch):
    def install(builds: Builds) -> None:
        monkeypatch.setattr(cpp_builder.CppBuilder, "build", lambda self: builds.build(self))
        monkeypatch.setattr(cpp_builder.CppBuilder, "get_target_file_path",
                            lambda self: self._functrain_test_target)
    return install


def aoti_order() -> None:
    """The builds in AOTInductor's order (torch/_inductor/codecache.py, ``AotCodeCompiler.compile``)."""
    builder("/c/abc.wrapper.o").build()
    builder("/c/def.kernel.o").build()
    builder("/c/ghi.weights.o").build()
    builder("/c/abc.wrapper.so").build()


def test_the_wrapper_compiles_beside_the_kernels_and_the_link_waits_for_both(fake_compiler):
    builds = Builds()
    fake_compiler(builds)
    before = cpp_builder.CppBuilder.build
    with side_by_side():
        aoti_order()
    # the kernels beside the wrapper (which waited for them to start); the constants' object after the wrapper
    assert builds.ended == ["kernel.o", "wrapper.o", "weights.o", "wrapper.so"]
    assert cpp_builder.CppBuilder.build is before  # put back at the end of the block


def test_the_block_waits_for_objects_no_link_read(fake_compiler):
    builds = Builds(objects=2)
    builds.kernel_started.set()
    fake_compiler(builds)
    with side_by_side():
        builder("/c/abc.wrapper.o").build()
    assert builds.ended == ["wrapper.o"]  # done when the block ended


def test_without_it_the_wrapper_waits_alone(fake_compiler):
    """The stand-in's premise: built one after the other, the wrapper's build fails (after its bounded wait)."""
    builds = Builds()
    builds.kernel_started.wait = lambda timeout: False  # (no 30 s wait here: serial order never starts it first)
    fake_compiler(builds)
    with pytest.raises(AssertionError, match="ran alone"):
        aoti_order()


def test_a_failed_wrapper_compile_fails_the_link_with_its_own_error(fake_compiler):
    builds = Builds(fail_wrapper=True)
    fake_compiler(builds)
    with pytest.raises(RuntimeError, match="the wrapper's compile failed"):
        with side_by_side():
            aoti_order()
    assert "wrapper.so" not in builds.ended


def test_builds_of_other_threads_are_left_alone(fake_compiler):
    builds = Builds()
    builds.kernel_started.wait = lambda timeout: True
    fake_compiler(builds)
    seen = []
    with side_by_side():
        t = threading.Thread(target=lambda: (builder("/c/x.wrapper.o").build(), seen.append(list(builds.ended))))
        t.start()
        t.join(WAIT_S)
    assert seen == [["wrapper.o"]]  # built on its own thread, at once, before the call returned
