"""The package's old module paths, still importable: `import seq2seq.search` gives `seq2seq.decoding.search`.

The top-level modules moved into rooms by job (`text`, `decoding`, `deploy`, `runs`); code and notebooks
written against the old paths keep working, with the same module object (so patching it patches the one
the package uses).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

MOVED = {
    "seq2seq.data": "seq2seq.text.corpus",
    "seq2seq.prepare": "seq2seq.text.prepare",
    "seq2seq.tokenizer": "seq2seq.text.tokenizer",
    "seq2seq.vocab": "seq2seq.text.vocab",
    "seq2seq.download": "seq2seq.text.download",
    "seq2seq.inputs": "seq2seq.text.inputs",
    "seq2seq.search": "seq2seq.decoding.search",
    "seq2seq.ensemble": "seq2seq.decoding.ensemble",
    "seq2seq.uncached": "seq2seq.decoding.uncached",
    "seq2seq.alignment": "seq2seq.decoding.alignment",
    "seq2seq.translate": "seq2seq.decoding.translate",
    "seq2seq.pictures": "seq2seq.decoding.pictures",
    "seq2seq.export": "seq2seq.deploy.export",
    "seq2seq.exported": "seq2seq.deploy.exported",
    "seq2seq.checkpoint": "seq2seq.runs.checkpoint",
    "seq2seq.run_dir": "seq2seq.runs.run_dir",
    "seq2seq.owned": "seq2seq.runs.owned",
    "seq2seq.security": "seq2seq.runs.security",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and hands out the module at its new one."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The module ran at its new path already."""


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before any other finder: an old path never finds a stale copy
