"""The explorer's API: `seq2seq serve`'s attention (POST /translate with "attention": true), its limits,
several models side by side, and the page's files. The browser drives the page in test_explorer_browser.py.

The attention must be what `seq2seq translate --alignment` reads: the same re-scoring pass, the same alignments.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import model_config

from seq2seq.cli import main
from seq2seq.config import DecoderOnlyConfig, RNNConfig
from seq2seq.decoding.ensemble import Ensemble
from seq2seq.decoding.translate import Translator
from seq2seq.errors import UsageError
from seq2seq.model import build_model
from seq2seq.runs.checkpoint import load_checkpoint
from seq2seq.serve.options import ServeOptions, served_models

pytest.importorskip("starlette", reason="seq2seq serve needs the serve extra: pip install -e '.[serve]'")

from test_serve import Server, asgi  # noqa: E402

from seq2seq.serve.app import create_app  # noqa: E402  (after the skip)
from seq2seq.serve.batcher import Batcher  # noqa: E402
from seq2seq.serve.engine import TranslatorEngine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

Answer = tuple[int, dict[str, str], bytes]


def ask(translators: dict[str, Translator], *requests: tuple[str, str, Any], **limits: Any) -> list[Answer]:
    """The answers of an app serving these models to (method, path, JSON body or None) requests, in turn."""
    batchers = {name: Batcher(TranslatorEngine(t), 1000, 0.0, 10) for name, t in translators.items()}
    app = create_app(batchers, ServeOptions(**limits))

    async def run() -> list[Answer]:
        for batcher in batchers.values():
            batcher.start()
        try:
            return [await asgi(app, m, path, b"" if b is None else json.dumps(b).encode()) for m, path, b in requests]
        finally:
            for batcher in batchers.values():
                await batcher.stop()

    return asyncio.run(run())


def translate(translator: Translator, body: dict[str, Any], **limits: Any) -> tuple[int, Any]:
    [(status, _, raw)] = ask({"m": translator}, ("POST", "/translate", body), **limits)
    return status, json.loads(raw)


@pytest.fixture(scope="module")
def checkpoint(trained_run: Path) -> Path:
    return trained_run / "checkpoint_best.pt"


@pytest.fixture(scope="module")
def translator(checkpoint: Path) -> Translator:
    return Translator.from_checkpoint(checkpoint)


@pytest.mark.parametrize("layer", ["last", "all"])
def test_the_attention_is_that_of_translate_alignment(
    translator: Translator, checkpoint: Path, tmp_path: Path, layer: str
) -> None:
    lines = ["red cat dog", "", "sun moon tree car", "bird fish house"]
    (tmp_path / "in.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    argv = ["translate", "-c", str(checkpoint), "--threads", "1", "-i", str(tmp_path / "in.txt"), "--format", "jsonl"]
    assert main([*argv, "--alignment", "--attention-layer", layer, "-o", str(tmp_path / "out.jsonl")]) == 0
    expected = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    options = {"attention": True, "attention_layer": layer, "attention_heads": "each"}
    status, body = translate(translator, {"text": lines, "options": options})
    assert status == 200
    maps = translator.attention(translator.translate_full(lines), layer, "each")
    for line, answer, amap in zip(expected, body["translations"], maps):
        assert answer["text"] == line["translation"]
        if amap is None:
            assert answer["attention"] == [] and line["alignment"] == []
            continue
        [best] = answer["attention"]
        assert (best["source"], best["target"]) == (line["source_pieces"], line["nbest"][0]["pieces"])
        assert (best["alignment"], best["word_alignment"]) == (line["alignment"], line["word_alignment"])
        assert best["layers"] == amap.layers and best["heads"] == amap.heads == ["head 1", "head 2", "head 3", "head 4"]
        assert torch.allclose(torch.tensor(best["weights"], dtype=torch.float64), amap.weights.double(), atol=6e-5)


def test_each_hypothesis_has_its_own_attention(translator: Translator) -> None:
    status, body = translate(translator, {"text": ["red cat dog"], "options": {"nbest": 2, "attention": True}})
    assert status == 200
    [answer] = body["translations"]
    first, second = answer["attention"]
    [expected] = translator.with_decode(nbest=2).translate_full(["red cat dog"])
    assert [h["text"] for h in answer["nbest"]] == expected.texts
    assert first["target"] == expected.pieces[0] and first["source"] == ["▁red", "▁cat", "▁dog", "</s>"]
    assert first["layers"] == ["layer 2"] and first["heads"] == ["mean of 4 heads"]
    assert first["target"] != second["target"]
    weights = torch.tensor(first["weights"])
    rows = len(first["target"])
    assert weights.shape == (1, 1, rows, 4) and torch.allclose(weights.sum(dim=-1), torch.ones(1, 1, rows), atol=1e-3)
    status, plain = translate(translator, {"text": ["red cat dog"]})
    assert plain == {"translations": [answer["nbest"][0]["text"]]}  # no attention unless asked


UNTRAINED = {
    "transformer-relative-post": {"positions": "relative", "max_relative_distance": 4, "norm": "post"},
    "transformer-rope-rmsnorm": {"positions": "rope", "norm_type": "rmsnorm", "decoder_layers": 3},
    "transformer-t5-bias-post": {"positions": "t5_bias", "t5_buckets": 8, "t5_max_distance": 6, "norm": "post"},
    **{
        f"rnn-{score}": {"arch": "rnn", "rnn": RNNConfig(attention=score, hidden_size=16, layers=1)}
        for score in ("dot", "general", "mlp")
    },
    "decoder_only-prefix": {"arch": "decoder_only"},
    "decoder_only-causal-rope": {
        "arch": "decoder_only",
        "decoder_only": DecoderOnlyConfig(prefix="causal"),
        "positions": "rope",
    },
}


def untrained(checkpoint: Path, **settings: Any) -> Translator:
    """A small model of another architecture, untrained, with the trained one's tokenizer and settings."""
    loaded = load_checkpoint(checkpoint)
    torch.manual_seed(0)
    base = {"d_model": 16, "n_heads": 2, "d_ff": 32, "encoder_layers": 2, "decoder_layers": 2, "max_positions": 64}
    tokenizer = loaded.tokenizer
    model = build_model(model_config(**{**base, **settings}), tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    return Translator(model, tokenizer, loaded.config.decode, "cpu", loaded.config.data)


@pytest.mark.parametrize("arch", UNTRAINED)
def test_every_architecture_with_attention_answers_with_it(checkpoint: Path, arch: str) -> None:
    model = untrained(checkpoint, **UNTRAINED[arch])
    options = {"attention": True, "attention_layer": "all", "attention_heads": "each", "max_len_b": 6}
    status, body = translate(model, {"text": ["red cat dog"], "options": options})
    assert status == 200, body
    [best] = body["translations"][0]["attention"]
    layers, heads = (1, 1) if arch.startswith("rnn") else (3 if "rope" in arch else 2, 2)
    if arch.startswith("decoder_only"):  # one stack of encoder_layers + decoder_layers, all attending to the source
        layers = 4
    weights = torch.tensor(best["weights"])
    assert weights.shape == (layers, heads, len(best["target"]), 4)  # ▁red ▁cat ▁dog </s>
    assert torch.allclose(weights.sum(dim=-1), torch.ones(weights.shape[:-1]), atol=1e-3)


def test_a_model_without_attention_gets_its_translations_and_a_note(checkpoint: Path) -> None:
    model = untrained(checkpoint, arch="rnn", rnn=RNNConfig(attention="none", hidden_size=16, layers=1))
    status, body = translate(model, {"text": ["red cat", ""], "options": {"attention": True, "max_len_b": 4}})
    assert status == 200
    assert [t["attention"] for t in body["translations"]] == [None, None]
    assert [t["text"] for t in body["translations"]] == [model.with_decode(max_len_b=4).translate(["red cat"])[0], ""]
    assert (
        body["note"] == "this model has no attention (model.rnn.attention: none): there are no weights to draw or align"
    )


@pytest.mark.parametrize(
    ("options", "status", "message"),
    [
        ({"attention": "yes"}, 400, "option 'attention' must be true or false"),
        ({"attention_layer": 1}, 400, "option 'attention_layer' goes with \"attention\": true"),
        ({"attention": True, "attention_layer": "top"}, 400, "'attention_layer' must be last, all or a layer number"),
        ({"attention": True, "attention_layer": 0}, 400, "'attention_layer' must be last, all or a layer number"),
        ({"attention": True, "attention_layer": True}, 400, "'attention_layer' must be last, all or a layer number"),
        ({"attention": True, "attention_layer": 3}, 400, "attention layer 3 does not exist: the model has 2"),
        ({"attention": True, "attention_heads": "max"}, 400, "'attention_heads' must be mean or each"),
    ],
)
def test_bad_or_too_large_attention_requests_get_a_4xx(
    translator: Translator, options: dict[str, Any], status: int, message: str
) -> None:
    code, body = translate(translator, {"text": ["red cat dog"], "options": options}, max_attention=100)
    assert code == status and message in body["error"], body


def test_attention_over_the_limit_gets_a_413_and_within_it_an_answer(translator: Translator) -> None:
    [amap] = translator.attention(translator.translate_full(["red cat dog"]), "all", "each")
    assert amap is not None
    weights = amap.weights.numel()  # 2 layers x 4 heads x the translation's pieces x 4 source pieces
    options = {"attention": True, "attention_layer": "all", "attention_heads": "each"}
    code, body = translate(translator, {"text": ["red cat dog"], "options": options}, max_attention=weights - 1)
    assert code == 413 and f"has {weights} weights; this server" in body["error"], body
    assert translate(translator, {"text": ["red cat dog"], "options": options}, max_attention=weights)[0] == 200


def test_attention_known_to_be_over_the_limit_is_refused_before_it_is_computed(
    translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Target x source subwords of each hypothesis is the least an answer holds (one layer, heads averaged): a
    request already over the limit by that count gets its 413 without the teacher-forced pass (64 long lines at
    beam 16 once held the decoding thread 25 s before the 413)."""
    [result] = translator.translate_full(["red cat dog"])
    fewest = len(result.hypotheses[0].tokens) * len(result.source_tokens)
    monkeypatch.setattr(Translator, "attention", lambda *args, **kwargs: pytest.fail("the attention was computed"))
    body = {"text": ["red cat dog"], "options": {"attention": True}}
    code, answer = translate(translator, body, max_attention=fewest - 1)
    assert code == 413 and f"has at least {fewest} weights; this server sends up to {fewest - 1}" in answer["error"]


def test_an_ensemble_whose_members_differ_shows_one_layer_with_the_heads_averaged(checkpoint: Path) -> None:
    two, three = untrained(checkpoint), untrained(checkpoint, decoder_layers=3)
    ensemble = Translator(Ensemble([two.model, three.model]), two.tokenizer, two.decode, "cpu", two.data)
    body = {"text": ["red cat"], "options": {"attention": True, "max_len_b": 4}}
    status, answer = translate(ensemble, body)
    assert status == 200 and answer["translations"][0]["attention"][0]["layers"] == ["chosen layer"]
    body["options"] |= {"attention_layer": "all"}
    status, answer = translate(ensemble, body)
    assert status == 400 and "the ensemble's members show different numbers of layers or heads" in answer["error"]


def test_models_side_by_side_by_name(translator: Translator, checkpoint: Path) -> None:
    rnn = untrained(checkpoint, arch="rnn", rnn=RNNConfig(attention="mlp", hidden_size=16, layers=1))
    body = {"text": ["red cat dog"], "options": {"attention": True}}
    answers = ask(
        {"transformer": translator, "rnn": rnn},
        ("GET", "/info", None),
        ("POST", "/translate", {**body, "model": "rnn"}),
        ("POST", "/translate", body),
        ("POST", "/translate", {**body, "model": "lstm"}),
    )
    (_, _, info), (_, _, from_rnn), (_, _, from_first), (unknown, _, error) = answers
    assert list(json.loads(info)["models"]) == ["transformer", "rnn"]
    assert json.loads(from_rnn)["translations"][0]["attention"][0]["heads"] == ["attention"]
    assert json.loads(from_first)["translations"][0]["text"] == translator.translate(["red cat dog"])[0]
    assert unknown == 400 and json.loads(error)["error"] == "unknown \"model\" 'lstm' (models: transformer, rnn)"


def test_the_page_is_served_whole_with_nothing_from_elsewhere(translator: Translator) -> None:
    answers = ask({"m": translator}, *(("GET", path, None) for path in ("/", "/explorer.js", "/explorer.css")))
    kinds = [headers["content-type"].split(";")[0] for _, headers, _ in answers]
    assert [status for status, _, _ in answers] == [200, 200, 200]
    assert kinds == ["text/html", "text/javascript", "text/css"]
    page, script, style = (raw.decode() for _, _, raw in answers)
    assert '<script src="explorer.js">' in page and 'href="explorer.css"' in page
    for text in (page, script, style):
        assert "http://" not in text.replace('"http://www.w3.org/2000/svg"', "") and "https://" not in text


def test_several_c_without_compare_are_still_one_ensemble(checkpoint: Path, translator: Translator) -> None:
    server = Server(checkpoint, "-c", str(checkpoint))
    try:
        status, info = server.get("/info")
        assert status == 200 and list(info["models"]) == ["default"]
        single = sum(p.numel() for p in translator.model.parameters())
        assert info["model"]["parameters"] == 2 * single  # both members
        request = {"text": ["red cat dog"], "options": {"attention": True}}
        status, body = server.post(request)
        [alone] = translate(translator, request)[1]["translations"]  # two copies of one model: that model's answer
        assert status == 200 and body["translations"][0]["text"] == alone["text"]
        assert body["translations"][0]["attention"][0]["word_alignment"] == alone["attention"][0]["word_alignment"]
    finally:
        assert server.stop() == 143, server.lines  # SIGTERM's code, after the drain


@pytest.mark.parametrize(
    ("checkpoints", "named", "compare", "expected"),
    [
        (["a.pt"], [], False, [("default", ("a.pt",))]),
        (["a.pt", "b.pt"], [], False, [("default", ("a.pt", "b.pt"))]),  # an ensemble, as before
        (
            ["runs/rnn/checkpoint_best.pt", "runs/big/checkpoint_best.pt", "x/rnn/checkpoint_last.pt"],
            [],
            True,
            [
                ("rnn", ("runs/rnn/checkpoint_best.pt",)),
                ("big", ("runs/big/checkpoint_best.pt",)),
                ("rnn-2", ("x/rnn/checkpoint_last.pt",)),
            ],
        ),
        ([], ["rnn=r.pt", "transformer=t.pt"], False, [("rnn", ("r.pt",)), ("transformer", ("t.pt",))]),
    ],
)
def test_served_models(checkpoints: list[str], named: list[str], compare: bool, expected: Any) -> None:
    assert served_models(checkpoints, named, compare) == expected


@pytest.mark.parametrize(
    ("checkpoints", "named", "compare", "message"),
    [
        ([], [], False, "give a model: -c CHECKPOINT"),
        (["a.pt"], [], True, "--compare needs two or more -c"),
        (["a.pt"], ["b=b.pt"], False, "not both"),
        ([], ["b.pt"], False, "--model 'b.pt': give NAME=CHECKPOINT"),
        ([], ["a b=b.pt"], False, "--model 'a b=b.pt': give NAME=CHECKPOINT"),
        ([], ["a=a.pt", "a=b.pt"], False, "--model a is given twice"),
    ],
)
def test_bad_model_lists_are_usage_errors(
    checkpoints: list[str], named: list[str], compare: bool, message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        served_models(checkpoints, named, compare)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--compare", "-c", "a.pt"], "--compare needs two or more -c"),
        (["serve"], "give a model: -c CHECKPOINT (or --model NAME=CHECKPOINT)"),
        (["serve", "--model", "a.pt"], "--model 'a.pt': give NAME=CHECKPOINT"),
    ],
)
def test_the_command_refuses_a_bad_model_list_in_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main([*argv, "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
