"""The Transformer encoder-decoder: read transformer.py top to bottom."""

from seq2seq.model.attention import DecoderCache, LayerCache, MultiHeadAttention, kernel_scope, training_kernel
from seq2seq.model.layers import DecoderLayer, EncoderLayer, FeedForward
from seq2seq.model.transformer import Seq2SeqTransformer, build_model

__all__ = [
    "DecoderCache",
    "DecoderLayer",
    "EncoderLayer",
    "FeedForward",
    "LayerCache",
    "MultiHeadAttention",
    "Seq2SeqTransformer",
    "build_model",
    "kernel_scope",
    "training_kernel",
]
