"""A small causal language model with gradient accumulation and token-count normalisation.

The loss is a *sum* over real (non-padding) tokens and ``aux["num_items"]`` is
their count, so ``ft.accumulate(n)`` divides the summed gradient once by the
total number of tokens in the whole batch: the update equals the token-mean
update of the big batch, however the padding falls into micro-batches.

Uses a ``transformers`` GPT-2 built from a config (no download) when
``transformers`` is installed, else a small self-written transformer.

    python examples/lm.py --steps 200
"""
from __future__ import annotations

import argparse
import math

import torch

import functrain as ft

PAD = 0


def corpus(n_seqs: int, max_len: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length sequences from a tiny grammar (counting patterns), right-padded with PAD."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((n_seqs, max_len), PAD, dtype=torch.int64)
    lengths = torch.randint(max_len // 3, max_len + 1, (n_seqs,), generator=g)
    for i in range(n_seqs):
        start = int(torch.randint(1, vocab, (), generator=g))
        stride = int(torch.randint(1, 4, (), generator=g))
        seq = (start + stride * torch.arange(int(lengths[i]))) % (vocab - 1) + 1
        tokens[i, : len(seq)] = seq
    return tokens, lengths


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int, d: int = 64, layers: int = 2, heads: int = 4, max_len: int = 64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(max_len, d)
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.emb(tokens) + self.pos(torch.arange(n, device=tokens.device))
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def build_model(vocab: int, max_len: int) -> tuple[torch.nn.Module, bool]:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return TinyLM(vocab, max_len=max_len), False
    # GPT-2's own defaults (dropout 0.1 everywhere: the compiled step draws the eager step's masks), but no special
    # token outside the 32-token vocabulary (GPT-2's default bos/eos id is 50256); PAD is the pad id
    config = GPT2Config(vocab_size=vocab, n_positions=max_len, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=None, eos_token_id=None, pad_token_id=PAD)
    return GPT2LMHeadModel(config), True


def main() -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--self-written", action="store_true", help="skip transformers even if installed")
    args = parser.parse_args()
    torch.manual_seed(0)
    vocab = 32
    tokens, lengths = corpus(2048, args.seq_len, vocab, seed=0)
    model, hf = (TinyLM(vocab, max_len=args.seq_len), False) if args.self_written else build_model(vocab, args.seq_len)
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params, buffers, batch):
        x = batch[:, :-1]
        y = batch[:, 1:]
        # right padding: the transformers model is told where it is (the self-written one is causal, and
        # padded positions only ever follow real tokens, so they never reach a real token's prediction)
        out = apply_fn(params, buffers, x, attention_mask=(x != PAD).long()) if hf else apply_fn(params, buffers, x)
        logits = out.logits if hasattr(out, "logits") else out
        valid = (y != PAD)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), reduction="none")
        return (loss * valid.reshape(-1)).sum(), {"num_items": valid.sum()}

    if args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")
    micro = args.batch_size
    warmup = min(20, args.steps // 10)  # a tenth of the run, at most 20 updates: any --steps works
    step = ft.train_step(loss_fn, ft.optim.adamw(ft.optim.schedules.warmup_cosine(3e-3, warmup, args.steps)))
    step = ft.clip(1.0)(ft.accumulate(args.accumulate)(step))
    state = step.init(params, buffers)
    run_step = step if args.no_compile else ft.compile(step)
    how = ("eagerly (--no-compile)" if args.no_compile else "eagerly while the step compiles in the background, then "
           "compiled (or eagerly to the end if compiling does not pay: the run says so)")
    print(f"{'transformers GPT-2' if hf else 'self-written transformer'}: {args.steps} updates of {args.accumulate} x "
          f"{micro} sequences, {how}; minutes on a small CPU (--steps 40 for a quick look)", flush=True)

    def batches():
        g = torch.Generator().manual_seed(1)
        while True:
            idx = torch.randperm(len(tokens), generator=g)
            for i in range(0, len(idx) - micro * args.accumulate + 1, micro * args.accumulate):
                yield tokens[idx[i:i + micro * args.accumulate]]

    log = []
    state = ft.run(run_step, state, batches(), num_steps=args.steps, log_every=25,
                   on_log=lambda i, m: (log.append(m["loss"]),
                                        print(f"step {i:4d}  token-mean loss {m['loss']:.3f}  "
                                              f"tokens/update {int(m['num_items'])}")))
    print(f"{'transformers GPT-2' if hf else 'self-written transformer'}: final loss {log[-1]:.3f} "
          f"(perplexity {math.exp(log[-1]):.2f}; uniform would be {vocab - 1})")
    return log[-1]


if __name__ == "__main__":
    main()
