"""`seq2seq pretrain` (masked-LM pretraining of the encoder) and `train.init_encoder_from`."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, TINY, tiny_overrides

from seq2seq.cli import main
from seq2seq.config import PretrainConfig, load_config
from seq2seq.model.masked_lm import build_masked_lm, mask_id
from seq2seq.runs import checkpoint as ckpt
from seq2seq.text.corpus import collate_pairs
from seq2seq.text.vocab import BOS, EOS, PAD, UNK
from seq2seq.training.assembly import assemble
from seq2seq.training.encoder_init import encoder_weights
from seq2seq.training.loss import batch_loss
from seq2seq.training.masking import Masking, mask_tokens, masked_batch
from seq2seq.training.pretrain import text_data

FIRST = 6  # ordinary ids start here in these tests: 4 special ids and 2 language tags
V = 1000


def random_ids(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(FIRST, V, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_the_masking_recipe_selects_15_percent_and_masks_80_10_10() -> None:
    src = random_ids(400, 100)
    inputs, targets = mask_tokens(src, Masking(V, FIRST), torch.Generator().manual_seed(1))
    selected = targets != PAD
    assert (selected.sum(dim=1) == 15).all()  # round(0.15 x 100) in every sentence
    assert torch.equal(targets[selected], src[selected]) and torch.equal(inputs[~selected], src[~selected])
    n = int(selected.sum())  # 6,000: a share's standard error is below 0.006
    masked = inputs[selected] == mask_id(V)
    kept = inputs[selected] == src[selected]
    randomized = ~masked & ~kept
    assert abs(float(masked.sum()) / n - 0.8) < 0.02
    assert abs(float(kept.sum()) / n - 0.1) < 0.015  # plus a random token that drew the original: 1 in 994
    assert abs(float(randomized.sum()) / n - 0.1) < 0.015
    assert (inputs[selected][randomized] >= FIRST).all() and (inputs[selected][randomized] < V).all()
    first_positions = selected[:, :50].sum() / n  # uniform over the sentence
    assert abs(float(first_positions) - 0.5) < 0.03


def test_the_shares_are_settings() -> None:
    masking = Masking(V, FIRST, prob=0.5, mask=0.0, random=1.0)
    src = random_ids(50, 40)
    inputs, targets = mask_tokens(src, masking, torch.Generator().manual_seed(0))
    selected = targets != PAD
    assert (selected.sum(dim=1) == 20).all()
    assert not (inputs == mask_id(V)).any()
    assert float((inputs[selected] != src[selected]).float().mean()) > 0.99  # all random


def test_no_special_tag_or_padding_token_is_ever_selected_or_changed() -> None:
    src = random_ids(200, 30, seed=3)
    specials = torch.tensor([PAD, UNK, BOS, EOS, 4, 5])  # 4 and 5: language tags
    src[:, ::3] = specials[torch.arange(10) % 6]  # every third position special
    src[:, -5:] = PAD  # and padding at the end
    src[:, -6] = EOS
    inputs, targets = mask_tokens(src, Masking(V, FIRST, prob=0.5), torch.Generator().manual_seed(2))
    special = src < FIRST
    assert (targets[special] == PAD).all() and torch.equal(inputs[special], src[special])
    assert (targets[~special] != PAD).any()


def test_a_sentence_gets_at_least_one_selected_token_and_one_without_ordinary_tokens_none() -> None:
    src = torch.tensor([[7, EOS, PAD, PAD], [UNK, UNK, EOS, PAD], [8, 9, 10, EOS]])
    _, targets = mask_tokens(src, Masking(V, FIRST), torch.Generator().manual_seed(0))
    assert (targets != PAD).sum(dim=1).tolist() == [1, 0, 1]


def test_a_masked_batch_is_a_function_of_its_seed() -> None:
    batch = collate_pairs([list(range(FIRST, FIRST + 30)) + [EOS]] * 8, [[EOS]] * 8)
    masking = Masking(V, FIRST)
    a, b, c = masked_batch(batch, masking, 5), masked_batch(batch, masking, 5), masked_batch(batch, masking, 6)
    assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)
    assert not torch.equal(a.tgt_out, c.tgt_out)
    assert a.n_tokens == int((a.tgt_out != PAD).sum()) == 8 * round(0.15 * 30)


def test_the_loss_scores_the_selected_positions_only(one_thread: None) -> None:
    cfg = load_config(TINY)
    torch.manual_seed(0)
    model = build_masked_lm(cfg.model, 40).eval()
    src = [[FIRST + (i * 7 + j) % 30 for j in range(5 + i)] + [EOS] for i in range(6)]
    batch = masked_batch(collate_pairs(src, [[EOS]] * 6), Masking(40, FIRST), 0)
    loss, nll = batch_loss(model, batch, 0.0)
    selected = batch.tgt_out != PAD
    logits = model(batch.src, batch.src_pad_mask)  # (B, S, V) at every position
    assert logits.shape == (*batch.src.shape, 40)
    expected = F.cross_entropy(logits[selected], batch.tgt_out[selected], reduction="sum")
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nll, expected.detach(), rtol=1e-5, atol=1e-5)
    changed = dataclasses.replace(batch, tgt_out=batch.tgt_out.clone())  # another target where none is scored
    changed.tgt_out[~selected & ~batch.src_pad_mask] = PAD
    torch.testing.assert_close(batch_loss(model, changed, 0.0)[0], loss)


def test_the_settings_are_checked() -> None:
    with pytest.raises(Exception, match=r"pretrain.random_token \(0.3\) plus pretrain.mask_token \(0.8\)"):
        PretrainConfig(mask_token=0.8, random_token=0.3)
    code = main(["config", "--config", str(TINY), "train.init_from=a", "train.init_encoder_from=b"])
    assert code == 2


# Through the CLI, on the reversal task of conftest.


def pretrain_args(corpus: Path, run: Path, *extra: str) -> list[str]:
    settings = ("train.threads=1", "train.precision=fp32", "optim.warmup_steps=4", *extra)
    return ["pretrain", "--config", str(TINY), *tiny_overrides(corpus, run, *settings)]


@pytest.fixture(scope="module")
def pretrained(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pretraining run of 12 updates (a few seconds)."""
    run = tmp_path_factory.mktemp("mlm") / "run"
    assert main(pretrain_args(corpus, run, "train.max_steps=12")) == 0
    return run


