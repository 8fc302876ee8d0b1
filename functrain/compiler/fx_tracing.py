"""One lock for torch's tracers in this process: a trace, a compile and a graph walk never run at once.

``make_fx`` keeps the tracer it is running in a module global of torch (``proxy_tensor._CURRENT_MAKE_FX_TRACER``,
not per thread), and a higher-order op met during a trace (``invoke_subgraph``: the repeated blocks of
``reuse_blocks``) re-enters the tracer found there. Two threads tracing at once therefore trace into each other's
graphs: seen as ``AssertionError: parent_tracer.fx_tracer should not be None`` on torch 2.14.1, or worse, a wrong
graph. functrain traces on more than one thread of a process: the training thread traces and compiles (blocking,
or loading code from the caches), the Trainer's memory line retraces a capture through inductor's decompositions on
a thread of its own (:mod:`functrain.compiler.graph_peak`), and ``FUNCTRAIN_COMPILE_WORKER=thread`` compiles on a
thread. Each holds :data:`FX_TRACING` while it traces or compiles, so they take turns; the lock is reentrant (a
compile inside a trace's thread does not wait for itself).
"""
from __future__ import annotations

import threading

__all__ = ["FX_TRACING"]

FX_TRACING = threading.RLock()
"""Held by :func:`functrain.compiler.capture.trace`, :func:`functrain.compiler.backend.compile_graph` and the
memory estimate's retrace while they run torch's tracers."""
