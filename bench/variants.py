"""The variants: one training of a workload written in different ways.

Every variant has ``step(i)`` (one optimizer update on the workload's update
batch ``i``), ``params()`` and ``ema()`` (the final weights, by the module's
parameter names), and for compiled ones ``graphs`` (graphs compiled so far).

* ``torch_eager``   hand-written PyTorch: ``nn.Module`` + ``torch.optim.AdamW``
                    (its default, which on CPU is the single-tensor for-loop) +
                    backward + ``clip_grad_norm_`` + ``autocast``/``GradScaler``
                    + a ``torch._foreach_lerp_`` EMA, ``zero_grad(set_to_none=True)``.
                    The baseline of every ratio.
* ``functrain_eager``     the functrain step called eagerly.
* ``functrain_compiled``  ``ft.compile(step)`` (one graph, ``fullgraph=True``).

Diagnostic variants (``--diag``), to see where functrain's time goes:

* ``ft_compiled_noseed``  ``ft.compile(step)`` on a state from ``init(..., seed=None)``:
                          no RNG save/restore around the call.
* ``bare_compile``        ``torch.compile(step.apply, fullgraph=True)`` called directly
                          (state with ``seed=None``): no ``check_inputs``, no ``with_rng``,
                          no ``CompiledStep.__call__``.
* ``ft_compiled_donate``  ``ft.compile(step, donate=True)``.

The strongest PyTorch a user would write instead (``STRONG``, run on every workload by default):

* ``torch_eager_foreach`` ``torch_eager`` with ``AdamW(foreach=True)``.
* ``torch_eager_fused``   ``torch_eager`` with ``AdamW(fused=True)`` (the fused CPU kernel).
* ``torch_compiled``      ``torch.compile(model)`` (inductor, default mode) for forward + backward and
                          the documented compiled optimizer step,
                          ``@torch.compile(fullgraph=False) def opt_step(): opt.step()``, default
                          AdamW; loss, clip, EMA and ``zero_grad`` stay eager. With ``GradScaler`` (W4)
                          the step is skipped when the clipped gradient norm is not finite (the same
                          test ``scaler.step`` makes, one host read) and ``scaler.update()`` follows.

Diagnostic variants, continued:

* ``ft_compiled_owned``   ``ft.compile(step).runner(donate=True)``: ``ft.run``'s owned donation.
* ``ft_compiled_dynamo``  ``ft.compile(step, capture="dynamo")``: the Dynamo frame on every
                          call (the call path before the flat capture).
* ``ft_dynamo_donate``    the same with ``donate=True``.
"""
from __future__ import annotations

import time
from typing import Any

import torch

import functrain as ft

from .workloads import Workload, functrain_step, loss_of, make_model

__all__ = ["MAIN", "STRONG", "DIAG", "SWEEP_VARIANTS", "COMPILED", "make_variant", "dynamo_counts"]

MAIN = ("torch_eager", "functrain_eager", "functrain_compiled")
STRONG = ("torch_eager_foreach", "torch_eager_fused", "torch_compiled")
DIAG = ("ft_compiled_noseed", "bare_compile", "ft_compiled_donate", "ft_compiled_owned",
        "ft_compiled_dynamo", "ft_dynamo_donate")
# the transformer depth sweep (bench/steps.py --sweep)
SWEEP_VARIANTS = ("torch_eager", "torch_eager_foreach", "torch_eager_fused", "torch_compiled", "functrain_compiled",
                  "ft_compiled_owned")
COMPILED = frozenset({"functrain_compiled", "ft_compiled_noseed", "bare_compile", "ft_compiled_donate",
                      "ft_compiled_owned", "ft_compiled_dynamo", "ft_dynamo_donate", "torch_compiled"})


def dynamo_counts() -> tuple[int, int]:
    """(frames Dynamo compiled, graphs handed to a backend) so far in this process."""
    from torch._dynamo.utils import counters, get_compilation_metrics
    return len(get_compilation_metrics()), int(counters["stats"].get("unique_graphs", 0))


