"""The benchmark workloads W1-W4: model, data, loss and the functrain step each one trains.

Everything here is deterministic: the initial weights come from ``torch.manual_seed``
and the data from a seeded ``torch.Generator``, so that every variant of a workload
starts from the same weights and sees the same batches in the same order.

A workload's ``batches`` is a list of *update batches*: what one optimizer update
consumes. For W3 (gradient accumulation) an update batch is 4 x 32 rows; the
hand-written baseline uses the pre-split micro-batches in ``micro`` (views, made
once, outside the timed loop), functrain gets the whole 128-row batch and splits it
inside its step.

T2/T4/T8 are a small GPT-style language model (a hand-written pre-norm transformer
block with causal ``scaled_dot_product_attention``, d_model 128, 4 heads, sequence
64, vocabulary 256, batch 16, next-token cross-entropy) at depth 2, 4 and 8, for the
depth sweep (``python bench/steps.py --sweep``). Its data is a seeded random
first-order Markov chain over the vocabulary, so the loss can fall.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import functrain as ft

__all__ = ["Workload", "WORKLOADS", "SWEEP", "build", "eval_loss", "functrain_step"]


@dataclass
class Workload:
    key: str
    title: str
    sizes: tuple[int, ...]          # MLP layer widths, input first
    batch: int                      # rows per micro-batch
    loss: str                       # "mse" | "ce"
    accum: int = 1                  # micro-batches per optimizer update
    clip: float | None = None       # global grad-norm clip
    ema: float | None = None        # EMA decay of the weights
    fp16: bool = False              # fp16 compute with dynamic loss scaling
    lr: float = 1e-3
    steps_per_round: int = 50       # default K: optimizer updates per variant per round
    n_batches: int = 64             # distinct update batches, cycled
    kind: str = "mlp"               # "mlp" | "lm" (the transformer language model; sizes unused)
    layers: int = 0                 # lm: transformer blocks
    d_model: int = 128              # lm: width
    heads: int = 4                  # lm: attention heads
    seq: int = 64                   # lm: tokens per sequence (inputs; targets are shifted by one)
    vocab: int = 256                # lm: vocabulary size
    # filled by build():
    init_state: dict = field(default_factory=dict)
    batches: list = field(default_factory=list)
    micro: list = field(default_factory=list)
    eval_batch: tuple = ()

    @property
    def describe(self) -> str:
        if self.kind == "lm":
            return (f"transformer LM, {self.layers} layers, d {self.d_model}, {self.heads} heads, seq {self.seq}, "
                    f"vocab {self.vocab}, batch {self.batch}, next-token cross-entropy, AdamW lr {self.lr:g}")
        arch = "-".join(map(str, self.sizes))
        extra = []
        if self.accum > 1:
            extra.append(f"accumulate({self.accum})")
        if self.clip is not None:
            extra.append(f"clip({self.clip:g})")
        if self.ema is not None:
            extra.append(f"ema({self.ema:g})")
        if self.fp16:
            extra.append("fp16 + loss scaling")
        rows = f"{self.accum}x{self.batch}" if self.accum > 1 else str(self.batch)
        return (f"MLP {arch} (ReLU), batch {rows}, {'MSE' if self.loss == 'mse' else 'cross-entropy'}, "
                f"AdamW lr {self.lr:g}" + (", " + ", ".join(extra) if extra else ""))


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", "tiny", (32, 64, 64, 1), 32, "mse", steps_per_round=100),
    "W2": Workload("W2", "medium", (256, 1024, 1024, 10), 64, "ce", steps_per_round=5, n_batches=16),
    "W3": Workload("W3", "tiny+accum+clip+ema", (32, 64, 64, 1), 32, "mse", accum=4, clip=1.0, ema=0.999,
                   steps_per_round=40),
    "W4": Workload("W4", "tiny fp16+clip", (32, 64, 64, 1), 32, "mse", clip=1.0, fp16=True,
                   steps_per_round=40),
}
for _depth in (2, 4, 8):
    WORKLOADS[f"T{_depth}"] = Workload(f"T{_depth}", f"transformer {_depth} layers", (), 16, "lm", kind="lm",
                                       layers=_depth, steps_per_round=2, n_batches=8)
SWEEP = ("T2", "T4", "T8")


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention and a 4x GELU MLP, no dropout."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(torch.nn.Module):
    """Token + position embeddings, ``layers`` blocks, a final LayerNorm and an untied head: logits (B, T, V)."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_model(wl: Workload) -> torch.nn.Module:
    if wl.kind == "lm":
        return TinyLM(wl.vocab, wl.d_model, wl.heads, wl.layers, wl.seq)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(wl.sizes[:-1], wl.sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(wl.sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def loss_of(wl: Workload) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if wl.kind == "lm":
        return lm_loss
    return F.mse_loss if wl.loss == "mse" else F.cross_entropy


def build(wl: Workload, device: torch.device, seed: int = 0) -> Workload:
    """Fill in the initial weights and the pre-generated batches (on ``device``)."""
    torch.manual_seed(seed)
    wl.init_state = {k: v.detach().clone().to(device) for k, v in make_model(wl).state_dict().items()}
    g = torch.Generator().manual_seed(seed + 1)
    if wl.kind == "lm":
        _build_lm_data(wl, device, g)
        return wl
    d_in, d_out = wl.sizes[0], wl.sizes[-1]
    rows = wl.batch * wl.accum
    teacher = torch.randn(d_in, d_out, generator=g) / d_in ** 0.5

    def sample(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, d_in, generator=g)
        if wl.loss == "mse":
            y = torch.sin(x @ teacher) + 0.1 * torch.randn(rows, d_out, generator=g)
        else:
            y = (x @ teacher + 0.5 * torch.randn(rows, d_out, generator=g)).argmax(dim=1)
        return x.to(device).contiguous(), y.to(device).contiguous()

    wl.batches = [sample(rows) for _ in range(wl.n_batches)]
    wl.eval_batch = sample(1024)
    wl.micro = [list(zip(x.chunk(wl.accum), y.chunk(wl.accum))) for x, y in wl.batches]
    return wl


def _build_lm_data(wl: Workload, device: torch.device, g: torch.Generator) -> None:
    # a random sparse-ish Markov chain: each token has a few likely successors
    trans = torch.softmax(3.0 * torch.randn(wl.vocab, wl.vocab, generator=g), dim=1)

    def sample(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        toks = torch.empty(rows, wl.seq + 1, dtype=torch.long)
        toks[:, 0] = torch.randint(0, wl.vocab, (rows,), generator=g)
        for t in range(wl.seq):
            toks[:, t + 1] = torch.multinomial(trans[toks[:, t]], 1, generator=g).squeeze(1)
        return toks[:, :-1].contiguous().to(device), toks[:, 1:].contiguous().to(device)

    wl.batches = [sample(wl.batch) for _ in range(wl.n_batches)]
    wl.eval_batch = sample(64)
    wl.micro = [[b] for b in wl.batches]


@torch.no_grad()
def eval_loss(wl: Workload, params: dict[str, torch.Tensor]) -> float:
    """The loss of ``params`` on the held-out batch (1024 rows), in fp32: the training's outcome."""
    model = make_model(wl).to(wl.eval_batch[0].device)
    model.load_state_dict({**wl.init_state, **{k: v.float() for k, v in params.items()}})
    x, y = wl.eval_batch
    return float(loss_of(wl)(model(x), y))


# -- the functrain side -----------------------------------------------------------------------
def functrain_step(wl: Workload) -> tuple[ft.Step, dict, dict]:
    """The workload's functrain step and fresh copies of the initial params and buffers."""
    module = make_model(wl).to(next(iter(wl.init_state.values())).device)
    module.load_state_dict(wl.init_state)
    apply_fn, params, buffers = ft.functionalize(module)
    params = {k: v.clone() for k, v in params.items()}      # own storage (donation writes into it)
    buffers = {k: v.clone() for k, v in buffers.items()}
    lossf = loss_of(wl)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return lossf(apply_fn(params, buffers, x), y)

    step = ft.train_step(loss_fn, ft.optim.adamw(lr=wl.lr))
    if wl.accum > 1:
        step = ft.accumulate(wl.accum)(step)
    if wl.fp16:
        step = ft.mixed_precision("fp16")(step)
    if wl.clip is not None:
        step = ft.clip(wl.clip)(step)
    if wl.ema is not None:
        step = ft.ema(wl.ema, warmup=False)(step)
    return step, params, buffers
