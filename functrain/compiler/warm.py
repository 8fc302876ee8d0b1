"""Warm starts: a later process runs a packaged step from its first call, without a trace.

``ft.compile(step, cache_dir=..., package=True)``: when a process builds or loads a step's package (after a
trace), it also writes a *warm entry*, ``cache_dir/packages/warm-<pre-trace key>.json``: which package serves
the step for that input signature, and how its outputs become the new state (the capture's output plan, whether
it draws random numbers, which recycled buffers it writes, its output treespec's text). A later process
computes the pre-trace key (:mod:`functrain.compiler.prekey`: the step's code and settings walked, the input
signature, the torch build, the machine; no import of the tracer or the compiler), finds the entry, loads the
package with torch's C++ loader (milliseconds) and rebuilds the capture from the plan and its own inputs.

Not trusted blindly. An entry is signed with this user's package key (HMAC-SHA256, as packages are); and the
first call runs the eager step beside the loaded code on the same inputs: each floating leaf's change by the
step (the new value minus the input's; a metric's value) must agree with eager's within :data:`TOLERANCE`
(norm-wise, relative to eager's change; :data:`LOW_TOLERANCE` in 16-bit dtypes), integer leaves exactly, the
output structures alike. A mismatch (what a key cannot see: a patched library function, a global changed in
place) is said in a warning naming the leaf, the entry is deleted, the first call returns the eager result, and
the step is traced and compiled as without an entry. CPU packages draw random numbers with torch's own kernels
(inductor's ``fallback_random``), as eager does, so a step that draws is checked the same way; a graph that
draws on another device is not kept for a warm start.

Kept only for a capture that can be rebuilt from its plan: no tensor the step closes over (lifted from the
trace), no Python draws the capture branched on, every non-tensor output a JSON number, string or ``None``.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import math
import os
import warnings
from typing import Any

import optree
import torch

from .capture import Captured, Signature, tensor_metas
from .memory import Memory, Written
from .prekey import pretrace_key

__all__ = ["WarmStarts", "disagreement", "TOLERANCE", "LOW_TOLERANCE"]

_FORMAT = 1
TOLERANCE = 1e-3  # a floating leaf's change agrees with eager's within this, relative (norm-wise)
LOW_TOLERANCE = 5e-2  # the same in float16 / bfloat16


class WarmStarts:
    """The warm entries of one package folder (:class:`~functrain.compiler.package.Packages`).

    Attributes:
        loaded: entries this object loaded with their package before any trace (counted at the load: one whose
            first-call check then fails is counted in ``dropped`` too; one the other ranks had none for is run
            eagerly and traced).
        dropped: entries deleted after a failed check.
        written: entries this object wrote.
    """

    def __init__(self, packages: Any, structure: dict):
        self.packages = packages
        self.structure = structure  # the compile options that shape the graph (JSON-able)
        self.loaded = 0
        self.dropped = 0
        self.written = 0

    def key(self, step: Any, memory: str, s: Any, batch: Any) -> str | None:
        """The pre-trace key of ``step`` for the state ``s`` (``rng=None``) and ``batch`` (``None``: not keyable)."""
        leaves, spec = optree.tree_flatten((s, batch))
        sig = Signature(spec, leaves, len(optree.tree_leaves(s)))
        return pretrace_key(step, spec, sig.metas, sig.consts, {**self.structure, "memory": memory})

    def path(self, prekey: str) -> str:
        """The entry's file for ``prekey``."""
        return os.path.join(self.packages.folder, f"warm-{prekey}.json")

    def refusal(self, prekey: str) -> str:
        """The file that says why the graph of ``prekey`` cannot be packaged (:mod:`functrain.compiler.later`: no
        later run of that key tries again)."""
        return os.path.join(self.packages.folder, f"nopackage-{prekey}.json")

    def remember(self, prekey: str | None, cap: Captured, package: str) -> bool:
        """Write the entry for ``cap`` (compiled from package ``package``) under ``prekey``; ``False``: ``cap``
        cannot be rebuilt from a plan (see the module docstring), nothing written."""
        plan = self.plan(cap)
        if prekey is None or plan is None:
            return False
        self.write(prekey, plan, package)
        return True

    @staticmethod
    def plan(cap: Captured) -> dict | None:
        """What a later process needs besides its own inputs to rebuild ``cap`` around a loaded package (its
        output plan and structure; JSON-able), or ``None``: ``cap`` cannot be rebuilt from a plan (see the module
        docstring)."""
        if cap.constants or cap.draws is not None:
            return None
        devices = {m[3].type for m in cap.signature.metas}
        if cap.random and devices != {"cpu"}:
            return None  # (only the CPU package draws as eager does: the check could not pass)
        out_plan = []
        for p in cap.out_plan:
            if p is None:
                out_plan.append(None)
            elif isinstance(p, Written):
                out_plan.append({"written": p.j})
            elif isinstance(p[1], (type(None), bool, int, str)) or (isinstance(p[1], float) and math.isfinite(p[1])):
                out_plan.append({"const": p[1]})
            else:
                return None
        return {"format": _FORMAT, "out_plan": out_plan, "random": bool(cap.random),
                "recycled": list(cap.memory.recycled), "out_spec": repr(cap.out_spec),
                "state_spec": repr(cap.state_spec)}

    def write(self, prekey: str, plan: dict, package: str) -> None:
        """Write the entry under ``prekey``: ``plan`` (:meth:`plan`) naming package ``package``, signed."""
        text = json.dumps({**plan, "package": package}, sort_keys=True)
        self.packages.write_json(self.path(prekey), {"plan": text, "hmac": self.packages.sign(prekey, text)})
        self.written += 1

    def load(self, prekey: str | None, memory: str, s: Any, batch: Any) -> Captured | None:
        """The capture for ``(s, batch)`` rebuilt from the entry under ``prekey`` with its package loaded, not
        yet checked (:func:`disagreement`, then :meth:`drop` on a mismatch); ``None``: no usable entry (a
        damaged or unsigned one is deleted, with a warning)."""
        if prekey is None:
            return None
        path = self.path(prekey)
        try:
            with open(path, encoding="utf-8") as f:
                entry = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self.drop(prekey, f"it could not be read ({type(e).__name__}: {e})")
            return None
        text = entry.get("plan") if isinstance(entry, dict) else None
        if not isinstance(text, str) or not hmac.compare_digest(str(entry.get("hmac", "")),
                                                                 self.packages.sign(prekey, text)):
            self.drop(prekey, "it is not signed with this user's package key")
            return None
        plan = json.loads(text)
        fn = self.packages.load_key(plan["package"])
        if fn is None:  # (the package is gone or was rebuilt: the trace finds it again)
            self.drop(prekey, None)
            return None
        cap = _rebuild(plan, memory, s, batch, fn, prekey)
        if cap is None:
            self.drop(prekey, "its output plan does not fit this step's state")
            return None
        self.loaded += 1
        return cap

    def drop(self, prekey: str, why: str | None, then: str = "the step is traced and compiled as without it") -> None:
        """Delete the entry under ``prekey`` (a warning says ``why``, unless ``None``, and what happens ``then``)."""
        if why is not None:
            warnings.warn(f"ft.compile(package=True): the warm-start entry {self.path(prekey)!r} is not used: "
                          f"{why}; it is deleted and {then}", stacklevel=5)
        with contextlib.suppress(OSError):
            os.unlink(self.path(prekey))
        self.dropped += 1


