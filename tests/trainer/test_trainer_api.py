"""ft.Trainer as a general trainer on ft.run: optimizer=, lr schedules, transforms=, step=, model outputs
(dict, ModelOutput, a real transformers GPT-2), evaluation (1 and 2 processes, each sample once), hooks,
throughput after the compile, and no host sync per step.

In-process runs are eager (compile=False) unless the test is about compiling; the 2-process run uses
ft.launch with a timeout.
"""
import json
import math
import os
import warnings

import pytest
import torch
from conftest import CountHostPulls

import functrain as ft
from functrain import tree as T

pytest.importorskip("safetensors")


class Linear(torch.nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.fc = torch.nn.Linear(d, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc(x), y)


def _data(n=64, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :1] * 0.7 - 0.2 + 0.1 * torch.randn(n, 1, generator=g))


def _config(folder, **kw):
    base = dict(train_batch_size=8, train_num_steps=12, save_and_sample_every=6, results_folder=str(folder),
                compile=False, log_every=1, ema_update_every=1, ema_decay=0.9, trackers=("jsonl",), train_lr=1e-2,
                ema_update_after_step=0, ema_power=None)  # the plain ft.ema(0.9, warmup=False) the hand-built steps use
    return ft.TrainConfig(**{**base, **kw})


def _log(folder):
    return [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]


def _train(make, data, config, **kw):
    """Train a model made by ``make()`` under seed 0 (a module is passed as is)."""
    torch.manual_seed(0)
    model = make if isinstance(make, torch.nn.Module) else make()
    return ft.Trainer(model, data, config, **kw).train()


def _reference(step, params, buffers, data, config):
    """The same training by hand: ft.run over ft.shard with the trainer's batch, seed and drop_last."""
    loader = ft.shard(data, batch_size=config.train_batch_size * config.gradient_accumulate_every, shuffle=True,
                      seed=config.seed, drop_last=True)
    state = step.init(params, buffers, seed=config.seed)
    return ft.run(step, state, loader, num_steps=config.train_num_steps, progress=False)


def _module_loss(model):
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        return apply_fn(params, buffers, *batch)

    return loss_fn, params, buffers


# ------------------------------------------------------------------------------------------ optimizers
def test_a_torch_optim_optimizer_is_translated(tmp_path):
    """Trainer(optimizer=torch.optim.AdamW(model.parameters())) trains as its functional port (ft.optim.from_torch)."""
    data = _data()
    torch.manual_seed(0)
    model = Linear()
    got = ft.Trainer(model, data, _config(tmp_path / "torch"),
                     optimizer=torch.optim.AdamW(model.parameters(), lr=0.01)).train()
    expected = _train(Linear, data, _config(tmp_path / "port"), optimizer=ft.optim.adamw(0.01))
    assert isinstance(got.opt_state, ft.optim.AdamState)
    assert T.tree_equal(got, expected), "the translated torch.optim.AdamW differs from ft.optim.adamw"


def test_optimizer_argument_is_the_optimizer_used(tmp_path):
    """A lion optimizer through the trainer equals ft.run of the hand-built step (clip, EMA, skip_nonfinite)."""
    data, config = _data(), _config(tmp_path)
    opt = ft.optim.lion(3e-3, weight_decay=0.1, weight_decay_mask=ft.optim.masks.no_decay_bias_and_norm)
    torch.manual_seed(0)
    model = Linear()
    loss_fn, params, buffers = _module_loss(model)
    params = T.tree_map(torch.clone, params)
    step = ft.skip_nonfinite()(ft.ema(0.9, every=1, warmup=False)(ft.clip(config.max_grad_norm)(ft.train_step(loss_fn, opt))))
    expected = _reference(step, params, buffers, data, config)
    got = _train(Linear, data, config, optimizer=opt)
    assert isinstance(got.opt_state, ft.optim.LionState)
    assert T.tree_equal(got, expected), "the trainer's run differs from ft.run of the same step"


