"""Ensembles: several checkpoints decoded as one, through the same search and CLI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import reversal_pairs

from seq2seq import checkpoint as ckpt
from seq2seq.cli import main
from seq2seq.ensemble import Ensemble, load_ensemble
from seq2seq.model import build_model
from seq2seq.tokenizer import train_tokenizer
from seq2seq.translate import Translator

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
