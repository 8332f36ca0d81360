"""Reading a Marian model directory into a checkpoint (`import_marian`), writing a checkpoint as one (`export_marian`).

A Marian directory: config.json (and optionally generation_config.json),
weights in model.safetensors (or shards listed in model.safetensors.index.json)
or pytorch_model.bin (read with `weights_only`, never unpickling code),
source.spm and target.spm, vocab.json (and target_vocab.json for separate
vocabularies), tokenizer_config.json (languages; optional). Every problem
with one is a `UserError` naming the file: one line, exit 1.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from seq2seq.config import DataConfig, replace_checked, save_config, to_dict
from seq2seq.errors import CheckpointError, UserError
from seq2seq.hf import marian, tokenizer
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.owned import check_replaceable, make_temporary, remove_temporary, replace_directory

log = logging.getLogger("seq2seq")

MARKER = "seq2seq-hf.json"  # written into every export: the directory is ours to replace
OWN_FILES = re.compile(
    r"config\.json|generation_config\.json|model\.safetensors|(source|target)\.spm|(target_)?vocab\.json"
    r"|tokenizer_config\.json|seq2seq\.yaml|" + re.escape(MARKER)
)
MAX_JSON_BYTES = 1 << 26  # vocab.json of a 60k vocabulary is ~1.5 MB


def _json(path: Path, required: bool = True) -> Any:
    if not path.is_file():
        if required:
            raise UserError(
                f"{path}: missing; a Marian model directory has config.json, the weights, "
                "source.spm, target.spm and vocab.json"
            )
        return {}
    if path.stat().st_size > MAX_JSON_BYTES:
        raise UserError(f"{path}: {path.stat().st_size} bytes is too large for this JSON file")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: not a JSON object")
    return value


def _bytes(path: Path) -> bytes:
    if not path.is_file():
        raise UserError(f"{path}: missing; a Marian model directory has source.spm, target.spm and vocab.json")
    return path.read_bytes()


def _vocab(path: Path, size: int, config_key: str) -> list[str]:
    """The pieces of vocab.json by id, checked to number 0 .. size-1 once each."""
    raw = _json(path)
    pieces = [""] * len(raw)
    for piece, index in raw.items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(raw) or pieces[index]:
            raise UserError(
                f"{path}: the ids must number the {len(raw)} pieces 0, 1, ... once each; {piece!r} has {index!r}"
            )
        pieces[index] = piece
    if len(pieces) != size:
        raise UserError(f"{path}: {len(pieces)} pieces, but config.json's {config_key} is {size}")
    if "<unk>" not in raw:
        raise UserError(f"{path}: no <unk> piece")
    return pieces


def read_weights(directory: Path) -> dict[str, Tensor]:
    """The tensors of model.safetensors (or its shards), else pytorch_model.bin (weights only)."""
    single, index, pickled = (
        directory / "model.safetensors",
        directory / "model.safetensors.index.json",
        directory / "pytorch_model.bin",
    )
    if single.is_file():
        return _safetensors(single)
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UserError(f"{index}: no weight_map of tensor names to files")
        state: dict[str, Tensor] = {}
        for name in sorted(set(weight_map.values())):
            if Path(name).name != name:
                raise UserError(f"{index}: {name!r} is not a file of the directory")
            state.update(_safetensors(directory / name))
        return state
    if pickled.is_file():
        try:
            raw = torch.load(pickled, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated zip, a pickle with code in it: the loader's message, one line
            raise UserError(f"{pickled}: not a readable weights file ({str(e).splitlines()[0][:120]})") from None
        if not isinstance(raw, dict) or not all(isinstance(v, Tensor) for v in raw.values()):
            raise UserError(f"{pickled}: not a dictionary of tensors")
        return dict(raw)
    raise UserError(f"{directory}: no weights (model.safetensors or pytorch_model.bin)")


def _safetensors(path: Path) -> dict[str, Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise UserError('safetensors is not installed: pip install -e ".[hf]" (or pip install safetensors)') from None
    if not path.is_file():
        raise UserError(f"{path}: missing")
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # SafetensorsError for a truncated or corrupt file
        raise UserError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None


def _exported_data(directory: Path, data: DataConfig) -> DataConfig:
    """The data settings of the run a directory was exported from (`seq2seq export --format hf` keeps them in its
    marker file, as the CTranslate2 export does in seq2seq.yaml), so that `evaluate -c DIR` reads that run's test
    split; `data` for any other Marian directory, or for one exported before the settings were kept."""
    saved = _json(directory / MARKER, required=False).get("data")
    if not isinstance(saved, dict):
        return data
    return replace_checked(data, saved, str(directory / MARKER), "data.")  # checked as a config file's


def _language(value: Any, default: str) -> str:
    return value if isinstance(value, str) and re.fullmatch(r"[A-Za-z][\w-]{0,31}", value) else default


def import_marian(directory: str | Path) -> ckpt.Checkpoint:
    """A checkpoint (config, tokenizer, weights) of a Marian model directory; one line for anything amiss."""
    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"{d}: not a directory (a Marian model directory, e.g. one of Helsinki-NLP/opus-mt-*)")
    settings = marian.MarianSettings.read(
        _json(d / "config.json"), _json(d / "generation_config.json", required=False), f"{d / 'config.json'}"
    )
    tok_config = _json(d / "tokenizer_config.json", required=False)
    separate = bool(tok_config.get("separate_vocabs", False)) or not settings.shared_embeddings
    src_pieces = _vocab(d / "vocab.json", settings.vocab_size, "vocab_size")
    if separate and (d / "target_vocab.json").is_file():
        tgt_pieces = _vocab(d / "target_vocab.json", settings.decoder_vocab_size, "decoder_vocab_size")
    elif settings.decoder_vocab_size != settings.vocab_size:
        raise UserError(f"{d}: no target_vocab.json for the decoder's {settings.decoder_vocab_size} ids")
    else:
        tgt_pieces = src_pieces
    src_order = tokenizer.our_order(settings.vocab_size, src_pieces.index("<unk>"), settings.start_id, settings.eos_id)
    tgt_unk = tgt_pieces.index("<unk>") if "<unk>" in tgt_pieces else src_pieces.index("<unk>")
    tgt_order = tokenizer.our_order(settings.decoder_vocab_size, tgt_unk, settings.start_id, settings.eos_id)
    src_proto = tokenizer.rewrite_spm(_bytes(d / "source.spm"), src_pieces, src_order, str(d / "source.spm"))
    tgt_proto = tokenizer.rewrite_spm(_bytes(d / "target.spm"), tgt_pieces, tgt_order, str(d / "target.spm"))
    tok = tokenizer.build_tokenizer(src_proto, tgt_proto, str(d))
    codes = [p for p in src_pieces if re.fullmatch(r">>\w+<<", p)]
    if codes:  # MarianTokenizer splits a leading >>xx<< off before SentencePiece; our segmentation does not
        log.warning(
            "%s: its language tokens (%s) are not handled: the source is segmented as plain text",
            d,
            ", ".join(codes[:3]) + (", ..." if len(codes) > 3 else ""),
        )
    config = settings.experiment(
        _language(tok_config.get("source_lang"), "src"), _language(tok_config.get("target_lang"), "tgt"), len(src_order)
    )
    config = dataclasses.replace(config, data=_exported_data(d, config.data))
    weights = marian.import_weights(read_weights(d), settings, src_order, tgt_order, str(d))
    stored = ckpt.Checkpoint(config=config, tokenizer=tok, model=weights, run_id="")
    try:
        ckpt.check_shapes(config, tok, weights)
    except CheckpointError as e:
        raise UserError(f"{d}: the converted weights do not fit the converted config ({e})") from None
    return stored


def is_marian_directory(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face model directory (config.json and source.spm), which `import_marian` reads."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file() and (Path(path) / "source.spm").exists()


def load_marian(directory: str | Path, device: str | torch.device = "cpu") -> ckpt.Loaded:
    """A Marian directory's model, tokenizer and config, as `checkpoint.load_checkpoint` gives a checkpoint's."""
    stored = import_marian(directory)
    return ckpt.Loaded(stored.build_model(device), stored.tokenizer, stored.config, stored)


def import_to_file(directory: str | Path, output: str | Path) -> ckpt.Checkpoint:
    """`seq2seq import-hf`: the checkpoint of a Marian directory written to `output`, its config beside it."""
    output, config = Path(output), Path(output).with_suffix(".yaml")
    if output.exists() and not output.is_file():
        raise UserError(f"--output {output} is not a file")
    if config.exists() and not output.exists():  # a file of someone else's, not an earlier import's
        raise UserError(f"{config} exists; import-hf writes the model's config there: choose another --output")
    stored = import_marian(directory)
    output.parent.mkdir(parents=True, exist_ok=True)
    ckpt.save(output, stored)
    save_config(stored.config, config)
    return stored


def export_marian(checkpoint: str | Path, output: str | Path) -> Path:
    """`seq2seq export --format hf`: a Transformer checkpoint as a Marian model directory; returns it."""
    output = Path(os.path.abspath(output))
    check_replaceable(output, MARKER, OWN_FILES, "--output", UserError)
    stored = ckpt.read(checkpoint)
    ckpt.check_shapes(stored.config, stored.tokenizer, stored.model)
    cfg = stored.config
    marian.exportable(cfg)
    src_proto = stored.tokenizer.src_proto
    tgt_proto = stored.tokenizer.tgt_proto or src_proto
    src_vocab, tgt_vocab = tokenizer.marian_vocab(src_proto), tokenizer.marian_vocab(tgt_proto)
    shared = cfg.model.share_all_embeddings
    if shared and src_vocab != tgt_vocab:
        raise UserError("the source and target SentencePiece models have different pieces; Marian shares one vocab")
    weights = marian.export_weights(stored.model, cfg)
    tmp = make_temporary(output)
    try:
        _write(tmp, stored, weights, src_vocab, tgt_vocab, shared)
        check_replaceable(output, MARKER, OWN_FILES, "--output", UserError)
        replace_directory(output, tmp)
    finally:
        remove_temporary(tmp)
    return output


def _write(
    out: Path,
    stored: ckpt.Checkpoint,
    weights: dict[str, Tensor],
    src_vocab: dict[str, int],
    tgt_vocab: dict[str, int],
    shared: bool,
) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError('safetensors is not installed: pip install -e ".[hf]" (or pip install safetensors)') from None
    cfg, tok = stored.config, stored.tokenizer
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    def dump(name: str, value: Any) -> None:
        (out / name).write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")

    dump("config.json", marian.marian_config(cfg, len(src_vocab) + 1, len(tgt_vocab) + 1))
    dump("generation_config.json", marian.generation_config(cfg))
    dump("vocab.json", src_vocab)
    if not shared:
        dump("target_vocab.json", tgt_vocab)
    (out / "source.spm").write_bytes(tokenizer.marian_spm(tok.src_proto))
    (out / "target.spm").write_bytes(tokenizer.marian_spm(tok.tgt_proto or tok.src_proto))
    dump(
        "tokenizer_config.json",
        {
            "tokenizer_class": "MarianTokenizer",
            "source_lang": cfg.data.src_lang,
            "target_lang": cfg.data.tgt_lang,
            "separate_vocabs": not shared,
            "model_max_length": cfg.model.max_positions,
            "unk_token": "<unk>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
        },
    )
    marker = {"format": "seq2seq-hf-export", "run_id": stored.run_id, "step": stored.step}
    dump(MARKER, {**marker, "data": to_dict(cfg.data)})  # the run's data: `evaluate -c DIR` scores its test split