def test_optimizer_fields_of_the_config_that_go_unused_are_named(tmp_path):
    with pytest.warns(UserWarning, match=r"train_lr.*not used: Trainer\(optimizer=...\) brings its own lr"):
        ft.Trainer(Linear(), _data(), _config(tmp_path, train_lr=5e-3), optimizer=ft.optim.sgd(0.1))


# ------------------------------------------------------------------------------------------ schedules
@pytest.mark.parametrize("kind", ["warmup_cosine", "warmup_linear", "constant"])
def test_the_schedules_lr_is_in_the_logs(tmp_path, kind):
    extra = {} if kind == "constant" else {"min_lr": 1e-3}
    config = _config(tmp_path, lr_schedule=kind, warmup_steps=3, **extra)
    _train(Linear, _data(), config)
    if kind == "warmup_cosine":
        s = ft.optim.schedules.warmup_cosine(1e-2, warmup_steps=3, total_steps=12, final=1e-3)
    elif kind == "warmup_linear":
        s = ft.optim.schedules.warmup_linear_decay(1e-2, warmup_steps=3, total_steps=12, final=1e-3)
    else:
        s = ft.optim.schedules.linear_warmup(1e-2, warmup_steps=3)
    log = [r for r in _log(tmp_path) if "lr" in r]
    assert [r["step"] for r in log] == list(range(1, 13))
    for r in log:  # update k (1-based) is taken with the schedule at count k - 1 (no update was skipped)
        assert r["lr"] == pytest.approx(float(s(r["step"] - 1)), rel=1e-12, abs=1e-15), r
    assert log[0]["lr"] == 0.0 and log[3]["lr"] == pytest.approx(1e-2)


