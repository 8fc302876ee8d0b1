"""Tiny configurations of the transformers families people train, built from a config (no download).

Each entry is ``name -> (build, batch)``: ``build()`` gives the model in training mode with its own defaults
(dropout on where the family has it), ``batch(seed)`` a batch of 4 rows for its ``forward(**batch)``, labels
included, so that ``model(**batch).loss`` is the model's own loss. One layer, width 32, sequences of 16: the
smallest models that still run every part of the family's block (attention with its cache and masks, the MLP,
norms, the heads), so that a compile of each takes seconds, not minutes. Used by tests/models/ and
bench/models.py.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

VOCAB, SEQ, ROWS, WIDTH = 64, 16, 4, 32

# what every decoder-only config shares: one layer, 2 heads (2 key/value heads where the family groups them)
_LM = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=1,
           num_attention_heads=2, max_position_embeddings=2 * SEQ, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _ids(seed: int, rows: int = ROWS, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (rows, seq), generator=g)


def _causal(seed: int) -> dict:
    ids = _ids(seed)
    return {"input_ids": ids, "labels": ids}


def _masked(seed: int) -> dict:
    ids = _ids(seed)
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]  # every third token is predicted; the others are ignored (-100)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _seq2seq(seed: int) -> dict:
    return {"input_ids": _ids(seed), "labels": _ids(seed + 1000, seq=SEQ // 2)}


def _image(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(ROWS, 3, 16, 16, generator=g),
            "labels": torch.randint(0, 3, (ROWS,), generator=g)}


def _speech(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_features": torch.randn(ROWS, 8, 2 * SEQ, generator=g),
            "labels": _ids(seed + 1000, seq=SEQ // 2)}


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel  # its defaults: dropout 0.1 everywhere
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=WIDTH, n_layer=1, n_head=2))


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(**_LM, num_key_value_heads=1))


def _mistral() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(**_LM, num_key_value_heads=1, sliding_window=SEQ // 2))


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(**_LM, num_key_value_heads=1))


def _gemma() -> torch.nn.Module:
    from transformers import GemmaConfig, GemmaForCausalLM
    return GemmaForCausalLM(GemmaConfig(**_LM, num_key_value_heads=1, head_dim=16))


def _phi() -> torch.nn.Module:
    from transformers import PhiConfig, PhiForCausalLM  # dropout: resid 0.0, embd 0.0, attention 0.0 by default
    return PhiForCausalLM(PhiConfig(**_LM, resid_pdrop=0.1))


def _gpt_neox() -> torch.nn.Module:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(**_LM, hidden_dropout=0.1, attention_dropout=0.1))


def _bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM  # dropout 0.1 by default
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=2 * WIDTH, max_position_embeddings=2 * SEQ))


def _roberta() -> torch.nn.Module:
    from transformers import RobertaConfig, RobertaForMaskedLM
    return RobertaForMaskedLM(RobertaConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=2 * WIDTH,
                                            max_position_embeddings=2 * SEQ + 2, pad_token_id=1))


def _t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration  # dropout 0.1 by default
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=16, d_ff=2 * WIDTH, num_layers=1,
                                               num_decoder_layers=1, num_heads=2, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))


def _bart() -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration  # dropout 0.1 by default
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=WIDTH, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH,
        max_position_embeddings=2 * SEQ, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2))


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(
        image_size=16, patch_size=8, hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=2 * WIDTH, num_labels=3, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))


def _whisper() -> torch.nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration  # a speech encoder: mel frames in
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=WIDTH, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=2 * WIDTH, decoder_ffn_dim=2 * WIDTH,
        max_source_positions=SEQ, max_target_positions=2 * SEQ, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, dropout=0.1, attention_dropout=0.1, suppress_tokens=None,
        begin_suppress_tokens=None))


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], dict]]] = {
    "gpt2": (_gpt2, _causal), "llama": (_llama, _causal), "mistral": (_mistral, _causal), "qwen2": (_qwen2, _causal),
    "gemma": (_gemma, _causal), "phi": (_phi, _causal), "gpt_neox": (_gpt_neox, _causal),
    "bert": (_bert, _masked), "roberta": (_roberta, _masked),
    "t5": (_t5, _seq2seq), "bart": (_bart, _seq2seq), "vit": (_vit, _image), "whisper": (_whisper, _speech),
}


def documented_step(name: str, seed: int = 0) -> tuple[Any, Any, Callable[[int], dict], torch.nn.Module]:
    """The documented path for model ``name``: ``(step, state, batch, model)`` with the model's own loss,
    ``ft.clip(1.0)(ft.accumulate(2)(ft.train_step(loss_fn, ft.optim.adamw(1e-3))))`` and a seeded state (the
    dropout masks are drawn from it: a compiled step draws the eager step's)."""
    import functrain as ft

    build, batch = MODELS[name]
    torch.manual_seed(seed)
    model = build().train()
    apply_fn, params, buffers = ft.functionalize(model)

    def loss_fn(params: dict, buffers: dict, batch: dict) -> torch.Tensor:
        return apply_fn(params, buffers, **batch).loss

    step = ft.clip(1.0)(ft.accumulate(2)(ft.train_step(loss_fn, ft.optim.adamw(1e-3))))
    return step, step.init(params, buffers, seed=seed), batch, model
