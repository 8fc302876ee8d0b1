"""Metric plots: one panel per metric, the step on x, labelled axes with ticks and numbers.

With matplotlib installed (the ``plots`` extra) the figure is drawn through its
object-oriented API on an Agg canvas of its own: the global backend and pyplot's
figure list are never touched, so plotting from a training run cannot disturb a
notebook or a GUI session. Without matplotlib the same layout is written as SVG
by a small built-in writer: SVG keeps real text (axis labels, tick numbers,
titles stay sharp and searchable at any zoom and need no font tables), every
browser shows it, and it is a few dozen lines instead of a bitmap font. A ``.png``
path then becomes ``.svg``, with a warning once per process saying so.

The y axis is logarithmic only when every value is positive and they span at
least two decades, and the axis label then says ``(log scale)``.

Example::

    history = MetricHistory()
    for step in range(1, 101):
        history.add(step, {"loss": 1 / step, "lr": 1e-3})
    path = write_metrics_plot("results/metrics.png", history)   # "results/metrics.png" (or .svg)
"""
from __future__ import annotations

import base64
import binascii
import math
import os
import sys
import warnings
from array import array
from html import escape
from typing import Any, Iterable, Mapping, Sequence

from ..checkpoint.safe_io import replace_file
from ..core.validate import BadValue, check_choice, describe

__all__ = ["MetricHistory", "metrics_figure", "metrics_svg", "write_metrics_plot", "write_run_plot"]

History = Mapping[str, Sequence[tuple]]