@pytest.mark.parametrize("fields,match", [
    ({"lr_schedule": "cosine"}, r"lr_schedule must be one of \('constant', 'warmup_cosine', 'warmup_linear'\)"),
    ({"lr_schedule": "warmup_cosine", "warmup_steps": 12}, r"warmup_steps must be < train_num_steps=12"),
    ({"lr_schedule": "warmup_cosine", "min_lr": 0.5}, r"min_lr must be a number in \[0, train_lr=0.01\]"),
    ({"min_lr": 1e-3}, r"min_lr is the final lr of a decaying lr_schedule"),
    ({"warmup_steps": -1}, r"warmup_steps must be an int >= 0"),
    ({"eval_every": -1}, r"eval_every must be an int >= 0"),
    ({"eval_batch_size": 0}, r"eval_batch_size must be a positive int or None"),
])
def test_bad_schedule_and_eval_fields_are_named(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        _config(tmp_path, **fields)


def test_a_schedule_shorter_than_the_run_is_refused_before_training(tmp_path):
    short = ft.optim.adamw(ft.optim.schedules.warmup_cosine(1e-3, warmup_steps=2, total_steps=8))
    with pytest.raises(ValueError, match=r"built for 8 updates .* the run takes 12"):
        ft.Trainer(Linear(), _data(), _config(tmp_path), optimizer=short)


# ------------------------------------------------------------------------------------------ transforms=, step=
def test_transforms_are_added_to_the_composed_step(tmp_path):
    data, config = _data(), _config(tmp_path)
    torch.manual_seed(0)
    loss_fn, params, buffers = _module_loss(Linear())
    params = T.tree_map(torch.clone, params)
    step = ft.clip_value(1e-3)(ft.skip_nonfinite()(ft.ema(0.9, every=1, warmup=False)(ft.clip(1.0)(
        ft.train_step(loss_fn, ft.optim.adamw(1e-2, betas=(0.9, 0.99), weight_decay=0.0))))))
    expected = _reference(step, params, buffers, data, config)
    got = _train(Linear, data, config, transforms=[ft.clip_value(1e-3)])
    assert T.tree_equal(got, expected)
    plain = _train(Linear, data, config.replace(results_folder=str(tmp_path / "plain")))
    assert not T.tree_equal(got.params, plain.params)  # the transform changed the training
    with pytest.raises(ValueError, match=r"already has 'clip' from the config"):
        ft.Trainer(Linear(), data, config, transforms=[ft.clip(0.5)])
    with pytest.raises(TypeError, match=r"transforms=...\)\[0\] must be a functrain Transform"):
        ft.Trainer(Linear(), data, config, transforms=[lambda s: s])


def test_a_ready_step_is_used_as_is(tmp_path):
    data, config = _data(), _config(tmp_path, trackers=())
    torch.manual_seed(0)
    model = Linear()
    loss_fn, params, buffers = _module_loss(model)
    step = ft.clip(0.5)(ft.train_step(loss_fn, ft.optim.sgd(0.05, momentum=0.9)))
    expected = _reference(step, T.tree_map(torch.clone, params), buffers, data, config)
    got = ft.Trainer(model, data, config, step=step).train()
    assert T.tree_equal(got, expected)
    # nothing added on one process: no EMA, and the one clip slot is the step's own (its max_norm, since clip's
    # norm is data in the state), not the config's
    assert got.ema is None and list(got.slots) == ["clip"]
    assert float(ft.get_hyper(got)["clip"]["max_norm"]) == 0.5
    with pytest.raises(TypeError, match="uses the step as is"):
        ft.Trainer(model, data, config, step=step, optimizer=ft.optim.sgd(0.1))
    with pytest.raises(ValueError, match=r"accumulates 2 micro-batches but TrainConfig.gradient_accumulate_every=1"):
        ft.Trainer(model, data, config, step=ft.accumulate(2)(step))
    # a streaming accumulation takes one micro-batch per call (Transform.micro_batches): the trainer loads
    # train_batch_size rows per call for it, never gradient_accumulate_every times as many
    with pytest.raises(ValueError, match=r"accumulates 1 micro-batches but TrainConfig.gradient_accumulate_every=2"):
        ft.Trainer(model, data, config.replace(gradient_accumulate_every=2),
                   step=ft.accumulate(2, streaming=True)(step))
    ft.Trainer(model, data, config, step=ft.accumulate(2, streaming=True)(step))
    with pytest.raises(TypeError, match="takes a functrain Step"):
        ft.Trainer(model, data, config, step=lambda state, batch: (state, {}))


# ------------------------------------------------------------------------------------------ model outputs
class DictModel(Linear):
    def forward(self, x, y):
        pred = self.fc(x)
        return {"loss": torch.nn.functional.mse_loss(pred, y), "mae": (pred - y).abs().mean(), "pred": pred}


def test_a_dict_output_gives_the_loss_and_aux_metrics(tmp_path):
    _train(DictModel, _data(), _config(tmp_path))
    log = [r for r in _log(tmp_path) if "loss" in r]
    assert len(log) == 12 and all("mae" in r and "pred" not in r for r in log)
    assert all(math.isfinite(r["mae"]) and r["mae"] > 0 for r in log)


def test_a_model_output_object_with_loss(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dataclasses import dataclass

    @dataclass
    class Out(transformers.utils.ModelOutput):
        loss: torch.Tensor | None = None
        logits: torch.Tensor | None = None

    class M(Linear):
        def forward(self, x, y):
            pred = self.fc(x)
            return Out(loss=torch.nn.functional.mse_loss(pred, y), logits=pred)

    state = _train(M, _data(), _config(tmp_path))
    ref = _train(Linear, _data(), _config(tmp_path / "ref"))
    assert T.tree_equal(state, ref)  # the same loss, so the same training

    class NoLoss(Linear):
        def forward(self, x, y):
            return Out(logits=self.fc(x))

    with pytest.raises(TypeError, match=r"returned a Out with keys \['logits'\] and no 'loss'"):
        _train(NoLoss, _data(), _config(tmp_path / "noloss"))

    class Pred(Linear):
        def forward(self, x, y):
            return [self.fc(x)]

    with pytest.raises(TypeError, match=r"returned a list of 1 \(a tensor of shape \(8, 1\)\): the trainer needs"):
        _train(Pred, _data(), _config(tmp_path / "pred"))


def test_a_transformers_gpt2_trains(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(0)
    ids = (torch.arange(12)[None] + torch.randint(0, 32, (48, 1), generator=g)) % 32  # learnable: counting
    data = {"input_ids": ids, "labels": ids}
    config = _config(tmp_path, train_num_steps=20, train_lr=3e-3, save_and_sample_every=20, log_every=5)
    ft.Trainer(model, data, config).train()
    log = _log(tmp_path)
    assert [r["step"] for r in log] == [5, 10, 15, 20]
    assert log[-1]["loss"] < log[0]["loss"] < math.log(32) + 0.5, log
    with pytest.raises(TypeError, match=r"no 'loss'.*labels="):
        _train(model, {"input_ids": ids}, config.replace(results_folder=str(tmp_path / "nolabels")))


def test_a_run_that_raises_leaves_no_memory_line_thread_behind(tmp_path, monkeypatch):
    """The memory line is made on a thread of its own; a run whose first step raises waits for it (nothing of a run
    outlives it: a stray thread printing into the next test's captured output crashed a test worker). Its walk is
    made slow here (the thread's own work, 0.5 s), so a run that did not wait would return with it alive."""
    import threading
    import time

    from functrain.compiler import estimate

    finish = estimate.Prepared.finish

    def slow(self):
        time.sleep(0.5)
        return finish(self)
    monkeypatch.setattr(estimate.Prepared, "finish", slow)

    class Raises(Linear):
        def forward(self, x, y):
            raise ValueError("the model's own error")
    with pytest.raises(ValueError, match="the model's own error"):
        _train(Raises, _data(), _config(tmp_path))
    assert not [t for t in threading.enumerate() if t.name == "functrain-memory-line" and t.is_alive()]


# ------------------------------------------------------------------------------------------ evaluation
def _per_sample_mse(params, data):
    x, y = data.tensors
    pred = x @ params["fc.weight"].T + params["fc.bias"]
    return ((pred - y) ** 2).mean(1).double().mean().item()


def test_eval_loss_with_params_and_ema_each_sample_once(tmp_path):
    data, held_out = _data(), _data(13, seed=1)
    config = _config(tmp_path, eval_every=4, eval_batch_size=4)
    seen = []
    state = _train(Linear, data, config, eval_dataset=held_out, on_eval=lambda step, m: seen.append((step, m)))
    evals = [r for r in _log(tmp_path) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8, 12] == [s for s, _ in seen]
    last = evals[-1]
    assert last["eval_samples"] == 13
    assert last["eval_loss"] == pytest.approx(_per_sample_mse(state.params, held_out), rel=1e-6)
    assert last["eval_loss_ema"] == pytest.approx(_per_sample_mse(state.ema, held_out), rel=1e-6)
    assert last["eval_loss"] != last["eval_loss_ema"]
    # the history of evaluations is kept in the checkpoint (and plotted)
    from functrain.trainer.plots import MetricHistory  # (the checkpoint holds the history packed)

    history = MetricHistory.from_json(ft.load_extra(ft.CheckpointManager(tmp_path / "checkpoints").path(12))[
        "history"]).as_dict()
    assert [s for s, _ in history["eval_loss"]] == [4, 8, 12] == [s for s, _ in history["eval_loss_ema"]]
    assert [v for _, v in history["eval_loss"]] == [r["eval_loss"] for r in evals]


def test_eval_mistakes_are_errors_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"eval dataset has 3 samples, fewer than one batch of 4 on each of 1 "
                                         r"process\(es\).*eval_batch_size \(now 4\)"):
        ft.Trainer(Linear(), _data(), _config(tmp_path, eval_batch_size=4), eval_dataset=_data(3))
    with pytest.raises(ValueError, match=r"eval_every=5 but the Trainer has no eval_dataset"):
        ft.Trainer(Linear(), _data(), _config(tmp_path, eval_every=5))
    assert not os.path.exists(tmp_path / "checkpoints")


def _eval_worker(folder):
    import torch.distributed as dist

    data, held_out = _data(), _data(13, seed=1)
    torch.manual_seed(0)
    config = _config(folder, eval_every=6, eval_batch_size=4, train_batch_size=4)
    ft.Trainer(Linear(), data, config, eval_dataset=held_out).train()
    return dist.get_rank()


def test_eval_on_two_processes_equals_one_process(tmp_path):
    """13 samples in batches of 4 on 2 ranks: 3 padding rows; each sample still counts once."""
    assert ft.launch(_eval_worker, nprocs=2, args=(str(tmp_path),), timeout=300) == [0, 1]
    evals = [r for r in _log(tmp_path) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [6, 12] and all(r["eval_samples"] == 13 for r in evals)
    state = ft.load(ft.CheckpointManager(tmp_path / "checkpoints").path(12))
    held_out = _data(13, seed=1)
    assert evals[-1]["eval_loss"] == pytest.approx(_per_sample_mse(state.params, held_out), rel=1e-6)
    assert evals[-1]["eval_loss_ema"] == pytest.approx(_per_sample_mse(state.ema, held_out), rel=1e-6)
    # the one-process evaluation of the same params (what the trainer's Evaluator computes alone)
    from functrain.trainer.evaluator import Evaluator
    from functrain.trainer.build import model_loss

    apply_fn, _, _ = ft.functionalize(Linear())
    one = Evaluator(model_loss(apply_fn), held_out, 4)(state)
    assert one["eval_samples"] == 13
    assert one["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6)
    assert one["eval_loss_ema"] == pytest.approx(evals[-1]["eval_loss_ema"], rel=1e-6)


# ------------------------------------------------------------------------------------------ hooks
class Recorder(ft.trainer.Callback):
    def __init__(self, stop_at=None):
        self.logs, self.saves, self.stop_at = [], [], stop_at

    def on_log(self, step, metrics):
        self.logs.append((step, metrics["loss"]))

    def on_save(self, step, path):
        self.saves.append((step, os.path.exists(os.path.join(path, "COMPLETE.json"))))

    def should_stop(self, step, metrics):
        return self.stop_at is not None and step >= self.stop_at


def test_hooks_see_logs_saves_and_can_stop(tmp_path):
    rec = Recorder(stop_at=5)
    logged = []
    state = _train(Linear, _data(), _config(tmp_path, log_every=2, save_and_sample_every=4), callbacks=[rec],
                   on_log=lambda step, m: logged.append(step))
    assert int(state.step) == 6  # asked at the log step 6 (the first >= 5): stops there, saving first
    assert logged == [2, 4, 6] and [s for s, _ in rec.logs] == [2, 4, 6]
    assert rec.saves == [(4, True), (6, True)]
    assert ft.CheckpointManager(tmp_path / "checkpoints").steps() == [4, 6]
    with pytest.raises(TypeError, match=r"on_log=...\) must be callable"):
        ft.Trainer(Linear(), _data(), _config(tmp_path), on_log=3)
    with pytest.raises(TypeError, match=r"callbacks=...\)\[0\] has none of the hook methods"):
        ft.Trainer(Linear(), _data(), _config(tmp_path), callbacks=[object()])


# ------------------------------------------------------------------------------------------ the loop's cost
def test_no_host_sync_per_step(tmp_path):
    """30 steps cost the host reads of 10 steps: the same log, save and final reads, none per step."""
    pulls = []
    for steps in (10, 30):
        config = _config(tmp_path / str(steps), train_num_steps=steps, log_every=1000, save_and_sample_every=1000,
                         max_consecutive_nonfinite=1000, trackers=())
        torch.manual_seed(0)
        trainer = ft.Trainer(Linear(), _data(), config)
        with CountHostPulls() as mode:
            trainer.train()
        pulls.append(mode.pulls)
    assert pulls[0] == pulls[1], pulls


class SlowToCompile(Linear):
    """A model whose capture takes at least a second (it sleeps while being traced), whatever the compile caches
    hold: the test must not depend on how long inductor takes on this machine."""

    def forward(self, x, y):
        if torch.compiler.is_compiling():
            import time

            time.sleep(1.0)
        return super().forward(x, y)


def test_throughput_excludes_the_compile(tmp_path):
    # a blocking compile (compile_background=False): the first step is the compile
    config = _config(tmp_path, compile=True, compile_background=False, train_num_steps=6, save_and_sample_every=6,
                     log_every=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _train(SlowToCompile, _data(), config)
    log = _log(tmp_path)
    assert [r["step"] for r in log] == list(range(1, 7))
    assert "compile_s" in log[0] and sum("compile_s" in r for r in log) == 1  # logged once, as such
    assert "steps_per_s" not in log[0]  # the first step is the compile: no throughput from it
    rates = [r["steps_per_s"] for r in log[1:]]
    # the compile takes seconds; the steps after it take milliseconds: a rate that included it would be < 1/s
    assert log[0]["compile_s"] >= 1.0 and min(rates) > 5 * (1 / log[0]["compile_s"]), (log[0], rates)


# ------------------------------------------------------------------------------------------ outputs
class Normed(torch.nn.Module):
    """Params, a persistent buffer set (BatchNorm: running stats and an int counter) and a tied weight."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 4, bias=False)
        self.head.weight = self.fc.weight  # tied

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.head(self.norm(self.fc(x)))[:, :1], y)


def test_final_weights_load_strictly_and_equal_params_and_ema(tmp_path, capsys):
    safetensors = pytest.importorskip("safetensors.torch")
    state = _train(Normed, _data(), _config(tmp_path))
    for name, tree in (("model", state.params), ("ema", state.ema)):
        fresh = Normed()
        fresh.load_state_dict(safetensors.load_file(str(tmp_path / f"{name}.safetensors")), strict=True)
        for key, value in tree.items():
            assert torch.equal(dict(fresh.named_parameters())[key], value), (name, key)
        for key, value in state.buffers.items():
            assert torch.equal(dict(fresh.named_buffers())[key], value), (name, key)
    assert int(state.buffers["norm.num_batches_tracked"]) == 12  # the buffers trained too
    assert not T.tree_equal(state.params, state.ema)
    out = capsys.readouterr().out
    assert "finished step 12/12: loss" in out and str(tmp_path / "model.safetensors") in out, out[-2000:]
    assert str(tmp_path / "metrics.png") in out


def test_metrics_plot_is_written_at_every_save_with_labelled_step_axes(tmp_path):
    pytest.importorskip("matplotlib")
    from functrain.trainer.plots import MetricHistory, metrics_figure

    seen = {}

    def on_save(step, path):
        plot = tmp_path / "metrics.png"
        seen[step] = plot.read_bytes() if plot.exists() else None

    _train(Linear, _data(), _config(tmp_path, eval_every=6), eval_dataset=_data(16, seed=1), on_save=on_save)
    assert seen[6] is not None and seen[6][:8] == b"\x89PNG\r\n\x1a\n"  # written at the first save already
    assert seen[12] is not None and seen[12] != seen[6]  # and redrawn at the last
    history = ft.load_extra(ft.CheckpointManager(tmp_path / "checkpoints").path(12))["history"]
    assert [s for s, _ in MetricHistory.from_json(history).as_dict()["loss"]] == list(range(1, 13))
    fig = metrics_figure(MetricHistory.from_json(history),
                         metrics=["loss", "eval_loss", "eval_loss_ema", "grad_norm", "lr"])
    for ax, name in zip(fig.axes, ["loss", "eval_loss", "eval_loss_ema", "grad_norm", "lr"]):
        assert ax.get_xlabel() == "step" and ax.get_ylabel().startswith(name)
        assert ax.get_xlim()[1] >= 12 - 1e-9  # the x axis is the step, not the index of the log


def test_trackers_user_object_and_mlflow_resume_continue_one_run(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(var, raising=False)

    class Mine:
        def __init__(self):
            self.steps = []

        def log(self, step, metrics):
            self.steps.append((step, "eval_loss" in metrics))

    mine = Mine()
    config = _config(tmp_path, train_num_steps=6, trackers=("jsonl", "mlflow"), save_and_sample_every=3)
    _train(Linear, _data(), config, trackers=[mine], eval_dataset=_data(16, seed=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the config change (train_num_steps) is reported; not the point here
        _train(Linear, _data(), config.replace(train_num_steps=12), trackers=[mine], eval_dataset=_data(16, seed=1))
    assert [s for s, _ in mine.steps] == list(range(1, 13))  # one record per step: the evaluation in its step's
    assert [s for s, e in mine.steps if e] == [3, 6, 9, 12]
    client = MlflowClient("sqlite:///" + str(tmp_path / "mlflow.db"))
    runs = client.search_runs([client.get_experiment_by_name("functrain").experiment_id])
    assert len(runs) == 1  # the resumed session continued the same MLflow run
    losses = sorted(client.get_metric_history(runs[0].info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in losses] == list(range(1, 13))
    jsonl = [r["loss"] for r in _log(tmp_path) if "loss" in r]
    assert [m.value for m in losses] == pytest.approx(jsonl, rel=1e-6)
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "eval_loss")] == [3, 6, 9, 12]
    assert mlflow.get_tracking_uri() != "sqlite:///" + str(tmp_path / "mlflow.db")  # global state untouched


def test_bad_trackers_are_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"TrainConfig.trackers: unknown tracker 'comet'; the known trackers"):
        _config(tmp_path, trackers=("jsonl", "comet"))
    with pytest.raises(TypeError, match=r"holds tracker names only.*Trainer\(trackers=\[...\]\)"):
        _config(tmp_path, trackers=(object(),))
    with pytest.raises(TypeError, match=r"a tracker must be one of .* or an object with log"):
        ft.Trainer(Linear(), _data(), _config(tmp_path), trackers=[object()])


def test_a_run_after_a_precompile_reports_itself_compiled(tmp_path, capsys):
    """A precompile, then train() in the same process: no step runs eagerly (the module's Python forward is never
    called). The run said "every step ran eagerly", logged no switched_at or compile_s, and its
    steps_per_s_compiled counted the precompile's time (the runner's meter starts when the Trainer is made). Now:
    switched_at is its first step, compile_s what that step spent getting the code, the summary says it ran compiled
    from step 1, and the compiled rate counts only the run's own steps."""
    data, config = _data(), _config(tmp_path, train_num_steps=12, log_every=1, trackers=("jsonl",))
    torch.manual_seed(0)
    model = Linear()
    loss_fn, params, buffers = _module_loss(model)
    step = ft.train_step(loss_fn, ft.optim.sgd(0.05))
    cstep = ft.compile(step, backend="aot_eager")
    expected = _reference(step, T.tree_map(torch.clone, params), buffers, data, config)
    trainer = ft.Trainer(model, data, config, step=cstep)
    trainer.precompile()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    got = trainer.train()
    assert calls == []  # every step ran the compiled code
    assert T.tree_allclose(got, expected, rtol=1e-5, atol=1e-6)
    log = _log(tmp_path)
    assert [r["step"] for r in log if "switched_at" in r] == [1] and log[0]["switched_at"] == 1
    assert [r["step"] for r in log if "compile_s" in r] == [1] and 0 <= log[0]["compile_s"] < 60
    assert not any("steps_per_s_eager" in r for r in log)
    # this run's compiled steps over their own time: at least the run's overall rate (the precompile left out)
    last = log[-1]
    assert last["steps_per_s_compiled"] >= 0.99 * last["steps_per_s"], last
    out = capsys.readouterr().out
    assert "every step ran eagerly" not in out, out
    assert ("compiled from step 1, no step ran eagerly: its code was compiled before this train() call, in this "
            "process (precompile, or an earlier train())") in out, out


def test_a_background_compile_is_logged_once_with_each_paths_throughput(tmp_path, capsys):
    """metrics.jsonl says when the compiled step took over (switched_at), how long the compile took (compile_s,
    once) and the steps per second on each path; the summary says it too."""
    data, config = _data(), _config(tmp_path, train_num_steps=12, log_every=1, trackers=("jsonl",))
    torch.manual_seed(0)
    model = Linear()
    loss_fn, params, buffers = _module_loss(model)
    step = ft.train_step(loss_fn, ft.optim.sgd(0.05))
    cstep = ft.compile(step, backend="aot_eager", switch_at=5)  # compiled on the training thread: quick
    expected = _reference(step, T.tree_map(torch.clone, params), buffers, data, config)
    got = ft.Trainer(model, data, config, step=cstep).train()
    assert T.tree_allclose(got, expected, rtol=1e-5, atol=1e-6)
    log = _log(tmp_path)
    assert [r["step"] for r in log] == list(range(1, 13))
    assert [r["step"] for r in log if "switched_at" in r] == [6] and log[5]["switched_at"] == 6
    assert sum("compile_s" in r for r in log) == 1 and [r for r in log if "compile_s" in r][0]["step"] >= 6
    assert "steps_per_s_eager" in log[4] and "steps_per_s_compiled" not in log[4]  # eager up to step 5
    assert "steps_per_s_compiled" in log[-1] and log[-1]["steps_per_s_compiled"] > 0
    out = capsys.readouterr().out
    assert "compiled in the background in " in out and "the compiled step took over at step 6" in out, out


def test_a_longer_resume_says_what_the_lr_schedule_does_and_the_summary_paths_are_absolute(tmp_path, capsys,
                                                                                              monkeypatch):
    """A finished 8-step warm-up + cosine job run again for 20 steps: the lr went from min_lr back up near its peak
    without a word. The resume line now says so with both numbers (the lr the run then logs at the next step is
    the new schedule's); a Trainer with an optimizer of its own (the config's lr unused) gets no such words. The
    summary's paths were relative where the folder's line was absolute: all are absolute now."""
    from functrain.trainer.build import config_lr

    monkeypatch.chdir(tmp_path)
    kw = dict(lr_schedule="warmup_cosine", warmup_steps=2, min_lr=1e-3, train_lr=1e-2, save_and_sample_every=4)
    short = _config("run", train_num_steps=8, **kw)
    ft.Trainer(Linear(), _data(), short).train()
    out = capsys.readouterr().out
    assert "results in " + str(tmp_path / "run") in out
    paths = [ln.split(": ", 1)[1] for ln in out.splitlines() if ln.startswith("  ") and ": " in ln]
    assert paths and all(os.path.isabs(p) for p in paths), out

    longer = _config("run", train_num_steps=20, **kw)
    ft.Trainer(Linear(), _data(), longer).train()
    out = capsys.readouterr().out
    before, after = float(config_lr(short)(8)), float(config_lr(longer)(8))
    assert after > 5 * before  # (the cosine over 20 steps is near its peak at step 8)
    line = next(ln for ln in out.splitlines() if ln.startswith("resuming with a changed config"))
    assert line.endswith(f"; lr schedule: warmup_cosine over train_num_steps 20 (was 8): the next update's lr is "
                         f"{after:.3g} (the old schedule's: {before:.3g}), decaying to min_lr 0.001 at step 20 (the "
                         f"schedule is a function of the step and the run's length: a longer run does not go on from "
                         f"the end of the shorter one's)"), line
    logged = {r["step"]: r["lr"] for r in _log(tmp_path / "run")}
    assert logged[9] == pytest.approx(after, rel=1e-5)  # what the line announced: step 9's update

    own = tmp_path / "own"
    with pytest.warns(UserWarning, match="are not used"):  # (the config's schedule: the optimizer brings its own)
        ft.Trainer(Linear(), _data(), _config(str(own), train_num_steps=8, **kw), optimizer=ft.optim.sgd(0.05)).train()
        capsys.readouterr()
        ft.Trainer(Linear(), _data(), _config(str(own), train_num_steps=20, **kw),
                   optimizer=ft.optim.sgd(0.05)).train()
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("resuming with a changed"))
    assert "lr schedule" not in line, line