@pytest.mark.trains
def test_pretrain_writes_masked_lm_checkpoints_and_validates_masked_tokens(pretrained: Path) -> None:
    best = ckpt.read(pretrained / ckpt.BEST, (ckpt.MASKED_LM,))
    assert best.kind == ckpt.MASKED_LM and best.step == 12
    vocab = best.tokenizer.src_vocab_size
    assert best.model["encoder.embedding.tokens.weight"].shape == (vocab + 1, 64)  # the mask token's row
    assert not any(name.startswith("decoder.") for name in best.model)
    log = (pretrained / "train.log").read_text(encoding="utf-8")
    assert re.search(r"valid loss [\d.]+, ppl [\d.]+, accuracy [\d.]+", log)
    assert (pretrained / "spm.model").read_bytes() == best.tokenizer.src_proto


@pytest.mark.trains
@pytest.mark.parametrize(
    "command",
    [
        ["translate", "-c", "{ckpt}", "--input", "{input}"],
        ["evaluate", "-c", "{ckpt}"],
        ["average", "{ckpt}", "{last}", "-o", "{out}"],
        ["train", "--config", str(TINY), "train.init_from={ckpt}", "train.run_dir={out}"],
    ],
)
def test_a_masked_lm_checkpoint_is_refused_as_a_translation_model_in_one_line(
    pretrained: Path, command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "in.txt").write_text("red cat\n", encoding="utf-8")
    path = pretrained / ckpt.BEST
    last, out = pretrained / ckpt.LAST, tmp_path / "out"
    args = [a.format(ckpt=path, last=last, input=tmp_path / "in.txt", out=out) for a in command]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{path} is a masked-LM pretraining checkpoint, not a translation model" in err


@pytest.mark.trains
def test_a_pretraining_run_resumes_exactly(pretrained: Path, corpus: Path, tmp_path: Path) -> None:
    assert main(pretrain_args(corpus, tmp_path / "part", "train.max_steps=5")) == 0
    assert main(pretrain_args(corpus, tmp_path / "part", "train.max_steps=12")) == 0
    whole, part = (ckpt.read(run / ckpt.LAST, (ckpt.MASKED_LM,)) for run in (pretrained, tmp_path / "part"))
    assert part.training is not None and whole.training is not None
    p, q = part.training.progress, whole.training.progress
    assert (p.step, p.epoch, p.batch_in_epoch) == (q.step, q.epoch, q.batch_in_epoch) == (12, 1, 12)
    assert all(torch.equal(whole.model[name], part.model[name]) for name in whole.model)
    assert "resuming" in (tmp_path / "part" / "train.log").read_text(encoding="utf-8")


