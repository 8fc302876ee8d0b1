"""TrainConfig: validation with clear errors, YAML/JSON round trips, diffs; PNG helpers."""
import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, strategies as st

import functrain as ft
from functrain.trainer.images import image_grid, loss_curve, write_png


def test_num_samples_must_be_a_perfect_square():
    with pytest.raises(ValueError, match=r"num_samples must be a perfect square.*got 10"):
        ft.TrainConfig(num_samples=10)
    assert ft.TrainConfig(num_samples=36).num_samples == 36


@pytest.mark.parametrize("field,value,match", [
    ("train_batch_size", 0, "train_batch_size must be a positive int; got 0"),
    ("gradient_accumulate_every", -2, "gradient_accumulate_every"),
    ("train_num_steps", 1.5, "train_num_steps"),
    ("train_lr", 0.0, "train_lr must be a positive number"),
    ("ema_decay", 1.0, r"ema_decay must be in \(0, 1\); got 1.0"),
    ("ema_decay", 0, "ema_decay"),
    ("adam_betas", (0.9,), "adam_betas"),
    ("adam_betas", (0.9, 1.2), "adam_betas"),
    ("mixed_precision", "fp8", "mixed_precision must be one of.*'fp8'"),
    ("max_grad_norm", -1.0, "max_grad_norm"),
    ("save_and_sample_every", 0, "save_and_sample_every"),
    ("trackers", ("jsonl", "comet"), "unknown.*comet"),
    ("ema_update_after_step", -1, r"ema_update_after_step must be an int >= 0 \(updates that copy"),
    ("ema_power", 0.0, r"ema_power must be a number > 0 \(finite\), or None: no warm-up; got 0.0"),
    ("ema_inv_gamma", float("inf"), "ema_inv_gamma must be a positive number"),
    ("split_batches", "yes", r"split_batches must be one of \(True, False\); got 'yes'"),
])
def test_bad_values_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        ft.TrainConfig(**{field: value})


@given(st.integers(1, 512), st.integers(1, 8), st.floats(1e-6, 1.0), st.integers(1, 100) .map(lambda r: r * r),
       st.sampled_from(["no", "bf16", "fp16"]), st.sampled_from(["json", "yaml"]))
def test_save_load_roundtrip(tmp_path_factory, batch, accum, lr, samples, precision, fmt):
    cfg = ft.TrainConfig(train_batch_size=batch, gradient_accumulate_every=accum, train_lr=lr,
                         num_samples=samples, mixed_precision=precision, adam_betas=(0.8, 0.95))
    path = tmp_path_factory.mktemp("cfg") / f"config.{fmt}"
    cfg.save(path)
    back = ft.TrainConfig.load(path)
    assert back == cfg and back.diff(cfg) == {}


@pytest.mark.parametrize("name,match", [
    ("amp", r"TrainConfig has no field 'amp': use mixed_precision='bf16' or 'fp16'"),
    ("mixed_precision_type", r"has no field 'mixed_precision_type': use mixed_precision"),
    ("calculate_fid", r"has no field 'calculate_fid': not provided: ft.Trainer computes no FID \(Trainer\(eval_dataset"),
    ("num_fid_samples", "not provided: ft.Trainer computes no FID"),
    ("save_best_and_latest_only", r"use keep_best='eval_loss_ema' and keep_checkpoints=1 \(the checkpoint with the "
                                  r"best held-out loss beside the newest; needs Trainer\(eval_dataset=...\)\)"),
    ("augment_horizontal_flip", r"an argument of the dataset, ft.data.ImageFolder\(folder, image_size, augment_"),
    ("convert_image_to", r"ft.data.ImageFolder\(folder, image_size, convert_image_to='RGB'\)"),
    ("lr", "has no field 'lr': use train_lr$"),
    ("update_after_step", "use ema_update_after_step$"),
    ("train_batchsize", "has no field 'train_batchsize': did you mean train_batch_size"),  # difflib
    ("ema_decy", "did you mean ema_decay"),
    ("qqq", "has no field 'qqq': no such field$"),
])
def test_names_users_bring_get_the_functrain_name(name, match):
    """denoising-diffusion-pytorch's (and accelerate's, ema-pytorch's) names are answered with the field that does
    their job, or with 'not provided'; anything else with difflib's closest fields. A TypeError as before (and a
    ValueError), raised before the dataclass sees the name."""
    with pytest.raises(TypeError, match=match):
        ft.TrainConfig(**{name: True})
    with pytest.raises(ValueError, match=match):
        ft.TrainConfig(train_batch_size=8, **{name: True})
    with pytest.raises(ValueError, match=rf"unknown fields \['{name}'\].*'{name}': "):
        ft.TrainConfig.from_dict({name: True})


