"""Ensembles: several checkpoints decoded as one, through the same search and CLI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import model_config, reversal_pairs

from seq2seq.cli import main
from seq2seq.config import DecodeConfig, RNNConfig
from seq2seq.decoding.alignment import model_attention, select, teacher_forced_attention
from seq2seq.decoding.ensemble import Ensemble, EnsembleSession, load_ensemble
from seq2seq.decoding.search import search
from seq2seq.decoding.translate import Translator
from seq2seq.model import RNNSession, Seq2SeqRNN, Seq2SeqTransformer, TransformerSession, build_model
from seq2seq.runs import checkpoint as ckpt
from seq2seq.text.tokenizer import train_tokenizer
from seq2seq.text.vocab import BOS, EOS, PAD

pytestmark = pytest.mark.usefixtures("one_thread")
LINES = ["red cat dog sun", "blue tree house car bird fish", "moon", "green green bird"]


@pytest.mark.parametrize("strategy", ["greedy", "beam", "sample"])
def test_an_ensemble_of_a_model_with_itself_is_the_model(trained_run: Path, strategy: str) -> None:
    path = trained_run / "checkpoint_best.pt"
    alone = Translator.from_checkpoint(path, strategy=strategy, nbest=2 if strategy == "beam" else 1)
    ensemble, _ = load_ensemble([path, path])
    pair = Translator(ensemble, alone.tokenizer, alone.decode, alone.device, alone.data)
    for a, b in zip(alone.translate_full(LINES), pair.translate_full(LINES)):
        assert [h.tokens for h in a.hypotheses] == [h.tokens for h in b.hypotheses]
        assert [h.score for h in a.hypotheses] == pytest.approx([h.score for h in b.hypotheses], abs=1e-4)


def test_the_cli_decodes_two_checkpoints_together(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    best, last = trained_run / "checkpoint_best.pt", trained_run / "checkpoint_last.pt"
    argv = ["translate", "-c", str(best), "-c", str(last), "-i", str(source), "decode.strategy=greedy"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    alone = Translator.from_checkpoint(best, strategy="greedy")
    ensemble, _ = load_ensemble([best, last])
    pair = Translator(ensemble, alone.tokenizer, alone.decode, alone.device, alone.data)
    assert out == [r.text for r in pair.translate_full(LINES)]  # the CLI decodes both members, whatever they learnt


def test_members_must_share_the_vocabulary(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stored = ckpt.read(trained_run / "checkpoint_best.pt")
    other = train_tokenizer(*reversal_pairs(300, seed=5), 48, shared=True)
    model = stored.build_model()  # the weights do not matter: the vocabulary check comes first
    foreign = dataclasses.replace(stored, tokenizer=other, model=model.state_dict())
    ckpt.save(tmp_path / "other.pt", foreign)
    argv = ["translate", "-c", str(trained_run / "checkpoint_best.pt"), "-c", str(tmp_path / "other.pt")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vocabulary differs" in err[0] and "other.pt" in err[0]


def test_the_ensemble_limit_is_its_shortest_member(trained_run: Path) -> None:
    stored = ckpt.read(trained_run / "checkpoint_best.pt")
    vocab = stored.tokenizer.tgt_vocab_size
    short = dataclasses.replace(stored.config.model, max_positions=64)
    members = [build_model(stored.config.model, vocab, vocab), build_model(short, vocab, vocab)]
    assert members[0].max_positions > 64 and Ensemble(members).max_positions == 64


@torch.no_grad()
def test_a_transformer_and_an_rnn_decode_together_through_their_sessions() -> None:
    """Members of different kinds, each driven through its own session: every step of the ensemble's session is
    the mean of the members' log-probabilities, through `select` and `reorder` too, search runs over it, and
    its attention is the mean of the members'."""
    vocab, small = 19, {"d_model": 16, "dropout": 0.0, "max_positions": 32}
    torch.manual_seed(0)
    transformer = build_model(
        model_config(n_heads=2, d_ff=32, encoder_layers=2, decoder_layers=2, **small), vocab, vocab
    )
    rnn = build_model(
        model_config(arch="rnn", rnn=RNNConfig(attention="dot", hidden_size=12, layers=1), **small), vocab, vocab
    )
    assert isinstance(transformer, Seq2SeqTransformer) and isinstance(rnn, Seq2SeqRNN)
    ensemble = Ensemble([transformer, rnn]).eval()
    src = torch.tensor([[5, 6, 7, EOS], [8, 9, EOS, PAD]])
    mask = src == PAD
    alone, recurrent, together = transformer.start(src, mask), rnn.start(src, mask), ensemble.start(src, mask)
    assert isinstance(alone, TransformerSession) and isinstance(recurrent, RNNSession)
    assert isinstance(together, EnsembleSession) and together.attention is None
    moves = {1: ("select", torch.tensor([0, 0, 1, 1])), 2: ("reorder", torch.tensor([1, 0, 3, 2]))}
    tokens = torch.full((2, 1), BOS)
    for t in range(4):
        if t in moves:
            how, index = moves[t]
            for session in (alone, recurrent, together):
                getattr(session, how)(index)
            tokens = tokens[index]
        members = [torch.log_softmax(session.step(tokens).float(), dim=-1) for session in (alone, recurrent)]
        logprobs = together.step(tokens)
        torch.testing.assert_close(logprobs, torch.stack(members).mean(dim=0), rtol=0, atol=0)
        tokens = logprobs.argmax(dim=-1, keepdim=True)
    for strategy in ("greedy", "beam"):
        hypotheses = search(ensemble, src, mask, DecodeConfig(strategy=strategy, beam_size=2, nbest=2, max_len_b=6), 31)
        assert all(sentence and all(h.tokens[-1] == EOS for h in sentence) for sentence in hypotheses)
    tgt = torch.tensor([[7, 6, EOS], [9, EOS, PAD]])  # alignment: each member's last layer, heads averaged
    weights, layers, _ = model_attention(ensemble, src, mask, tgt, "last", "mean")
    each = [select(teacher_forced_attention(m, src, mask, tgt), "last", "mean")[0] for m in (transformer, rnn)]
    torch.testing.assert_close(weights, (each[0] + each[1]) / 2)
    assert layers == ["chosen layer"]
