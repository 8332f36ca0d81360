"""Marian (OPUS-MT) model directories of Hugging Face `transformers`: import them as checkpoints, export ours as them.

`marian` maps a directory's config and weights to a Transformer checkpoint
and back; `tokenizer` turns its two SentencePiece models and vocab.json into
the SentencePiece models our checkpoints carry (and back); `files` reads and
writes the directory itself. Importing and exporting need no `transformers`:
the directory is JSON, SentencePiece (rewritten with protobuf) and
safetensors (or a `pytorch_model.bin`, read with `weights_only`); `safetensors`
(the `hf` extra) is imported only when a file in that format is read or
written. `toy` builds a random `MarianMTModel` with `transformers` (the tests,
the README's stand-in for a downloaded model).
"""