def test_several_unknown_names_are_all_answered():
    with pytest.raises(ValueError, match=r"TrainConfig: unknown fields \['amp', 'calculate_fid'\] \('amp': use "
                                         r"mixed_precision.*'calculate_fid': not provided.*the fields are \["):
        ft.TrainConfig(amp=True, calculate_fid=False)
    assert ft.TrainConfig(train_lr=1e-3).replace(seed=2).seed == 2  # replace() goes through the same check
    with pytest.raises(ValueError, match="has no field 'lr': use train_lr"):
        ft.TrainConfig().replace(lr=1.0)


def test_ema_inv_gamma_without_the_warm_up_is_refused():
    with pytest.raises(ValueError, match=r"ema_inv_gamma shapes the EMA warm-up.*ema_power=None it would be unused"):
        ft.TrainConfig(ema_power=None, ema_inv_gamma=2.0)
    assert ft.TrainConfig(ema_power=None).ema_power is None


def test_diff_and_unknown_keys(tmp_path):
    a = ft.TrainConfig()
    b = a.replace(train_lr=3e-4, seed=1)
    assert a.diff(b) == {"train_lr": (a.train_lr, 3e-4), "seed": (0, 1)}
    (tmp_path / "c.json").write_text(json.dumps({"train_lr": 1e-3, "learning_rate": 2}))
    with pytest.raises(ValueError, match="unknown fields.*learning_rate"):
        ft.TrainConfig.load(tmp_path / "c.json")


def _read_png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks.setdefault(kind, b"")
        chunks[kind] += body
        pos += 12 + n
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    channels = 3 if color == 2 else 1
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[i * (w * channels + 1) + 1:(i + 1) * (w * channels + 1)] for i in range(h)]
    img = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(h, w, channels)
    return img[..., 0] if channels == 1 else img


@given(st.integers(1, 5), st.integers(2, 9), st.integers(2, 9), st.integers(1, 4), st.integers(0, 2))
def test_sample_grid_pixel_size(tmp_path_factory, side, h, w, scale, pad):
    images = np.random.default_rng(0).random((side * side, 1, h, w))
    grid = image_grid(images, pad=pad, scale=scale)
    assert grid.shape == (side * (h * scale + pad) + pad, side * (w * scale + pad) + pad)
    path = tmp_path_factory.mktemp("png") / "g.png"
    write_png(path, grid)
    back = _read_png(path)
    assert np.array_equal(back, grid)
    # the first image sits at (pad, pad), enlarged `scale` times
    expected = (np.clip(images[0, 0], 0, 1) * 255 + 0.5).astype(np.uint8).repeat(scale, 0).repeat(scale, 1)
    assert np.array_equal(back[pad:pad + h * scale, pad:pad + w * scale], expected)


def test_grid_rejects_non_square_and_curve_draws(tmp_path):
    with pytest.raises(ValueError, match="perfect square"):
        image_grid(np.zeros((10, 8, 8)))
    img = loss_curve([1.0, 0.5, 0.25, 0.2], width=100, height=60)
    assert img.shape == (60, 100, 3) and (img != 255).any()
    write_png(tmp_path / "c.png", img)
    assert np.array_equal(_read_png(tmp_path / "c.png"), img)


# Every field is checked when the config is built, with the field, what is allowed and the value named.
@pytest.mark.parametrize("field,value,match", [
    ("seed", -1, r"TrainConfig.seed must be an int in \[0, 2\*\*63\); got -1"),
    ("seed", 2**64, r"seed must be an int in \[0, 2\*\*63\)"),
    ("seed", 1.0, "seed"),
    ("seed", True, "seed"),
    ("weight_decay", float("nan"), r"weight_decay must be a finite number >= 0; got nan"),
    ("weight_decay", -0.1, "weight_decay"),
    ("weight_decay", float("inf"), "weight_decay"),
    ("results_folder", "", "results_folder must be a non-empty path"),
    ("results_folder", "  ", "results_folder"),
    ("results_folder", 3, "results_folder"),
    ("results_folder", b"runs", "results_folder"),
    ("compile", "no", r"compile must be one of \(True, False\); got 'no'"),
    ("compile", 1, "compile"),
    ("skip_nonfinite", "yes", "skip_nonfinite"),
    ("max_consecutive_nonfinite", 0, "max_consecutive_nonfinite must be a positive int"),
    ("save_timeout", 0, "save_timeout must be a positive"),
    ("save_timeout", float("nan"), "save_timeout"),
    ("train_lr", float("nan"), "train_lr"),
    ("train_lr", True, "train_lr"),
    ("max_grad_norm", float("inf"), "max_grad_norm"),
    ("ema_decay", float("nan"), "ema_decay"),
    ("adam_betas", (0.9, float("nan")), "adam_betas"),
    ("adam_betas", (True, 0.9), "adam_betas"),
    ("adam_betas", "0.9,0.99", "adam_betas"),
    ("log_every", 0, "log_every"),
    ("keep_checkpoints", 0, "keep_checkpoints"),
    ("ema_update_every", True, "ema_update_every"),
    ("num_samples", 4.0, "num_samples"),
    ("mixed_precision", None, "mixed_precision"),
    ("trackers", ("jsonl", "jsonl"), "each tracker once"),
    ("trackers", 5, "trackers"),
])
def test_every_field_is_checked_at_construction(field, value, match):
    with pytest.raises(ValueError, match=match) as e:
        ft.TrainConfig(**{field: value})
    assert isinstance(e.value, TypeError)  # BadValue: catchable as either


