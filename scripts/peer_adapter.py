"""The project's side of the peer benchmark suite (../shared/bench-peers): one training update and one decode.

The suite calls these two functions with a model shape and data in this
project's token ids, and times what they return against HF transformers and
CTranslate2 on the same batches. Both run this project's own code path:

- `build_train_step`: the `UpdateStep` that `seq2seq train` runs (learning
  rate from the schedule, a fresh dropout seed per micro-batch, autocast and
  the training attention kernel, the closed-form label-smoothed loss, backward,
  clipping at 1.0, fused Adam) on the model the suite asks for: post-norm,
  ReLU, sinusoidal positions, all embeddings tied, no attention or activation
  dropout.
- `build_decode`: `seq2seq.decoding.search.search`, greedy or beam, with every
  hypothesis forced to exactly `n_tokens` tokens before EOS.

The suite's systems are fixed by name, so `decode.quantize` reaches its
`seq2seq` systems through the environment: `SEQ2SEQ_PEER_QUANTIZE=int8` makes
`build_decode` decode as `seq2seq translate decode.quantize=int8` does (the
same model, its decoder's linears in int8), to be read against the suite's
`ct2-int8` in the same run. The suite imports CTranslate2 plainly, which makes
both engines share torch's OpenMP runtime and slows both;
`scripts/bench/peer_own_openmp.py` runs a suite script with CTranslate2 loaded
as seq2seq loads it (docs/results.md, "One OpenMP runtime for two engines").
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seq2seq.config import DecodeConfig, ExperimentConfig, ModelConfig, OptimConfig, TrainConfig, TransformerConfig
from seq2seq.decoding.search import search
from seq2seq.decoding.translate import quantized
from seq2seq.model import Seq2SeqTransformer, build_model
from seq2seq.text.corpus import Batch
from seq2seq.text.vocab import EOS, PAD
from seq2seq.training.optim import build_optimizer, lr_schedule
from seq2seq.training.update import UpdateStep


def model_config(shape: dict[str, Any]) -> ModelConfig:
    """The suite's shape (bench-peers' common.CONFIGS entry) as this project's model settings."""
    return ModelConfig(
        d_model=shape["d_model"],
        dropout=shape["dropout"],
        share_decoder_embeddings=True,
        share_all_embeddings=True,
        transformer=TransformerConfig(
            n_heads=shape["heads"],
            d_ff=shape["ffn"],
            encoder_layers=shape["enc_layers"],
            decoder_layers=shape["dec_layers"],
            attention_dropout=0.0,
            activation_dropout=0.0,
            activation="relu",
            norm="post",
            positions="sinusoidal",
        ),
    )


def build_train_step(
    shape: dict[str, Any], batches: Sequence[dict[str, Any]], precision: str
) -> tuple[Callable[[dict[str, Any]], float], dict[str, Any]]:
    """(step(batch) -> loss per target token, info): one `seq2seq train` update per call."""
    train = TrainConfig(device="cpu", precision=precision)
    optim = OptimConfig(label_smoothing=shape["label_smoothing"], clip_norm=1.0)
    cfg = ExperimentConfig(model=model_config(shape), train=train, optim=optim)
    model_settings = cfg.model.transformer
    assert model_settings is not None  # model_config describes a Transformer
    device = torch.device("cpu")
    torch.manual_seed(train.seed)
    model = build_model(cfg.model, shape["vocab"], shape["vocab"]).to(device).train()
    optimizer = build_optimizer(model, optim)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    update = UpdateStep.from_config(train, optim, model, optimizer, scaler, device, precision)
    lr = lr_schedule(optim, train, cfg.model.d_model, updates_per_epoch=1000)
    converted = {id(b): _batch(b) for b in batches}
    steps = itertools.count(1)

    def step(b: dict[str, Any]) -> float:
        n = next(steps)
        stats = update([converted.get(id(b)) or _batch(b)], n, lr(n))
        return stats.loss if stats else float("nan")

    info = {
        "precision": precision,
        "attention_kernel": str(update.attention_kernel),
        "optimizer": type(optimizer).__name__,
        "fused": optimizer.defaults.get("fused"),
        "clip_norm": update.clip_norm,
        "norm": model_settings.norm,
        "total_params": sum(p.numel() for p in model.parameters()),
    }
    return step, info


def _batch(b: dict[str, Any]) -> Batch:
    src, tgt_out = b["src"].contiguous(), b["tgt_out"].contiguous()
    batch = Batch(src, src == PAD, b["tgt_in"].contiguous(), tgt_out, int((tgt_out != PAD).sum()))
    assert batch.n_tokens == b["n_tgt"], (batch.n_tokens, b["n_tgt"])
    return batch


def build_decode(
    shape: dict[str, Any], beam: int, src: torch.Tensor, n_tokens: int
) -> tuple[Callable[[], list[int]], int]:
    """(run() -> hypothesis lengths, expected length): `search` on src (B, S), exactly n_tokens tokens + EOS."""
    torch.manual_seed(0)
    model: Seq2SeqTransformer = build_model(model_config(shape), shape["vocab"], shape["vocab"]).eval()
    strategy = "greedy" if beam == 1 else "beam"
    decode = DecodeConfig(
        strategy=strategy,
        beam_size=max(beam, 1),
        min_len=n_tokens,
        max_len=n_tokens,
        max_len_a=0.0,
        max_len_b=n_tokens,
        length_penalty=1.0,
        nbest=1,
    )
    mask, limit = src == PAD, model.max_positions - 1
    decoding = quantized(model, os.environ.get("SEQ2SEQ_PEER_QUANTIZE", "none"))

    def run() -> list[int]:
        tokens = [hyps[0].tokens for hyps in search(decoding, src, mask, decode, limit)]
        assert all(t[-1] == EOS and EOS not in t[:-1] for t in tokens)
        return [len(t) for t in tokens]

    return run, n_tokens + 1  # tokens + EOS = decoder steps