@pytest.mark.trains
@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["pretrain", "pretrain.mask_prob=0.2"], "pretrain.mask_prob is 0.2, but the run was started with 0.15"),
        (["train"], "checkpoint_last.pt is a masked-LM pretraining checkpoint, not a translation model"),
    ],
)
def test_a_pretraining_run_is_resumed_as_one_with_its_masking(
    pretrained: Path, corpus: Path, command: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume keeps the masking recipe; `train` does not take a pretraining run's directory for its own."""
    args = pretrain_args(corpus, pretrained, "train.max_steps=13", *command[1:])
    assert main([command[0], *args[1:]]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.trains
def test_pretrain_text_pretrains_on_other_files(corpus: Path, tmp_path: Path) -> None:
    import gzip

    text = tmp_path / "mono.txt.gz"
    with gzip.open(text, "wt", encoding="utf-8") as f:
        f.write("\n".join(["sun moon tree", "", "car house bird fish"] * 40) + "\n")
    run = tmp_path / "run"
    weighted = "data.train=[train:2]"  # upsamples the corpus, not the text
    assert main(pretrain_args(corpus, run, "train.max_epochs=1", weighted, f"pretrain.text=[{text}]")) == 0
    log = (run / "train.log").read_text(encoding="utf-8")
    assert "data: 80 training sentences" in log  # the file's non-empty lines, not the corpus
    assert ckpt.read(run / ckpt.LAST, (ckpt.MASKED_LM,)).tokenizer.src_proto == (run / "spm.model").read_bytes()


def translation_config(corpus: Path, run: Path, *extra: str) -> list[str]:
    return tiny_overrides(corpus, run, "train.threads=1", "train.precision=fp32", *extra)


@pytest.mark.trains
def test_init_encoder_from_loads_exactly_the_encoder_and_the_tokenizer(
    pretrained: Path, corpus: Path, tmp_path: Path
) -> None:
    cfg = load_config(TINY, translation_config(corpus, tmp_path / "mt", f"train.init_encoder_from={pretrained}"))
    parts = assemble(cfg)
    try:
        source = ckpt.read(pretrained / ckpt.BEST, (ckpt.MASKED_LM,))
        expected = encoder_weights(source)
        loaded = parts.model.encoder.state_dict()
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[name], expected[name]) for name in loaded)
        tokens = source.model["encoder.embedding.tokens.weight"]
        assert torch.equal(parts.model.decoder.embedding.tokens.weight, tokens[:-1])  # shared: the decoder's too
        assert parts.tokenizer.state() == source.tokenizer.state()
        parts.saver.save(parts.model, parts.update.optimizer, parts.update.scaler, parts.progress)
    finally:
        parts.close()
    assert "initialized the encoder (" in (tmp_path / "mt" / "train.log").read_text(encoding="utf-8")
    # A translation checkpoint's encoder starts another translation model's just as well.
    translation = tmp_path / "mt" / ckpt.LAST
    again = load_config(TINY, translation_config(corpus, tmp_path / "mt2", f"train.init_encoder_from={translation}"))
    parts = assemble(again)
    try:
        assert all(torch.equal(parts.model.encoder.state_dict()[name], t) for name, t in expected.items())
    finally:
        parts.close()