class Variant:
    name = ""
    compiled = False

    def __init__(self, wl: Workload):
        self.wl = wl
        self.first_call_s: float | None = None   # wall time of the first step (compiles, if compiled)
        self.graphs_warmup: int | None = None

    def step(self, i: int) -> None:
        raise NotImplementedError

    def params(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def ema(self) -> dict[str, torch.Tensor] | None:
        return None

    def host_tensors(self) -> list[torch.Tensor]:
        """Tensors that stay on the host even on a GPU run (their .item() is no device sync)."""
        return []

    def scale_info(self) -> str:
        """fp16 runs: updates applied (not skipped) and the current loss scale."""
        return ""

    @property
    def graphs(self) -> int | None:
        return None

    def first_step(self, i: int) -> None:
        """Run the first step and time it (the compile of a compiled variant)."""
        before = dynamo_counts()[1]
        t = time.perf_counter()
        self.step(i)
        self.first_call_s = time.perf_counter() - t
        if self.compiled:
            self.graphs_warmup = self.graphs if self.graphs is not None else dynamo_counts()[1] - before


# -- hand-written PyTorch ---------------------------------------------------------------------
class TorchEager(Variant):
    name = "torch_eager"

    def __init__(self, wl: Workload, foreach: bool | None = None, fused: bool | None = None):
        super().__init__(wl)
        if foreach:
            self.name = "torch_eager_foreach"
        if fused:
            self.name = "torch_eager_fused"
        device = next(iter(wl.init_state.values())).device
        self.dev = device.type
        self.model = make_model(wl).to(device)
        self.model.load_state_dict(wl.init_state)
        self.plist = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.plist, lr=wl.lr, foreach=foreach, fused=fused)
        self.forward = self.model
        self.opt_step = self.opt.step
        self.lossf = loss_of(wl)
        self.scaler = torch.amp.GradScaler(self.dev) if wl.fp16 else None
        self.ema_list = [p.detach().clone() for p in self.plist] if wl.ema is not None else None
        self.detached = [p.detach() for p in self.plist]

    def step(self, i: int) -> None:
        wl, model, opt, lossf = self.wl, self.forward, self.opt, self.lossf
        if wl.accum > 1:
            for x, y in wl.micro[i]:
                loss = lossf(model(x), y) / wl.accum
                loss.backward()
        elif self.scaler is not None:
            x, y = wl.batches[i]
            with torch.autocast(self.dev, dtype=torch.float16):
                loss = lossf(model(x), y)
            self.scaler.scale(loss).backward()
        else:
            x, y = wl.batches[i]
            loss = lossf(model(x), y)
            loss.backward()
        if self.scaler is not None:
            self.scaler.unscale_(opt)
            if wl.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.plist, wl.clip)
            self.scale_step(opt)
            self.scaler.update()
        else:
            if wl.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.plist, wl.clip)
            self.opt_step()
        if self.ema_list is not None:
            torch._foreach_lerp_(self.ema_list, self.detached, 1.0 - wl.ema)
        opt.zero_grad(set_to_none=True)

    def scale_step(self, opt: torch.optim.Optimizer) -> None:
        self.scaler.step(opt)           # .item() on found_inf: one host sync

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.named_parameters()}

    def host_tensors(self) -> list[torch.Tensor]:
        # torch.optim's per-param step counters live on the CPU (not capturable, not fused)
        return [s["step"] for s in self.opt.state.values() if torch.is_tensor(s.get("step"))
                and s["step"].device.type == "cpu"]

    def scale_info(self) -> str:
        if self.scaler is None:
            return ""
        st = self.opt.state[self.plist[0]]
        return f"{int(st['step'])} updates applied, loss scale {self.scaler.get_scale():g}"

    def ema(self) -> dict[str, torch.Tensor] | None:
        if self.ema_list is None:
            return None
        return dict(zip((k for k, _ in self.model.named_parameters()), self.ema_list))


