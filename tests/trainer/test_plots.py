"""Metric plots (matplotlib figure and the SVG fallback), captioned sample grids, the end-of-run summary."""
from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET
import zlib

import numpy as np
import pytest

from functrain.trainer import plots
from functrain.trainer.images import _FONT, caption, image_grid, sample_path, text_bitmap, write_sample_grid
from functrain.trainer.plots import MetricHistory, metrics_figure, metrics_svg, write_metrics_plot
from functrain.trainer.summary import format_duration, run_summary

HISTORY = {
    "loss": [(s, 2.0 / s) for s in range(10, 1001, 10)],  # spans two decades: log y
    "grad_norm": [(s, 1.0 + 0.001 * s) for s in range(10, 1001, 10)],
    "lr": [(s, min(1.0, s / 100) * 1e-3) for s in range(10, 1001, 10)],
    "eval_loss": [(s, 1.5 - s / 2000) for s in (250, 500, 750, 1000)],
}


def read_png(path):
    """Decode the PNGs functrain writes (8-bit gray or RGB, filter 0 on every row), checking every chunk's CRC."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, color = header[:4]
    assert depth == 8 and color in (0, 2)
    channels = 3 if color == 2 else 1
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, w * channels + 1)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape((h, w, 3) if channels == 3 else (h, w))


# -- matplotlib ------------------------------------------------------------------------------------
def test_figure_has_one_labelled_axes_per_metric_with_steps_on_x():
    pytest.importorskip("matplotlib")
    fig = metrics_figure(HISTORY, title="run")
    assert len(fig.axes) == len(HISTORY)
    for ax, (name, points) in zip(fig.axes, HISTORY.items()):
        assert ax.get_xlabel() == "step"
        assert ax.get_ylabel().startswith(name)
        assert ax.get_title().startswith(f"{name}: ") and f"at step {points[-1][0]}" in ax.get_title()
        (line,) = ax.get_lines()
        np.testing.assert_array_equal(line.get_xdata(), [s for s, _ in points])
        np.testing.assert_allclose(line.get_ydata(), [v for _, v in points])
        assert len(ax.get_xticks()) >= 3 and len(ax.get_yticks()) >= 3
    loss_ax, grad_ax = fig.axes[0], fig.axes[1]
    assert loss_ax.get_yscale() == "log" and loss_ax.get_ylabel() == "loss (log scale)"  # said, not silent
    assert grad_ax.get_yscale() == "linear"
    assert fig._suptitle.get_text() == "run"


def test_plot_leaves_the_global_backend_and_pyplot_alone(tmp_path):
    pytest.importorskip("matplotlib")
    code = ("import matplotlib; matplotlib.use('svg'); import matplotlib.pyplot as plt\n"
            "from functrain.trainer.plots import write_metrics_plot\n"
            f"p = write_metrics_plot({str(tmp_path / 'm.png')!r}, {{'loss': [(1, 2.0), (2, 1.0)]}})\n"
            "assert matplotlib.get_backend().lower() == 'svg', matplotlib.get_backend()\n"
            "assert plt.get_fignums() == [], plt.get_fignums()\n"
            "print(p)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "m.png")


def test_written_png_is_a_real_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = write_metrics_plot(tmp_path / "metrics.png", HISTORY)
    assert path == str(tmp_path / "metrics.png")
    Image = pytest.importorskip("PIL.Image")  # matplotlib's own dependency; its PNGs use every filter
    img = np.asarray(Image.open(path).convert("RGB"))
    assert img.shape[0] >= 500 and img.shape[1] >= 900  # 2 x 2 panels
    assert (img[..., :3] < 80).any() and (img[..., :3] > 250).mean() > 0.5  # dark ink on a mostly white page
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_bad_history_is_refused_clearly():
    with pytest.raises(ValueError, match=r"history\['loss'\] must hold \(step, value\) pairs"):
        metrics_svg({"loss": [1.0, 2.0]})
    with pytest.raises(ValueError, match="'acc' is not in the history"):
        metrics_svg({"loss": [(1, 1.0)]}, metrics=["acc"])
    with pytest.raises(ValueError, match="backend must be one of"):
        write_metrics_plot("x.png", {"loss": [(1, 1.0)]}, backend="tk")


# -- the SVG fallback ------------------------------------------------------------------------------
def _svg_texts(root, cls):
    ns = "{http://www.w3.org/2000/svg}"
    return [t.text for t in root.iter(ns + "text") if t.get("class") == cls]


def test_svg_fallback_has_labels_ticks_and_step_x(tmp_path):
    path = write_metrics_plot(tmp_path / "metrics.svg", HISTORY, backend="svg", title="run")
    root = ET.parse(path).getroot()  # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    panels = [g for g in root.iter(ns + "g") if g.get("class") == "panel"]
    assert [g.get("id") for g in panels] == list(HISTORY)
    for g, (name, points) in zip(panels, HISTORY.items()):
        assert _svg_texts(g, "xlabel") == ["step"]
        assert _svg_texts(g, "ylabel")[0].startswith(name)
        xticks = [float(t) for t in _svg_texts(g, "xtick")]
        assert len(xticks) >= 3 and points[0][0] <= xticks[0] and xticks[-1] <= points[-1][0]
        assert len(_svg_texts(g, "ytick")) >= 2
        (line,) = [p for p in g.iter(ns + "polyline")]
        xs = [float(p.split(",")[0]) for p in line.get("points").split()]
        assert len(xs) == len(points) and xs == sorted(xs)
        # x positions are linear in the step: equal step gaps give equal pixel gaps
        steps = [s for s, _ in points]
        slope = (xs[-1] - xs[0]) / (steps[-1] - steps[0]) if len(steps) > 1 else 0
        np.testing.assert_allclose(xs, [xs[0] + slope * (s - steps[0]) for s in steps], atol=0.11)
    assert _svg_texts(panels[0], "ylabel") == ["loss (log scale)"]
    assert set(_svg_texts(panels[0], "ytick")) >= {"1e-2", "1e-1"}


def test_png_path_without_matplotlib_becomes_svg_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "_have_matplotlib", lambda: False)
    monkeypatch.setattr(plots, "_warned_fallback", False)
    with pytest.warns(UserWarning, match="matplotlib is not installed.*metrics.svg"):
        path = write_metrics_plot(tmp_path / "metrics.png", {"loss": [(1, 1.0), (2, 0.5)]})
    assert path == str(tmp_path / "metrics.svg") and os.path.exists(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        write_metrics_plot(tmp_path / "metrics.png", {"loss": [(1, 1.0), (2, 0.5)]})


def test_svg_handles_one_point_constants_and_non_finite_values():
    svg = metrics_svg({"a": [(5, 1.0)], "b": [(1, 3.0), (2, 3.0)], "c": [(1, float("nan")), (2, 1.0), (3, 0.5)],
                       "d": [(1, float("inf"))]})
    root = ET.fromstring(svg)
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert any("c: 0.5 at step 3 (1 non-finite not shown)" == t for t in titles)
    assert "no finite values" in titles


def test_metric_history_roundtrip_and_truncate():
    h = MetricHistory()
    for s in (10, 20, 30):
        h.add(s, {"loss": 1.0 / s, "flag": True, "name": "x", "nan": float("nan")})
    j = h.to_json()
    import json

    again = MetricHistory.from_json(json.loads(json.dumps(j, allow_nan=False)))
    assert list(again.as_dict()) == ["loss", "nan"]
    assert again.as_dict()["loss"] == h.as_dict()["loss"]
    assert all(np.isnan(v) for _, v in again.as_dict()["nan"])
    assert again.truncate(20).last("loss") == (20, 1.0 / 20)


# -- captioned sample grids ------------------------------------------------------------------------
def _read_text(bitmap):
    """Decode a 3x5-font bitmap (scale 1) back to text by matching each cell against the font table."""
    glyphs = {ch: text_bitmap(ch) for ch in _FONT}
    out = []
    for i in range(0, bitmap.shape[1] + 1, 4):
        cell = bitmap[:, i:i + 3]
        found = [ch for ch, g in glyphs.items() if g.shape == cell.shape and (g == cell).all()]
        assert len(found) >= 1, cell.astype(int)
        out.append(found[0])
    return "".join(out)


def test_font_glyphs_are_distinct_and_text_reads_back():
    shapes = {}
    for ch in _FONT:
        key = text_bitmap(ch).tobytes()
        assert key not in shapes, f"{ch!r} looks like {shapes.get(key)!r}"
        shapes[key] = ch
    assert _read_text(text_bitmap("step 1200: loss=0.25")) == "step 1200: loss=0.25"
    with pytest.raises(ValueError, match=r"no glyph for \['é'\]"):
        text_bitmap("café")


def test_sample_grid_is_captioned_with_the_step(tmp_path):
    images = np.random.default_rng(0).random((4, 1, 4, 6))
    path = write_sample_grid(sample_path(tmp_path, 1200), images, step=1200, scale=4)
    assert os.path.basename(path) == "sample-00001200.png"
    img = read_png(path)
    grid = image_grid(images, scale=4)
    s = 3  # caption scale min(scale, 3)
    strip = 7 * s
    width = img.shape[1]
    x = (width - grid.shape[1]) // 2
    np.testing.assert_array_equal(img[strip:, x:x + grid.shape[1]], grid)  # the grid itself is untouched
    ink = img[:strip] == 0
    ys, xs = np.nonzero(ink)
    text = ink[ys.min():ys.max() + 1, xs.min():xs.max() + 1][::s, ::s]
    assert _read_text(text) == "step 1200"
    # uncaptioned when neither step nor text is given
    plain = read_png(write_sample_grid(tmp_path / "p.png", images))
    np.testing.assert_array_equal(plain, grid)
    with pytest.raises(ValueError, match="uint8"):
        caption(np.zeros((4, 4)), "x")


# -- the summary -----------------------------------------------------------------------------------
def test_run_summary_lists_what_exists(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")

    class T:
        def where(self):
            return "W&B run abc (offline): wandb sync here"

    text = run_summary(results_folder=str(tmp_path), step=1000, total_steps=1000,
                       final_metrics={"lr": 1e-3, "loss": 0.25, "steps_per_s": 5.0}, wall_time_s=130.0,
                       compile_time_s=30.0, steps_run=1000,
                       outputs={"weights": str(tmp_path / "model.safetensors"), "ema": str(tmp_path / "ema.safetensors")},
                       trackers=[T(), object()])
    lines = text.splitlines()
    assert lines[0] == "finished step 1000/1000: loss 0.25, lr 0.001"
    assert lines[1] == "time 2 min 10 s (compile 30.0 s), 10.0 steps/s after compiling"
    assert f"results in {tmp_path}" in lines
    assert f"  weights: {tmp_path / 'model.safetensors'}" in lines
    assert not any("ema" in line for line in lines)  # a missing file is not announced
    assert lines[-1] == "  W&B run abc (offline): wandb sync here"
    assert format_duration(7620) == "2 h 07 min" and format_duration(float("nan")) == "?"
    assert re.match(r"finished step 3$", run_summary(results_folder=".", step=3).splitlines()[0])


def test_the_run_plot_leaves_out_the_compile_policys_record(tmp_path, monkeypatch):
    """The compile policy's decision goes to metrics.jsonl once (compile_decision, compile_cost_s, ...): numbers
    of bookkeeping, not curves; drawn as eight one-point panels they cost a run 0.7 s of plotting at each save."""
    from functrain.trainer import plots

    drawn = []
    monkeypatch.setattr(plots, "write_metrics_plot", lambda path, history, title=None, metrics=None: drawn.extend(
        metrics) or path)
    history = plots.MetricHistory()
    history.add(10, {"loss": 1.0, "lr": 0.1, "compile_decision": 0.0, "compile_cost_s": 20.0, "compile_gain_s": 0.5,
                     "compile_cores": 2, "steps_per_s_eager": 150.0, "custom": 3.0})
    plots.write_run_plot(str(tmp_path), history)
    assert drawn == ["loss", "lr", "custom"], drawn