def test_valid_edge_values_are_kept():
    cfg = ft.TrainConfig(seed=2**63 - 1, weight_decay=0, results_folder=__import__("pathlib").Path("r"),
                         compile=False, skip_nonfinite=False, max_consecutive_nonfinite=1, save_timeout=0.5,
                         trackers="jsonl", adam_betas=[0.0, 0.5])
    assert (cfg.seed, cfg.weight_decay, cfg.results_folder, cfg.trackers, cfg.adam_betas) == \
        (2**63 - 1, 0.0, "r", ("jsonl",), (0.0, 0.5))
    assert ft.TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_background_compile_fields():
    assert ft.TrainConfig().compile_background is True and ft.TrainConfig().compile_switch_at is None
    cfg = ft.TrainConfig(compile_switch_at=0)
    assert ft.TrainConfig.from_dict(cfg.to_dict()) == cfg  # saved beside checkpoints: a resume replays it
    with pytest.raises(ValueError, match=r"compile_background must be one of \(True, False\); got 'no'"):
        ft.TrainConfig(compile_background="no")
    with pytest.raises(ValueError, match=r"compile_switch_at must be an int >= 0 .*; got -1"):
        ft.TrainConfig(compile_switch_at=-1)
    for off in ({"compile": False}, {"compile_background": False}):
        with pytest.raises(ValueError, match=r"compile_switch_at=5 is when a background compile takes over"):
            ft.TrainConfig(compile_switch_at=5, **off)


# -- hostile or mistaken config files -------------------------------------------------------------
# nested aliases: 339 bytes whose value, walked as a tree, has 9**9 leaves (a 254 MB error message before)
_BOMB = 'train_batch_size:\n- &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f'- &{n} [{",".join(["*" + p] * 9)}]\n' for p, n in zip("abcdefgh", "bcdefghi"))


def test_a_yaml_of_nested_aliases_is_refused_quickly_with_a_short_message(tmp_path):
    import resource
    import subprocess
    import sys

    path = tmp_path / "bomb.yaml"
    path.write_text(_BOMB)
    assert len(_BOMB.encode()) < 400
    script = ("import resource, sys, time, functrain as ft\n"
              "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
              "t = time.perf_counter()\n"
              "try:\n    ft.TrainConfig.load(sys.argv[1])\nexcept ValueError as e:\n    msg = str(e)\n"
              "print(len(msg), time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n"
              "print(msg)\n")
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    first, message = out.stdout.split("\n", 1)
    length, seconds, grown_kib = first.split()
    assert int(length) < 1000 and float(seconds) < 2.0 and int(grown_kib) < 64 * 1024, first
    assert "expands to more than" in message and "bomb.yaml" in message, message


def test_yaml_python_tags_are_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "evil.yaml"
    marker = tmp_path / "ran"
    path.write_text(f"train_lr: 0.001\nseed: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ValueError, match=r"evil.yaml: line 2: the tag '!!python/object/apply:os.system' is not "
                                         r"allowed: a config holds plain data only"):
        ft.TrainConfig.load(path)
    assert not marker.exists()
    recursive = tmp_path / "loop.yaml"
    recursive.write_text("trackers: &t [*t]\n")
    with pytest.raises(ValueError, match="recursive alias"):
        ft.TrainConfig.load(recursive)
    big = tmp_path / "big.json"
    big.write_text('{"seed": 1, "pad": "' + "x" * (2 << 20) + '"}')
    with pytest.raises(ValueError, match="more than 1048576 bytes"):
        ft.TrainConfig.load(big)


def test_save_timeout_is_bounded_at_construction():
    """1e300 s used to pass here and fail later, at train() on several processes (OverflowError)."""
    with pytest.raises(ValueError, match=r"save_timeout must be a positive number of seconds, at most 604800 "
                                         r"\(a week.*got 1e\+300"):
        ft.TrainConfig(save_timeout=1e300)
    with pytest.raises(ValueError, match="at most 604800"):
        ft.TrainConfig(save_timeout=604800.5)
    assert ft.TrainConfig(save_timeout=604800).save_timeout == 604800.0
    import datetime

    datetime.timedelta(seconds=ft.TrainConfig(save_timeout=604800).save_timeout)  # what train() builds
