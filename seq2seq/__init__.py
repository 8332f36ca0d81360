"""seq2seq: a readable Transformer encoder-decoder toolkit for machine translation."""

from seq2seq import _moved

__version__ = "0.1.0"

_moved.install()  # the old module paths (seq2seq.search, seq2seq.data, ...) import the moved modules
