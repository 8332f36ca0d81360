"""Opening a translator from paths: checkpoint files (several form an ensemble) or a CTranslate2 export."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from seq2seq.config import MAX_THREADS, ExperimentConfig, apply_overrides
from seq2seq.errors import ConfigError, UsageError

if TYPE_CHECKING:
    from seq2seq.decoding.translate import TextTranslator

log = logging.getLogger("seq2seq")

Engine = Literal["auto", "torch", "ctranslate2"]


@dataclass(frozen=True)
class ModelOptions:
    """Which model, on what, with which decode settings changed.

    paths: checkpoint files (more than one: an ensemble) or one exported directory;
    engine: auto (CTranslate2 for an export, PyTorch for a checkpoint), torch or ctranslate2
    (a checkpoint is then exported, float32, for this run); device: auto, cpu or cuda;
    threads: CPU threads (0: the library's choice); overrides: "decode.key=value" items;
    token_scores: whether each token's log-probability is needed (JSONL output).
    """

    paths: tuple[str, ...]
    engine: Engine = "auto"
    device: str = "auto"
    threads: int = 0
    overrides: tuple[str, ...] = ()
    token_scores: bool = True


def open_translator(options: ModelOptions) -> TextTranslator:
    """The model with its stored decode settings, changed by `options.overrides`."""
    from seq2seq.decoding.ensemble import Ensemble, load_ensemble
    from seq2seq.decoding.translate import Translator
    from seq2seq.device import resolve_device
    from seq2seq.model import Seq2SeqModel
    from seq2seq.runs.checkpoint import load_checkpoint

    _check_overrides(options.overrides)
    if not 0 <= options.threads <= MAX_THREADS:
        raise UsageError(f"--threads must be in [0, {MAX_THREADS}], got {options.threads}")
    if options.threads:
        import torch

        torch.set_num_threads(options.threads)
    if engine_of(options) == "ctranslate2":
        return _exported_translator(options)
    device = resolve_device(options.device, option="--device")
    model: Seq2SeqModel | Ensemble
    if len(options.paths) > 1:
        model, loaded = load_ensemble(list(options.paths), device)  # decode settings and data: the first's
    else:
        from seq2seq.hf.files import is_marian_directory, load_marian  # a Hugging Face Marian directory, read as is

        path = options.paths[0]
        loaded = load_marian(path, device) if is_marian_directory(path) else load_checkpoint(path, device)
        model = loaded.model
    config = with_decode_overrides(loaded.config, options.overrides)
    return Translator(model, loaded.tokenizer, config.decode, device, config.data)


def with_decode_overrides(config: ExperimentConfig, overrides: Sequence[str]) -> ExperimentConfig:
    """`config` with "decode.key=value" items applied, checked like a config file (with the model's limits):
    the one way the decode settings of a model being opened change."""
    _check_overrides(overrides)
    return apply_overrides(config, list(overrides))


def _check_overrides(overrides: Sequence[str]) -> None:
    bad = [o for o in overrides if not o.startswith("decode.")]
    if bad:
        raise ConfigError(f"command line: {bad[0]!r}: only decode.* settings can change at translation time")


def engine_of(options: ModelOptions) -> Literal["torch", "ctranslate2"]:
    """torch or ctranslate2, from the engine asked for and what the paths are; mixtures refused."""
    from seq2seq.deploy.exported import is_exported

    exported = [p for p in options.paths if is_exported(p)]
    if exported and options.engine == "torch":
        raise UsageError(f"{exported[0]} is a CTranslate2 model directory: it runs with --engine ctranslate2 or auto")
    if not exported and options.engine != "ctranslate2":
        return "torch"
    if len(options.paths) > 1:
        raise UsageError("CTranslate2 runs one model; an ensemble needs checkpoint files and --engine torch")
    return "ctranslate2"


def _exported_translator(options: ModelOptions) -> TextTranslator:
    """An exported directory in CTranslate2, or a checkpoint exported (float32) to a temporary one for this run."""
    import tempfile

    import torch

    from seq2seq.deploy.exported import CTranslate2Translator, import_ctranslate2, is_exported

    import_ctranslate2()  # its install hint before anything else
    path, threads = options.paths[0], options.threads or torch.get_num_threads()
    o = options
    if is_exported(path):
        return CTranslate2Translator.from_directory(path, o.device, threads, o.token_scores, o.overrides)
    from seq2seq.deploy.export import export_ctranslate2

    log.info("exporting %s to CTranslate2 (float32) for this run", path)
    with tempfile.TemporaryDirectory(prefix="seq2seq-ct2-") as tmp:  # the engine holds the model in memory
        exported = export_ctranslate2(path, Path(tmp) / "model")
        return CTranslate2Translator.from_directory(exported, o.device, threads, o.token_scores, o.overrides)
