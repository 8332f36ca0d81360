"""seq2seq: a readable Transformer encoder-decoder toolkit for machine translation."""

__version__ = "0.1.0"
