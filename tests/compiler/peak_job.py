"""Measure a compiled step's peak memory in this fresh process, with or without remat: a small transformer LM
(SGD), an MLP stack (blocks Linear + ReLU, or with ``--hidden`` Linear + GELU + Linear), attention blocks (written
out, or ``sdpa``: F.scaled_dot_product_attention) or a conv net (AdamW and an EMA unless ``--optim`` says), or
``tblock``: small transformer blocks (embeddings, the softmax written out, a GELU MLP, an LM head; AdamW); any of
them under ``--accumulate n``.

    python tests/compiler/peak_job.py --policy none,nothing_saveable [--model lm|mlp|attn|sdpa|conv] [--layers 4]
                                      [--d 128] [--hidden 0] [--seq 256] [--batch 8] [--optim sgd|adamw|adamw+ema]
                                      [--backend inductor] [--device cpu|cuda]

Prints one JSON list: per policy (with ``--cases``, one such list per case), the RSS high-water mark of one donated
compiled step above the RSS before it (``peak``, bytes; on ``--device cuda`` ``torch.cuda.max_memory_allocated``
above the allocated bytes before it), after two warm-up steps (the first compiles) so the compiler's own memory is
not counted; on the CPU also the next step's peak counted at torch's allocator (``alloc_peak``: torch.profiler's
memory profile); and the updated params' checksum (``sum``) so the caller can check that the policies computed the
same update; ``estimate`` is ft.memory's step peak for the same step, computed before the first step (``compiles``
shows the first call compiled that capture rather than tracing again: 1). Run it with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed blocks go back to the system and RSS follows the live tensors (the
caller sets it).
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import torch.nn.functional as F

import functrain as ft
from functrain.compiler.estimate import allocated_peak


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Attention(torch.nn.Module):
    """A pre-norm attention block (attention + MLP, residuals): ``sdpa`` uses the fused op, else it is written
    out (scores, causal mask, softmax, weighted sum)."""

    def __init__(self, d: int, heads: int, sdpa: bool):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            a = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ConvNet(torch.nn.Module):
    """A small conv net: blocks of conv 3x3 + BatchNorm + ReLU (+ max-pool), then pooling and a linear head."""

    def __init__(self, width: int, layers: int, classes: int = 10):
        super().__init__()
        chans = [3] + [width * 2 ** (i // 2) for i in range(layers)]
        self.blocks = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Conv2d(chans[i], chans[i + 1], 3, padding=1), torch.nn.BatchNorm2d(chans[i + 1]),
            torch.nn.ReLU(), *([torch.nn.MaxPool2d(2)] if i % 2 else [])) for i in range(layers)])
        self.head = torch.nn.Linear(chans[-1], classes)

    def forward(self, x):
        return self.head(self.blocks(x).mean((2, 3)))


class TBlocks(torch.nn.Module):
    """Small transformer blocks as users write them: token and position embeddings, then per block a pre-norm
    attention whose softmax is written out (scores, an optional causal mask, max subtracted, exp, divided by the
    sum), several heads, a residual stream, a GELU MLP; dropout off; a final layer norm and an LM head."""

    def __init__(self, vocab: int, d: int, heads: int, seq: int, layers: int, mask: bool):
        super().__init__()
        self.heads, self.mask = heads, mask
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList([TBlock(d) for _ in range(layers)])
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab)

    def forward(self, idx):
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for m in self.blocks:
            x = m(x, self.heads, self.mask)
        return self.head(self.ln(x))


class TBlock(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x, heads: int, mask: bool):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, heads, d // heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        s = q @ k.transpose(-2, -1) / (d // heads) ** 0.5
        if mask:
            s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        e = (s - s.amax(-1, keepdim=True)).exp()
        x = x + self.o(((e / e.sum(-1, keepdim=True)) @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class LM(torch.nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(h)))


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def build(policy: str, args) -> tuple:
    """``(step, state, batch)`` of the case ``args`` names, its blocks marked with ``policy``."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if args.model == "tblock":  # TBlocks: args.heads heads, an LM head over args.vocab tokens
        model = TBlocks(args.vocab, args.d, args.heads, args.seq, args.layers, args.mask)
        blocks = list(model.blocks)
        batch = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
                 torch.randint(0, args.vocab, (args.batch, args.seq), generator=g))
    elif args.model == "lm":
        model = LM(args.vocab, args.d, 4, args.layers, args.seq)
        blocks = model.blocks
        batch = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
                 torch.randint(0, args.vocab, (args.batch, args.seq), generator=g))
    elif args.model in ("attn", "sdpa"):  # args.layers attention blocks on (batch, seq, d) inputs, MSE
        model = torch.nn.Sequential(*[Attention(args.d, 4, args.model == "sdpa") for _ in range(args.layers)])
        blocks = model
        batch = (torch.randn(args.batch, args.seq, args.d, generator=g),
                 torch.randn(args.batch, args.seq, args.d, generator=g))
    elif args.model == "conv":  # a conv net of args.layers blocks, width args.d, on args.seq^2 RGB images
        model = ConvNet(args.d, args.layers)
        blocks = model.blocks
        batch = (torch.randn(args.batch, 3, args.seq, args.seq, generator=g),
                 torch.randint(0, 10, (args.batch,), generator=g))
    elif args.hidden:  # args.layers blocks Linear(d, hidden) + GELU + Linear(hidden, d)
        model = torch.nn.Sequential(*[torch.nn.Sequential(
            torch.nn.Linear(args.d, args.hidden), torch.nn.GELU(), torch.nn.Linear(args.hidden, args.d))
            for _ in range(args.layers)])
        blocks = model
        batch = (torch.randn(args.batch, args.d, generator=g), torch.randn(args.batch, args.d, generator=g))
    else:  # an MLP of args.layers Linear(d, d) + ReLU blocks
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(args.d, args.d), torch.nn.ReLU())
                                      for _ in range(args.layers)])
        blocks = model
        batch = (torch.randn(args.batch, args.d, generator=g), torch.randn(args.batch, args.d, generator=g))
    if policy != "none":
        ft.remat(blocks, policy)
    apply_fn, params, buffers = ft.functionalize(model)
    params = {k: v.detach().clone() for k, v in params.items()}

    def loss_fn(p, b, batch):
        x, y = batch
        out = apply_fn(p, b, x)
        if y.is_floating_point():
            return F.mse_loss(out, y)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    optim = args.optim or ("sgd" if args.model == "lm" else "adamw" if args.model == "tblock" else "adamw+ema")
    step = ft.train_step(loss_fn, ft.optim.sgd(0.1) if optim == "sgd" else ft.optim.adamw(1e-3, weight_decay=0.01))
    if optim.endswith("+ema"):
        step = ft.ema(0.99, warmup=False)(step)
    if args.accumulate > 1:
        step = ft.accumulate(args.accumulate)(step)
    params, buffers, batch = ft.to_device((params, buffers, batch), torch.device(args.device))
    return step, step.init(params, buffers), batch


