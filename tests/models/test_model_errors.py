"""A model that cannot be compiled is told why by name: the operation, the model's line, what to do.

Each failure is provoked in a real transformers GPT-2 (a tiny config, tests/models/tiny_models.py): a host read
patched into its attention, an operator with no fake (shape) implementation, and a graph inductor cannot lower
(the capture's view-to-reshape pass turned off: the failure GPT-2 had before it, issue 38). Each must raise
``ft.GraphBreakError`` (a ``BackendError`` for the backend) whose ``what`` names the operation and whose ``where``
is the line in the model's (or the patch's) source. transformers' ``logger.warning_once`` is no graph break under
``capture="dynamo"``.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import functrain as ft

pytest.importorskip("transformers")

from tiny_models import documented_step  # noqa: E402
from transformers.models.gpt2 import modeling_gpt2  # noqa: E402


def _line_of(fn, marker: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


def _eager_gpt2(monkeypatch, attention):
    """GPT-2 with eager attention, its attention function replaced by ``attention``."""
    monkeypatch.setattr(modeling_gpt2, "eager_attention_forward", attention)
    step, state, batch, model = documented_step("gpt2")
    model.config._attn_implementation = "eager"
    return step, state, batch(0)


def attention_with_item(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scale = query.abs().amax().item()  # HOST READ
    weights = torch.softmax(torch.matmul(query, key.transpose(-1, -2)) / max(scale, 1.0), dim=-1)
    return torch.matmul(weights, value).transpose(1, 2), weights


def test_item_in_attention_names_the_line(monkeypatch):
    step, state, batch = _eager_gpt2(monkeypatch, attention_with_item)
    step(state, batch)  # (the eager step runs)
    with pytest.raises(ft.GraphBreakError) as info:
        ft.compile(step, backend="aot_eager", background=False)(state, batch)
    e = info.value
    assert e.what == "item"
    assert e.where.file == __file__ and e.where.line == _line_of(attention_with_item, "HOST READ")
    assert "attention_with_item" in str(e) and "fullgraph=False" in str(e)


@pytest.fixture(scope="module")
def no_fake_op():
    """An operator with a CPU kernel and no fake (shape) implementation: eager runs it, a trace cannot."""
    lib = torch.library.Library("ft_h38", "DEF")
    lib.define("halve(Tensor x) -> Tensor")
    lib.impl("halve", lambda x: x * 0.5, "CPU")
    yield torch.ops.ft_h38.halve
    lib._destroy()


def test_an_op_the_trace_cannot_run_names_the_line(monkeypatch, no_fake_op):
    def attention_with_custom_op(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        scores = torch.matmul(query, key.transpose(-1, -2))
        weights = torch.softmax(scores + no_fake_op(scores.detach()).mean() * 0, dim=-1)  # CUSTOM OP
        return torch.matmul(weights, value).transpose(1, 2), weights

    step, state, batch = _eager_gpt2(monkeypatch, attention_with_custom_op)
    with pytest.raises(ft.GraphBreakError) as info:
        ft.compile(step, backend="aot_eager", background=False)(state, batch)
    e = info.value
    assert e.where is not None and e.where.file == __file__
    assert e.where.line == _line_of(attention_with_custom_op, "CUSTOM OP")
    assert e.what is not None and str(e.where.line) in str(e)


def test_a_graph_inductor_cannot_lower_names_the_models_line(monkeypatch):
    """Without the capture's reshape pass, GPT-2's ``matmul(query, key.transpose(-1, -2))`` is a ``view`` inductor
    cannot take (its ``cat`` decomposition changes the key's strides): the error is a ``BackendError`` at the
    model's own line, with what to do."""
    from functrain.compiler import capture

    monkeypatch.setattr(capture, "reshape_views", lambda gm: 0)
    step, state, batch = _eager_gpt2(monkeypatch, modeling_gpt2.eager_attention_forward)
    with pytest.raises(ft.compiler.errors.BackendError) as info:
        ft.compile(step, background=False)(state, batch)
    e = info.value
    assert isinstance(e, ft.GraphBreakError) and e.stage == "backend"
    assert e.what == "aten.view"
    assert e.where is not None and e.where.file == inspect.getsourcefile(modeling_gpt2)
    assert e.where.line == _line_of(modeling_gpt2.eager_attention_forward, "torch.matmul(query, key.transpose")
    assert 'capture="dynamo"' in str(e) and "Cannot view a tensor" in str(e)


def test_transformers_warning_once_is_no_graph_break_under_dynamo():
    """GPT-2's loss warns once (``logger.warning_once``) about its config's ``loss_type``; under Dynamo that was a
    graph break (with fullgraph=True, an error). The step is one graph."""
    step, state, batch, _ = documented_step("gpt2")
    compiled = ft.compile(step, capture="dynamo", backend="aot_eager", background=False)
    for i in range(2):
        state, _ = compiled(state, batch(i))
    assert compiled.compiles == 1