class MetricHistory:
    """The logged metrics, ``{name: [(step, value), ...]}``, JSON-able for a checkpoint's ``extra``.

    Example::

        >>> h = MetricHistory()
        >>> h.add(10, {"loss": 0.5, "lr": 1e-3, "note": "text is skipped"})
        >>> h.add(20, {"loss": 0.25})
        >>> h.as_dict()
        {'loss': [(10, 0.5), (20, 0.25)], 'lr': [(10, 0.001)]}
        >>> MetricHistory.from_json(h.to_json()).truncate(10).as_dict()
        {'loss': [(10, 0.5)], 'lr': [(10, 0.001)]}
    """

    def __init__(self, data: History | None = None):
        self._data: dict[str, list[tuple[int, float]]] = {}
        for name, points in (data or {}).items():
            self._data[str(name)] = [(int(s), float(v)) for s, v in points]

    def add(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record every real-valued metric (bools and strings are skipped) at ``step``."""
        for name, value in metrics.items():
            if isinstance(value, (bool, str, bytes)):
                continue
            if not isinstance(value, (int, float)):
                try:
                    value = float(value)  # 0-dim tensors and numpy scalars
                except (TypeError, ValueError):
                    continue
            self._data.setdefault(str(name), []).append((int(step), float(value)))

    def truncate(self, step: int) -> "MetricHistory":
        """Drop the points after ``step`` (a resume from an older checkpoint); returns ``self``."""
        for name in list(self._data):
            self._data[name] = [(s, v) for s, v in self._data[name] if s <= step]
            if not self._data[name]:
                del self._data[name]
        return self

    def as_dict(self) -> dict[str, list[tuple[int, float]]]:
        return {k: list(v) for k, v in self._data.items()}

    def last(self, name: str) -> tuple[int, float] | None:
        """The last ``(step, value)`` of ``name``, or ``None``."""
        points = self._data.get(name)
        return points[-1] if points else None

    PACKED = "functrain.history.packed-v1"

    def to_json(self) -> dict[str, Any]:
        """The history as a small JSON value: each metric's steps and values packed (little-endian int64 and
        float64, base64), ``{"format": PACKED, "metrics": {name: {"steps": ..., "values": ...}}}``.

        Packed, a long history is 21 bytes of JSON per point (``[step, value]`` pairs took ~20) and parses
        into one string per metric: it stays far inside the memory bound a checkpoint's ``extra.json`` is
        read under (:mod:`functrain.checkpoint.bounded`), where the pairs cost 7-14 times their size.
        Non-finite values are kept exactly.
        """
        metrics = {}
        for name, pts in self._data.items():
            steps, values = array("q", (p[0] for p in pts)), array("d", (p[1] for p in pts))
            if sys.byteorder == "big":  # pragma: no cover - the format is little-endian everywhere
                steps.byteswap()
                values.byteswap()
            metrics[name] = {"steps": base64.b64encode(steps.tobytes()).decode("ascii"),
                             "values": base64.b64encode(values.tobytes()).decode("ascii")}
        return {"format": self.PACKED, "metrics": metrics}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "MetricHistory":
        """The history from :meth:`to_json`'s value, or from the ``{name: [[step, value], ...]}`` pairs that
        older checkpoints hold; ``ValueError`` names what is malformed."""
        if not isinstance(data, Mapping):
            raise BadValue(f"a metric history must be a JSON object; got {describe(data)}")
        if data.get("format") != cls.PACKED:
            try:
                return cls({k: [(s, float(v)) for s, v in pts] for k, pts in data.items()})
            except (TypeError, ValueError) as e:
                raise BadValue(f"a metric history holds [step, value] pairs per metric: {e}") from None
        metrics = data.get("metrics")
        if not isinstance(metrics, Mapping):
            raise BadValue(f"a packed metric history needs 'metrics'; got {describe(metrics)}")
        out = cls()
        for name, col in metrics.items():
            try:
                steps, values = array("q"), array("d")
                steps.frombytes(base64.b64decode(col["steps"], validate=True))
                values.frombytes(base64.b64decode(col["values"], validate=True))
            except (TypeError, KeyError, ValueError, binascii.Error) as e:
                raise BadValue(f"metric history {describe(name, 60)}: its steps and values are not packed int64 "
                               f"and float64 ({type(e).__name__}: {e})") from None
            if len(steps) != len(values):
                raise BadValue(f"metric history {describe(name, 60)}: {len(steps)} steps but {len(values)} values")
            if sys.byteorder == "big":  # pragma: no cover
                steps.byteswap()
                values.byteswap()
            out._data[str(name)] = list(zip(steps, values))
        return out

    def __len__(self) -> int:
        return len(self._data)


def _series(history: Any, metrics: Sequence[str] | None) -> list[tuple[str, list[int], list[float]]]:
    """``[(name, steps, values)]`` checked: names are strings, points are ``(step, value)`` pairs."""
    if isinstance(history, MetricHistory):
        history = history.as_dict()
    if not isinstance(history, Mapping):
        raise BadValue(f"history must be {{metric: [(step, value), ...]}} or a MetricHistory; got {describe(history)}")
    names = list(history) if metrics is None else list(metrics)
    out = []
    for name in names:
        if name not in history:
            raise BadValue(f"metric {name!r} is not in the history; it has {sorted(history)}")
        steps, values = [], []
        for point in history[name]:
            try:
                s, v = point
                steps.append(float(s))
                values.append(float(v))
            except (TypeError, ValueError):
                raise BadValue(f"history[{name!r}] must hold (step, value) pairs; got {describe(point)}") from None
        out.append((str(name), steps, values))
    return out


def _finite(steps: list[float], values: list[float]) -> tuple[list[float], list[float], int]:
    pts = [(s, v) for s, v in zip(steps, values) if math.isfinite(s) and math.isfinite(v)]
    return [s for s, _ in pts], [v for _, v in pts], len(steps) - len(pts)


def _log_y(values: list[float]) -> bool:
    return bool(values) and min(values) > 0 and max(values) / min(values) >= 100.0


def _title(name: str, steps: list[float], values: list[float], skipped: int) -> str:
    text = name if not values else f"{name}: {values[-1]:.4g} at step {int(steps[-1])}"
    return text + (f" ({skipped} non-finite not shown)" if skipped else "")


def _layout(n: int) -> tuple[int, int]:
    cols = 1 if n == 1 else 2 if n <= 4 else 3
    return math.ceil(n / cols), cols


# -- matplotlib ---------------------------------------------------------------------------------
def metrics_figure(history: Any, *, title: str | None = None, metrics: Sequence[str] | None = None) -> Any:
    """A matplotlib ``Figure`` with one ``Axes`` per metric (x: step), on its own Agg canvas.

    Needs matplotlib (``pip install 'functrain[plots]'``). The figure is not
    registered with pyplot; save it with ``fig.savefig(path)``.

    Example::

        fig = metrics_figure({"loss": [(1, 2.0), (2, 1.0)]})
        fig.axes[0].get_xlabel()   # 'step'
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = _series(history, metrics)
    if not series:
        raise BadValue("history has no metrics to plot")
    rows, cols = _layout(len(series))
    fig = Figure(figsize=(5.0 * cols, 3.2 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[len(series):]:
        ax.remove()  # exactly one Axes per metric
    for ax, (name, steps, values) in zip(axes, series):
        xs, ys, skipped = _finite(steps, values)
        log = _log_y(ys)
        ax.plot(xs, ys, color="tab:blue", linewidth=1.4, marker="o" if len(xs) < 30 else None, markersize=3)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(name + (" (log scale)" if log else ""))
        ax.set_title(_title(name, xs, ys, skipped), fontsize=10)
        ax.grid(True, alpha=0.3)
        if not xs:
            ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
    if title:
        fig.suptitle(title)
    return fig


# -- SVG ----------------------------------------------------------------------------------------
def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k apart) covering ``[lo, hi]``."""
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / max(count - 1, 1)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(0.0 if abs(t) < step * 1e-9 else t)
        t += step
    return ticks


def _fmt(v: float) -> str:
    return f"{int(round(v))}" if abs(v - round(v)) < 1e-9 and abs(v) < 1e7 else f"{v:.3g}"


def _svg_panel(name: str, steps: list[float], values: list[float], x0: float, y0: float, w: float,
               h: float) -> list[str]:
    xs, ys, skipped = _finite(steps, values)
    log = _log_y(ys)
    left, right, top, bottom = 70.0, 15.0, 28.0, 42.0
    px0, px1, py0, py1 = x0 + left, x0 + w - right, y0 + top, y0 + h - bottom
    out = [f'<rect x="{px0:.1f}" y="{py0:.1f}" width="{px1 - px0:.1f}" height="{py1 - py0:.1f}" '
           f'fill="none" stroke="#444"/>',
           f'<text x="{(px0 + px1) / 2:.1f}" y="{y0 + 18:.1f}" text-anchor="middle" font-size="13">'
           f'{escape(_title(name, xs, ys, skipped))}</text>',
           f'<text class="xlabel" x="{(px0 + px1) / 2:.1f}" y="{py1 + 34:.1f}" text-anchor="middle" '
           f'font-size="12">step</text>',
           f'<text class="ylabel" x="{x0 + 14:.1f}" y="{(py0 + py1) / 2:.1f}" text-anchor="middle" font-size="12" '
           f'transform="rotate(-90 {x0 + 14:.1f} {(py0 + py1) / 2:.1f})">{escape(name)}'
           f'{" (log scale)" if log else ""}</text>']
    if not xs:
        out.append(f'<text x="{(px0 + px1) / 2:.1f}" y="{(py0 + py1) / 2:.1f}" text-anchor="middle" '
                   f'font-size="12">no finite values</text>')
        return out
    tv = [math.log10(v) for v in ys] if log else ys
    xlo, xhi = min(xs), max(xs)
    ylo, yhi = min(tv), max(tv)
    if xhi == xlo:
        xlo, xhi = xlo - 1, xhi + 1
    if yhi == ylo:
        pad = abs(ylo) * 0.1 or 1.0
        ylo, yhi = ylo - pad, yhi + pad
    else:
        pad = (yhi - ylo) * 0.05
        ylo, yhi = ylo - pad, yhi + pad

    def sx(x: float) -> float:
        return px0 + (x - xlo) / (xhi - xlo) * (px1 - px0)

    def sy(y: float) -> float:
        return py1 - (y - ylo) / (yhi - ylo) * (py1 - py0)

    for t in _nice_ticks(xlo, xhi):
        out.append(f'<line x1="{sx(t):.1f}" y1="{py1:.1f}" x2="{sx(t):.1f}" y2="{py1 + 5:.1f}" stroke="#444"/>')
        out.append(f'<text class="xtick" x="{sx(t):.1f}" y="{py1 + 18:.1f}" text-anchor="middle" '
                   f'font-size="11">{_fmt(t)}</text>')
    yticks = [float(k) for k in range(math.ceil(ylo), math.floor(yhi) + 1)] if log else _nice_ticks(ylo, yhi)
    for t in yticks:
        label = f"1e{int(t)}" if log else _fmt(t)
        out.append(f'<line x1="{px0 - 5:.1f}" y1="{sy(t):.1f}" x2="{px0:.1f}" y2="{sy(t):.1f}" stroke="#444"/>')
        out.append(f'<line x1="{px0:.1f}" y1="{sy(t):.1f}" x2="{px1:.1f}" y2="{sy(t):.1f}" stroke="#ddd"/>')
        out.append(f'<text class="ytick" x="{px0 - 8:.1f}" y="{sy(t) + 4:.1f}" text-anchor="end" '
                   f'font-size="11">{label}</text>')
    points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, tv))
    out.append(f'<polyline class="series" points="{points}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>')
    return out


def metrics_svg(history: Any, *, title: str | None = None, metrics: Sequence[str] | None = None) -> str:
    """The same layout as :func:`metrics_figure` as an SVG document (no dependencies).

    Example::

        svg = metrics_svg({"loss": [(1, 2.0), (2, 1.0)]})   # '<svg ...>...<text class="xlabel" ...>step</text>...'
    """
    series = _series(history, metrics)
    if not series:
        raise BadValue("history has no metrics to plot")
    rows, cols = _layout(len(series))
    pw, ph, head = 500.0, 320.0, 30.0 if title else 0.0
    width, height = pw * cols, ph * rows + head
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif">',
            f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>']
    if title:
        body.append(f'<text x="{width / 2:.1f}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>')
    for i, (name, steps, values) in enumerate(series):
        r, c = divmod(i, cols)
        body.append(f'<g class="panel" id="{escape(name, quote=True)}">')
        body.extend(_svg_panel(name, steps, values, c * pw, head + r * ph, pw, ph))
        body.append("</g>")
    body.append("</svg>")
    return "\n".join(body) + "\n"


# -- writing --------------------------------------------------------------------------------------
_warned_fallback = False


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _atomic_write(path: str, write: Any) -> None:
    """``write(f)`` into a new temporary file (opened ``O_EXCL``, never through a link), then renamed over
    ``path`` (refused if ``path`` is a link): a viewer never sees a half-written plot."""
    replace_file(path, write, what="the metrics plot")


def write_metrics_plot(path: str | os.PathLike, history: Any, *, title: str | None = None,
                       metrics: Iterable[str] | None = None, backend: str = "auto") -> str:
    """Write the metrics plot to ``path`` and return the path written (atomically replaced).

    ``history`` is ``{metric: [(step, value), ...]}`` or a :class:`MetricHistory`;
    ``metrics`` picks and orders the panels (default: all, in the history's order).
    ``backend``: ``"auto"`` (matplotlib if installed, else SVG), ``"matplotlib"``
    or ``"svg"``. matplotlib writes the format of the path's extension (``.png``,
    ``.svg``, ``.pdf``); the SVG writer writes SVG, so a path not ending in ``.svg``
    gets that suffix instead (with a warning once per process for ``"auto"``).

    Example::

        write_metrics_plot("results/metrics.png", {"loss": [(10, 2.3), (20, 1.9)], "lr": [(10, 1e-3), (20, 1e-3)]})
    """
    global _warned_fallback
    check_choice("backend", backend, ("auto", "matplotlib", "svg"))
    path = os.fspath(path)
    names = None if metrics is None else list(metrics)
    use_mpl = backend == "matplotlib" or (backend == "auto" and _have_matplotlib())
    if use_mpl:
        fig = metrics_figure(history, title=title, metrics=names)
        fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
        _atomic_write(path, lambda f: fig.savefig(f, format=fmt))
        return path
    svg = metrics_svg(history, title=title, metrics=names)
    root, ext = os.path.splitext(path)
    if ext.lower() != ".svg":
        if backend == "auto" and not _warned_fallback:
            _warned_fallback = True
            warnings.warn(f"matplotlib is not installed: metric plots are written as SVG ({root}.svg) instead of "
                          f"{path}; pip install 'functrain[plots]' for PNG", stacklevel=2)
        path = root + ".svg"

    _atomic_write(path, svg.encode("utf-8"))
    return path


# the trainer's plot: the headline metrics first, then the rest but bookkeeping (kept in metrics.jsonl and the
# history, not curves; the compile policy's decision, compile_*, too)
_FIRST = ("loss", "eval_loss", "eval_loss_ema", "grad_norm", "lr")
_NOT_PLOTTED = ("steps_per_s", "compile_s", "skipped", "skipped_updates", "eval_samples", "switched_at",
                "steps_per_s_eager", "steps_per_s_compiled")


def write_run_plot(folder: str, history: "MetricHistory") -> str | None:
    """The trainer's ``metrics.png`` in ``folder``: one panel per metric, the headline ones first, counters and
    rates left out; ``None`` (nothing written) before the first logged metric."""
    present = history.as_dict()
    first = [m for m in _FIRST if m in present]
    rest = [m for m in present if m not in first and m not in _NOT_PLOTTED and not m.startswith("compile_")]
    if not first + rest:
        return None
    return write_metrics_plot(os.path.join(folder, "metrics.png"), history,
                              title=os.path.basename(os.path.abspath(folder)), metrics=first + rest)