@pytest.mark.trains
@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("model.d_model=32", r"encoder.embedding.tokens.weight is \(\d+, 64\) there, \(\d+, 32\) in this model "
         r"\(model settings that differ: model.d_model 64 -> 32"),
        ("model.transformer.encoder_layers=3", r"the pretrained encoder lacks encoder.layers.2.*encoder_layers 2 -> 3"),
        ("data.vocab_size=100", r"data.vocab_size is 100, but the pretrained encoder's tokenizer was built with 64"),
        ("model.arch=rnn model.transformer=null", r"a pretrained encoder starts a Transformer"),
    ],
)  # fmt: skip
def test_init_encoder_from_refuses_another_shape_or_vocabulary_in_one_line(
    pretrained: Path, corpus: Path, tmp_path: Path, setting: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = translation_config(corpus, tmp_path / "mt", f"train.init_encoder_from={pretrained}", *setting.split())
    assert main(["train", "--config", str(TINY), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err


# The guide's example, run as written (as tests/test_readme.py runs the README's).

MARK = "<!-- guide-test -->"


@pytest.mark.trains
def test_the_guides_pretraining_example_runs(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    blocks = re.findall(re.escape(MARK) + r"\n```bash\n(.*?)```", text, re.DOTALL)
    assert len(blocks) == text.count(MARK) == 1
    for name in ("configs", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", blocks[0]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert ckpt.read(tmp_path / "runs/toy-mlm" / ckpt.BEST, (ckpt.MASKED_LM,)).kind == ckpt.MASKED_LM
    assert "initialized the encoder" in (tmp_path / "runs/toy-enc/train.log").read_text(encoding="utf-8")
    assert re.search(r"BLEU = \d", done.stdout)


# The kind marker in the file.


def test_the_kind_marker_round_trips_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    from seq2seq.text.tokenizer import train_tokenizer

    cfg = load_config(TINY)
    tokenizer = train_tokenizer(["red cat sun moon"] * 20, ["sun moon cat red"] * 20, 24, True)
    model = build_masked_lm(cfg.model, tokenizer.src_vocab_size)
    path = tmp_path / "mlm.pt"
    ckpt.save(path, ckpt.Checkpoint(cfg, tokenizer, model.state_dict(), "run", step=3, kind=ckpt.MASKED_LM))
    stored = ckpt.read(path, (ckpt.MASKED_LM,))
    assert stored.kind == ckpt.MASKED_LM and stored.model.keys() == model.state_dict().keys()
    raw = torch.load(path, weights_only=True)
    assert raw["kind"] == ckpt.MASKED_LM
    for bad, message in (([1], "kind must be str, not list"), ("x" * 100, "unknown checkpoint kind 'xxxx")):
        with pytest.raises(ckpt.CheckpointError, match=re.escape(message)):
            ckpt.Checkpoint.from_dict({**raw, "kind": bad}, "f.pt", (ckpt.MASKED_LM,))
    with pytest.raises(ckpt.CheckpointError, match="f.pt is a translation model, not a masked-LM pretraining"):
        ckpt.Checkpoint.from_dict({k: v for k, v in raw.items() if k != "kind"}, "f.pt", (ckpt.MASKED_LM,))
    translation = ckpt.Checkpoint(cfg, tokenizer, {}, "run").to_dict()
    assert "kind" not in translation  # a translation model's file is as it was before kinds


@pytest.mark.trains
def test_a_batch_is_masked_alike_in_a_dataloader_worker_and_after_a_resume(pretrained: Path, corpus: Path) -> None:
    """Masks are a function of (seed, epoch, batch number): a pickled copy (what a worker process gets) masks
    each batch as the original does, and different batches differently."""
    import pickle

    from seq2seq.text.prepare import PreparedCorpus
    from seq2seq.training.pretrain import MaskedEpochs

    cfg = load_config(TINY, tiny_overrides(corpus, pretrained))
    prepared = PreparedCorpus(pretrained / "prepared")
    masking = Masking.of(cfg.pretrain, prepared.tokenizer)
    epochs = MaskedEpochs(masking, prepared, cfg.data, cfg.train, torch.device("cpu"))
    copy = pickle.loads(pickle.dumps(epochs))
    for j in (0, 3):
        a, b = epochs.batch(2, j), copy.batch(2, j)
        assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out) and a.n_tokens == b.n_tokens > 0
    assert not torch.equal(epochs.batch(2, 0).tgt_out, epochs.batch(3, 0).tgt_out)


def test_the_text_links_follow_the_texts_and_every_rank_may_make_them(tmp_path: Path) -> None:
    """pretrain.text's files are linked into the run; linking again (another rank, a resumed run with other
    files) leaves one link per side pointing at the current file."""
    plain, packed = tmp_path / "a.txt", tmp_path / "b.txt.gz"
    plain.write_text("x\n")
    packed.write_bytes(b"")
    links = tmp_path / "links"
    data = load_config(TINY, []).data
    for texts in [(str(plain),), (str(plain),), (str(packed),)]:
        text_data(data, texts, links)
    assert sorted(p.name for p in links.iterdir()) == ["set0.src.gz", "set0.tgt.gz"]
    assert all(p.resolve() == packed for p in links.iterdir())
