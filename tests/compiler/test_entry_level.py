"""A JIT C++ wrapper unit's entry function is built at the wrapper's optimisation level, the rest of the unit as
before (:func:`functrain.compiler.cxx_units.with_entry_level`,
:func:`~functrain.compiler.cxx_units.entry_at_wrapper_level`).

The end-to-end check (a real compile: the pragma in the unit inductor builds, the numbers bit for bit those of the
unit without it) is in tests/compiler/test_cpp_units.py; here, the source transform as a law and the scoped patch
of inductor's loader, observed through a spy on the call it makes next (nothing is compiled).
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("torch._inductor.codecache")
from torch._inductor import codecache, config  # noqa: E402

from functrain.compiler.cxx_units import LEVELS, entry_at_wrapper_level, with_entry_level  # noqa: E402

ENTRY = ["void inductor_entry_impl(", "    AtenTensorHandle* input_handles,", "    AtenTensorHandle* output_handles",
         ") {", "    cpp_fused_add_0(buf0, buf1);", "    output_handles[0] = buf1.release();",
         "} // inductor_entry_impl"]
OTHER = st.lists(st.sampled_from(['extern "C" void cpp_fused_add_0(const float* in_ptr0, float* out_ptr0)', "{",
                                  "}", "#include <torch/csrc/inductor/cpp_prefix.h>", "", "CACHE_TORCH_DTYPE(float32);",
                                  "    out_ptr0[x0] = in_ptr0[x0] + 1;"]), max_size=12)


@settings(max_examples=60, deadline=None)
@given(before=OTHER, after=OTHER, level=st.sampled_from([lv for lv in LEVELS if lv != "O3"]))
def test_the_entry_function_alone_is_wrapped_and_nothing_else_changes(before, after, level):
    source = "\n".join(before + ENTRY + after)
    out = with_entry_level(source, level).split("\n")
    start = len(before)
    assert out[start:start + 2] == ["#pragma GCC push_options", f'#pragma GCC optimize ("{level}")']
    assert out[start + 2:start + 2 + len(ENTRY)] == ENTRY
    assert out[start + 2 + len(ENTRY)] == "#pragma GCC pop_options"
    assert out[:start] + out[start + 2:start + 2 + len(ENTRY)] + out[start + 3 + len(ENTRY):] == source.split("\n")


@pytest.mark.parametrize("case", ["O3", "no entry", "two entries", "end before start", "no end"])
def test_a_source_it_cannot_place_or_need_not_is_left_as_it_is(case):
    source = "\n".join({
        "O3": ENTRY,
        "no entry": ['extern "C" void k();', "int main() {}"],
        "two entries": ENTRY + ENTRY,
        "end before start": ENTRY[-1:] + ENTRY[:-1],
        "no end": ENTRY[:-1] + ["}"],
    }[case])
    assert with_entry_level(source, "O3" if case == "O3" else "O0") == source


def test_an_unknown_level_is_named_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"one of O0, O1.*got 'O9'"):
        with_entry_level("\n".join(ENTRY), "O9")


@pytest.fixture
def spy(monkeypatch):
    """What inductor's loader hands on (``load_pybinding_async``'s main_code), nothing compiled."""
    seen = []

    def load_pybinding_async(cls, *args, **kwargs):
        seen.append(kwargs["main_code"] if "main_code" in kwargs else args[1])
        return lambda: "entry"

    monkeypatch.setattr(codecache.CppWrapperCodeCache, "load_pybinding_async", classmethod(load_pybinding_async))
    return seen


def _load(main_code, positional=False):
    if positional:
        return codecache.CppWrapperCodeCache.load_pybinding(["std::vector<AtenTensorHandle>"], main_code)
    return codecache.CppWrapperCodeCache.load_pybinding(argtypes=["std::vector<AtenTensorHandle>"],
                                                        main_code=main_code, num_outputs=1)


@pytest.mark.parametrize("positional", [False, True])
def test_the_loader_builds_the_entry_at_the_configured_level_inside_the_block_only(spy, positional):
    source = "\n".join(ENTRY)
    before = codecache.CppWrapperCodeCache.__dict__.get("load_pybinding")
    with config.patch({"aot_inductor.compile_wrapper_opt_level": "O1"}):
        assert _load(source, positional) == "entry"
        with entry_at_wrapper_level():
            assert _load(source, positional) == "entry"
            with config.patch({"aot_inductor.compile_wrapper_opt_level": "O0"}):
                _load(source, positional)
        _load(source, positional)
    assert spy == [source, with_entry_level(source, "O1"), with_entry_level(source, "O0"), source]
    assert codecache.CppWrapperCodeCache.__dict__.get("load_pybinding") is before  # restored as it was


def test_nested_blocks_keep_the_patch_until_the_last_ends(spy):
    source = "\n".join(ENTRY)
    before = codecache.CppWrapperCodeCache.__dict__.get("load_pybinding")
    with config.patch({"aot_inductor.compile_wrapper_opt_level": "O0"}):
        outer = entry_at_wrapper_level()
        inner = entry_at_wrapper_level()
        outer.__enter__()
        inner.__enter__()
        outer.__exit__(None, None, None)  # (threads end in any order)
        _load(source)
        inner.__exit__(None, None, None)
        _load(source)
    assert spy == [with_entry_level(source, "O0"), source]
    assert codecache.CppWrapperCodeCache.__dict__.get("load_pybinding") is before


def test_a_unit_whose_entry_cannot_be_placed_is_built_as_written_and_says_so(spy):
    """A source without a single entry function (a torch that names it otherwise) reaches the compiler unchanged,
    with a warning naming what was not found; at O3 nothing was asked for, and nothing is said."""
    source = "\n".join(['extern "C" void k();', "void inductor_entry_renamed(", ") {", "}"])
    with config.patch({"aot_inductor.compile_wrapper_opt_level": "O1"}), entry_at_wrapper_level():
        with pytest.warns(RuntimeWarning, match=r"no single 'void inductor_entry_impl' .* built at -O3"):
            _load(source)
    with config.patch({"aot_inductor.compile_wrapper_opt_level": "O3"}), entry_at_wrapper_level():
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _load(source)
    assert spy == [source, source]