def measure(policy: str, args) -> dict:
    step, state, batch = build(policy, args)
    device = torch.device(args.device)
    cstep = ft.compile(step, donate=True, backend=args.backend)
    out = {"policy": policy}
    t0 = time.process_time()
    est = ft.memory(cstep, state, batch)  # before any step: the capture the first call then compiles
    out["estimate"] = est.step_peak
    out["estimate_s"] = time.process_time() - t0  # (CPU seconds of the estimate, its trace included)
    out["state"] = est.state_total
    for _ in range(2):
        state, _ = cstep(state, batch)
    gc.collect()
    if device.type == "cuda":  # the caching allocator's own count: what ft.memory rounds for
        torch.cuda.synchronize()
        rest = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        state, metrics = cstep(state, batch)
        torch.cuda.synchronize()
        out["peak"] = torch.cuda.max_memory_allocated(device) - rest
    else:
        rest = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        state, metrics = cstep(state, batch)
        out["peak"] = status("VmHWM") - rest
        # the same step counted at torch's allocator (no malloc reuse or retention in it)
        out["alloc_peak"], (state, metrics) = allocated_peak(cstep, state, batch)
    out["compiles"] = cstep.compiles
    out["sum"] = float(sum(p.double().sum() for p in state.params.values()))
    out["loss"] = float(metrics["loss"])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--policy", default="none,nothing_saveable")
    p.add_argument("--model", default="lm", choices=("lm", "mlp", "attn", "sdpa", "conv", "tblock"))
    p.add_argument("--heads", type=int, default=4, help="tblock: attention heads")
    p.add_argument("--mask", type=int, default=0, help="tblock: 1 for a causal mask")
    p.add_argument("--accumulate", type=int, default=1, help="ft.accumulate(n) of the step (the batch is n micro)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--optim", choices=("sgd", "adamw", "adamw+ema"), help="default: sgd for the LM, else adamw+ema")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cases", help='several cases in this one process, as JSON {"name": ["--model", "conv", ...]}: '
                                   'each list is parsed as the command line is; prints {"name": [per policy]}')
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.cases is None:
        print(json.dumps([measure(policy, args) for policy in args.policy.split(",")]))
        return
    out = {}
    for name, argv in json.loads(args.cases).items():
        case = p.parse_args([str(a) for a in argv])
        out[name] = [measure(policy, case) for policy in case.policy.split(",")]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