def _rebuild(plan: dict, memory_kind: str, s: Any, batch: Any, fn: Any, prekey: str) -> Captured | None:
    """A :class:`Captured` for ``(s, batch)`` from an entry's plan, as :func:`~functrain.compiler.capture.trace`
    would have made it (but its graph)."""
    leaves, spec = optree.tree_flatten((s, batch))
    n_state = len(optree.tree_leaves(s))
    sig = Signature(spec, leaves, n_state)
    state_spec = optree.tree_structure(s)
    if repr(state_spec) != plan["state_spec"]:
        return None
    memory = Memory(memory_kind, [leaves[i] for i in sig.tensor_pos[:sig.n_state]])
    memory.recycled = tuple(plan["recycled"])
    out_plan = [None if p is None else Written(p["written"]) if "written" in p else ("const", p["const"])
                for p in plan["out_plan"]]
    example = [leaves[i] for i in sig.tensor_pos] + memory.example_buffers()
    step_t = getattr(s, "step", None)
    step_index = next((k for k, i in enumerate(sig.tensor_pos) if leaves[i] is step_t), None)
    return Captured(signature=sig, gm=None, inputs=None, metas=tensor_metas(example), fn=fn, constants=[],
                    memory=memory, out_spec=None, out_plan=out_plan, random=plan["random"], n_state=n_state,
                    state_spec=state_spec, trivial_out=all(p is None for p in out_plan), stable=None,
                    step_index=step_index, walk_gm=None, draws=None, warm=(prekey, plan["out_spec"]))


def disagreement(old: list, eager: list, compiled: list, paths: list) -> str | None:
    """Why the compiled outputs ``compiled`` disagree with ``eager`` (flat leaves; ``old``: the input value of
    each state leaf, ``None`` for a metric), or ``None`` when they agree (see the module docstring)."""
    for o, e, c, path in zip(old, eager, compiled, paths):
        if not torch.is_tensor(e):
            if torch.is_tensor(c) or not (e == c or (isinstance(e, float) and math.isnan(e) and c != c)):
                return f"{path}: {c!r} where the eager step gives {e!r}"
            continue
        if not torch.is_tensor(c) or c.shape != e.shape or c.dtype != e.dtype:
            return f"{path}: {_describe(c)} where the eager step gives {_describe(e)}"
        if not (e.is_floating_point() or e.is_complex()):
            if not torch.equal(c.cpu(), e.cpu()):
                return f"{path}: {c.tolist() if c.numel() <= 4 else 'values'} differ from the eager step's"
            continue
        e64, c64 = e.detach().double().cpu(), c.detach().double().cpu()
        finite = torch.isfinite(e64)
        if not torch.equal(finite, torch.isfinite(c64)) or not torch.equal(e64[~finite].nan_to_num(),
                                                                             c64[~finite].nan_to_num()):
            return f"{path}: its non-finite elements differ from the eager step's"
        base = o.detach().double().cpu()[finite] if torch.is_tensor(o) else 0.0
        de, dc = e64[finite] - base, c64[finite] - base
        tol = LOW_TOLERANCE if e.dtype in (torch.float16, torch.bfloat16) else TOLERANCE
        err, scale = float((dc - de).norm()), float(de.norm())
        floor = float(torch.finfo(e.dtype).eps) * (float(e64[finite].norm()) + 1e-30)
        if err > tol * scale + 4 * floor:
            return (f"{path}: differs from the eager step by {err:.3g} (norm), against a change of {scale:.3g} "
                    f"(allowed {tol:g} of it)")
    return None


def _describe(x: Any) -> str:
    return f"a {x.dtype} tensor of shape {tuple(x.shape)}" if torch.is_tensor(x) else repr(x)
