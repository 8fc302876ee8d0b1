"""A CPU graph's kernels are built as one C++ translation unit (inductor's ``cpp_wrapper``), with the same numbers.

Each C++ unit inductor builds pays a fixed ~0.7 CPU seconds (the precompiled header's load, the link against
libtorch) for ~0.1-0.2 s of its kernel (bench/compile_phases.py); inductor's default builds one unit per kernel;
``ft.compile`` builds a CPU graph's kernels and the code that calls them as one (``cpp_wrapper``) unless
``options`` says otherwise. The kernels are the same code either
way: the steps agree bit for bit, random draws (dropout, functrain's ``fallback_random``) and donation included.
The unit's entry function is built at the level of a package's wrapper (a GCC pragma around it,
:mod:`functrain.compiler.cxx_units`), with the same bits as inductor's own unit at ``-O3``.
"""
from __future__ import annotations

import uuid

import pytest
import torch

import functrain as ft

# A constant of this run's own, baked into the kernels' source: no earlier run's entry in inductor's caches (the
# machine's default folder, kept between runs) matches, so the compiles below build their C++ units here.
SCALE = 1.0 + (uuid.uuid4().int % 10**6) * 1e-9
# ... and a width of its own, which every kernel's source holds (the optimizer's kernels do not read SCALE: with
# the widths of another test of this process, the "apart" compile found them built and built one unit only)
WIDTH = 24 + uuid.uuid4().int % 2000


def loss_fn(params, buffers, batch):
    x, y = batch
    h = torch.nn.functional.dropout(torch.tanh(x @ params["w1"] + params["b1"]), 0.25)
    return SCALE * torch.nn.functional.mse_loss(h @ params["w2"], y)


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    """Per option set: the C++ units its compile built (target files) and its state and metrics after 3 steps."""
    from torch._inductor import cpp_builder, cpu_vec_isa

    built, sources, probing = [], [], [False]
    real_build, real_check = cpp_builder.CppBuilder.build, cpu_vec_isa.VecISA.check_build

    def build(self):  # a spy: the real build, its target noted unless it is inductor's CPU ISA probe
        if not probing[0]:
            built.append(self.get_target_file_path())
            sources.extend(open(p).read() for p in self.get_command_line().split() if p.endswith(".cpp"))
        return real_build(self)

    def check_build(self, code):
        probing[0] = True
        try:
            return real_check(self, code)
        finally:
            probing[0] = False

    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(13, WIDTH, generator=g), "b1": torch.randn(WIDTH, generator=g),
              "w2": torch.randn(WIDTH, 5, generator=g)}
    batches = [(torch.randn(6, 13, generator=g), torch.randn(6, 5, generator=g)) for _ in range(3)]
    step = ft.clip(1.0)(ft.train_step(loss_fn, ft.optim.adamw(1e-2)))
    cache = tmp_path_factory.mktemp("units")
    out = {}
    cpp_builder.CppBuilder.build, cpu_vec_isa.VecISA.check_build = build, check_build
    try:
        for name, options in (("one", None), ("apart", {"cpp_wrapper": False}),
                              ("O3", {"aot_inductor.compile_wrapper_opt_level": "O3"})):
            built.clear()
            sources.clear()
            cstep = ft.compile(step, donate=True, cache_dir=cache, **({"options": options} if options else {}))
            state = step.init({k: v.clone() for k, v in params.items()}, {}, seed=3)
            for batch in batches:
                state, metrics = cstep(state, batch)
            units = [t for t in built if t.endswith(".so")]  # (not the precompiled header's preprocessing)
            out[name] = (units, state, metrics, [t for t in sources if "inductor_entry_impl" in t])
    finally:
        cpp_builder.CppBuilder.build, cpu_vec_isa.VecISA.check_build = real_build, real_check
    return out


def test_a_cpu_graph_is_one_cpp_unit(units):
    one = units["one"][0]
    apart = units["apart"][0]
    assert len(one) == 1, one
    assert len(apart) > 1, apart  # inductor's own layout, as options={"cpp_wrapper": False} asks: a unit per kernel


@pytest.mark.parametrize("other", ["apart", "O3"])
def test_one_unit_computes_the_same_bits(units, other):
    _, s1, m1, _ = units["one"]
    _, s2, m2, _ = units[other]
    l1, l2 = ft.tree.tree_leaves((s1, m1)), ft.tree.tree_leaves((s2, m2))
    assert len(l1) == len(l2)
    for a, b in zip(l1, l2):
        if torch.is_tensor(a):
            assert torch.equal(a, b), (a, b)
        else:
            assert a == b


def test_the_entry_function_is_built_at_the_wrapper_level_and_the_kernels_are_not(units):
    """The unit's entry function (inductor_entry_impl) sits between GCC pragmas for the level of a package's
    wrapper (inductor's ``aot_inductor.compile_wrapper_opt_level``, O1 unless the environment says otherwise), and no
    kernel is defined between them; with the level set to O3 by ``options`` the unit has no such pragma (inductor's
    own unit)."""
    from torch._inductor import config
    level = config.aot_inductor.compile_wrapper_opt_level
    assert level != "O3"
    (source,) = units["one"][3]
    lines = source.split("\n")
    push = lines.index(f'#pragma GCC optimize ("{level}")')
    assert lines[push - 1] == "#pragma GCC push_options"
    assert lines[push + 1].startswith("void inductor_entry_impl(")
    pop = lines.index("#pragma GCC pop_options")
    assert lines[pop - 1] == "} // inductor_entry_impl"
    inside = "\n".join(lines[push:pop])
    kernels = [line for line in lines if line.startswith('extern "C"') and "cpp_fused" in line]
    assert kernels and 'extern "C"' not in inside
    assert source.count("#pragma GCC optimize") == 1
    (plain,) = units["O3"][3]
    assert "#pragma GCC optimize" not in plain and "push_options" not in plain


def _one_param_loss(params, buffers, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(x @ params["w"], y)


@pytest.mark.parametrize("capture", ["auto", "dynamo"])
def test_a_model_of_one_tensor_compiles_and_matches_eager(capture):
    """A list of one tensor from an op without a C shim (AdamW's ``_foreach_lerp`` over a model of one parameter,
    or a flat state) is read by torch's C++ wrapper as one tensor, and the step crashed (a segmentation fault in
    tests/core/test_flat.py): such a graph compiles with inductor's Python wrapper and equals the eager step."""
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(7, 3, generator=g)}
    batches = [(torch.randn(5, 7, generator=g), torch.randn(5, 3, generator=g)) for _ in range(3)]
    step = ft.clip(1.0)(ft.train_step(_one_param_loss, ft.optim.adamw(1e-2)))
    cstep = ft.compile(step, capture=capture, background=False)
    eager = compiled = step.init({"w": params["w"].clone()}, {})
    for batch in batches:
        eager, me = step(eager, batch)
        compiled, mc = cstep(compiled, batch)
    assert cstep.compiles == 1
    assert ft.tree.tree_allclose((eager, me), (compiled, mc), rtol=1e-5, atol=1e-6)