class TorchCompiled(TorchEager):
    """``torch.compile(model)`` + the documented compiled ``optimizer.step()``."""
    name = "torch_compiled"
    compiled = True

    def __init__(self, wl: Workload):
        super().__init__(wl)
        if wl.fp16 and wl.clip is None:
            raise ValueError("torch_compiled with GradScaler needs clip: it skips the step on a non-finite grad norm")
        self.forward = torch.compile(self.model)
        opt = self.opt

        @torch.compile(fullgraph=False)
        def opt_step() -> None:
            opt.step()

        self.opt_step = opt_step
        self._last_norm: torch.Tensor | None = None

    def scale_step(self, opt: torch.optim.Optimizer) -> None:
        # GradScaler.step would call the uncompiled opt.step(); make its test here (one host read) instead.
        # unscale_ (called before clip) recorded found_inf for scaler.update().
        norm = self._last_norm
        if bool(torch.isfinite(norm)):
            self.opt_step()

    def step(self, i: int) -> None:
        if self.scaler is None:
            return super().step(i)
        wl, opt = self.wl, self.opt
        x, y = wl.batches[i]
        with torch.autocast(self.dev, dtype=torch.float16):
            loss = self.lossf(self.forward(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(opt)
        self._last_norm = torch.nn.utils.clip_grad_norm_(self.plist, wl.clip)
        self.scale_step(opt)
        self.scaler.update()
        opt.zero_grad(set_to_none=True)



# -- functrain ----------------------------------------------------------------------------------
class FunctrainEager(Variant):
    name = "functrain_eager"

    def __init__(self, wl: Workload):
        super().__init__(wl)
        self.fn, params, buffers = functrain_step(wl)
        self.state = self.fn.init(params, buffers)

    def step(self, i: int) -> None:
        self.state, _ = self.fn(self.state, self.wl.batches[i])

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.state.params)

    def ema(self) -> dict[str, torch.Tensor] | None:
        e = self.state.ema  # the EMA params (older functrain: the EmaState slot holding them)
        if e is None:
            return None
        return dict(e.params) if hasattr(e, "params") and not isinstance(e, dict) else dict(e)

    def scale_info(self) -> str:
        s = self.state.loss_scale
        if s is None:
            return ""
        return f"{int(self.state.opt_state.count)} updates applied, loss scale {float(s.scale):g}"


class FunctrainCompiled(FunctrainEager):
    name = "functrain_compiled"
    compiled = True

    def __init__(self, wl: Workload, *, seed: int | None = 0, donate: bool = False, name: str | None = None,
                 capture: str = "auto"):
        Variant.__init__(self, wl)
        step, params, buffers = functrain_step(wl)
        self.fn = ft.compile(step, donate=donate, capture=capture)
        self.state = self.fn.init(params, buffers, seed=seed)
        if name:
            self.name = name

    @property
    def graphs(self) -> int | None:
        return self.fn.compiles


class FunctrainOwned(FunctrainCompiled):
    """``ft.compile(step).runner(donate=True)``: the owned donation ``ft.run`` uses (in-place state updates)."""
    name = "ft_compiled_owned"

    def __init__(self, wl: Workload):
        super().__init__(wl, name=self.name)
        self.compiled_step = self.fn
        self.call = self.fn.runner(donate=True)

    def step(self, i: int) -> None:
        self.state, _ = self.call(self.state, self.wl.batches[i])

    @property
    def graphs(self) -> int | None:
        return self.compiled_step.compiles


class BareCompile(FunctrainEager):
    """``torch.compile(step.apply, fullgraph=True)``: what ``ft.compile`` adds nothing to."""
    name = "bare_compile"
    compiled = True

    def __init__(self, wl: Workload):
        Variant.__init__(self, wl)
        step, params, buffers = functrain_step(wl)
        self.fn = torch.compile(step.apply, fullgraph=True)
        self.state = step.init(params, buffers, seed=None)


def make_variant(name: str, wl: Workload) -> Variant:
    if name == "torch_eager":
        return TorchEager(wl)
    if name == "torch_eager_foreach":
        return TorchEager(wl, foreach=True)
    if name == "torch_eager_fused":
        return TorchEager(wl, fused=True)
    if name == "torch_compiled":
        return TorchCompiled(wl)
    if name == "functrain_eager":
        return FunctrainEager(wl)
    if name == "functrain_compiled":
        return FunctrainCompiled(wl)
    if name == "ft_compiled_noseed":
        return FunctrainCompiled(wl, seed=None, name=name)
    if name == "ft_compiled_donate":
        return FunctrainCompiled(wl, donate=True, name=name)
    if name == "ft_compiled_owned":
        return FunctrainOwned(wl)
    if name == "ft_compiled_dynamo":
        return FunctrainCompiled(wl, capture="dynamo", name=name)
    if name == "ft_dynamo_donate":
        return FunctrainCompiled(wl, capture="dynamo", donate=True, name=name)
    if name == "bare_compile":
        return BareCompile(wl)
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(MAIN + STRONG + DIAG)}")


def max_abs_diff(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    """Largest |a - b| over all tensors of two name -> tensor dicts (None if either is missing)."""
    if a is None or b is None:
        return None
    if set(a) != set(b):
        raise KeyError(f"parameter names differ: {sorted(set(a) ^ set(b))}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
