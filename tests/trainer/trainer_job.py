"""A small ft.Trainer job for the trainer tests: dropout, shuffling, accumulation, fp16, EMA.

    python tests/trainer_job.py RESULTS [--steps N] [--save-every K] [--precision fp16] [--no-compile]
                                        [--log-every L] [--step-sleep S] [--slow S] [--shard MODE]
                                        [--switch-at N] [--no-background] [--slow-after N] [--hold FILE]
"""
import argparse
import os
import sys
import time

import torch

import functrain as ft


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 6))

    step_sleep = 0.0  # seconds each step sleeps (eager only): a slow step, for the SIGTERM tests
    slow_after = 0  # ... from this step on (steps before it are fast)
    calls = 0
    hold = None  # a file: steps after the second wait for it (eager only), so a test acts while this run is alive

    def forward(self, x, y):
        self.calls += 1  # (once per micro-batch: 2 per step)
        if self.hold and self.calls > 4:
            deadline = time.monotonic() + 120
            while not os.path.exists(self.hold):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"trainer_job: {self.hold} did not appear within 120 s")
                time.sleep(0.02)
        if self.step_sleep and self.calls > 2 * self.slow_after:
            time.sleep(self.step_sleep / 2)
        noise = 0.01 * torch.randn_like(x)  # randomness in the loss too, drawn from the state's generator
        return torch.nn.functional.mse_loss(self.net(x + noise), y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--precision", default="fp16")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--trackers", default="jsonl")
    p.add_argument("--slow", type=float, default=0.0, help="seconds to sleep per sample fn (to be killed)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--shard", default="none", help="TrainConfig.shard: none, optimizer or params")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps (needs --no-compile)")
    p.add_argument("--switch-at", type=int, default=None,
                   help="TrainConfig.compile_switch_at: the compiled step takes over after this many (eager) steps")
    p.add_argument("--no-background", action="store_true", help="TrainConfig.compile_background=False")
    p.add_argument("--slow-after", type=int, default=0, help="--step-sleep only after this many fast steps")
    p.add_argument("--hold", default=None, help="steps after the second wait until this file exists (--no-compile)")
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(72, 6, generator=g)
    data = torch.utils.data.TensorDataset(x, x.flip(1) * 0.5)  # 72 samples: 4.5 updates of 16 per epoch
    torch.manual_seed(0)
    config = ft.TrainConfig(train_batch_size=4, gradient_accumulate_every=2, train_lr=3e-3, train_num_steps=a.steps,
                            ema_update_every=2, ema_decay=0.9, ema_update_after_step=0,  # (the warm-up ramp, no copies)
                            save_and_sample_every=a.save_every, num_samples=4,
                            mixed_precision=a.precision, results_folder=a.results, seed=3, log_every=a.log_every,
                            keep_checkpoints=100, compile=not a.no_compile, trackers=tuple(a.trackers.split(",")),
                            shard=a.shard, compile_background=not a.no_background, compile_switch_at=a.switch_at)

    def sample_fn(ema_params, n):
        if a.slow:
            time.sleep(a.slow)
        w = ema_params["net.0.weight"]
        return torch.sigmoid(w[: n * 4].reshape(n, 1, 4, 6))

    model = Model()
    model.step_sleep, model.slow_after, model.hold = a.step_sleep, a.slow_after, a.hold
    state = ft.Trainer(model, data, config, sample_fn=sample_fn).train()
    sys.stdout.write(f"DONE step={int(state.step)} rank={ft.distributed.rank()}\n")


if __name__ == "__main__":
    main()
