"""``cstep.progress`` reports the runner that trained the step last: ``ft.run``'s (issue 37: it stayed at the step's
own runner, ``phase='eager', eager_calls=0``, while ft.run trained the step compiled), then the plain calls'."""
import torch

import functrain as ft
from functrain.compiler import capture


def test_cstep_progress_is_the_runner_that_trained_the_step():
    capture.preload()  # the compiler imported first: the first call traces (aot_eager: compiled at once)
    capture.wait_for_imports()
    step = ft.train_step(lambda p, b, x: ((p["w"] * x).sum(-1) - 1).pow(2).mean(), ft.optim.sgd(0.1))
    cstep = ft.compile(step, backend="aot_eager", policy="always")
    state = step.init({"w": torch.zeros(4)})
    assert cstep.progress.phase == "eager" and cstep.progress.eager_calls == 0  # nothing called yet: its own
    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    seen = []
    runner = cstep.runner(donate=True, background=True)  # what ft.run makes, read back through the step
    ft.run(runner, ft.tree.tree_map(torch.clone, state), batches, num_steps=8, progress=False,
           on_step=lambda i, s, m: seen.append((runner.progress.phase, runner.progress.eager_calls)) and False)
    p = cstep.progress
    assert p is runner.progress, (p, runner.progress)
    assert p.phase == "compiled" and p.eager_calls >= 1 and runner.rates.calls["compiled"] >= 1, (p, seen)
    ft.run(cstep, ft.tree.tree_map(torch.clone, state), batches, num_steps=8, progress=False)  # ft.run's own runner
    assert cstep.progress is not runner.progress and cstep.progress.phase == "compiled", cstep.progress
    cstep(state, batches[0])  # a plain call: the step's own runner trained it last
    assert cstep.progress.phase == "compiled" and cstep.progress.background is False, cstep.progress
