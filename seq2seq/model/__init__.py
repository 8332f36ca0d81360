"""The encoder-decoders: the Transformer (read transformer.py top to bottom) and the RNNs (rnn.py); and the
decoder-only translator (decoder_only.py)."""

from seq2seq.model.attention import Kernels, MultiHeadAttention, kernel_scope, training_kernel
from seq2seq.model.build import Seq2SeqModel, build_model, on_meta
from seq2seq.model.cache import DecoderCache, LayerCache
from seq2seq.model.decoder_only import DecoderOnlySession, DecoderOnlyTransformer
from seq2seq.model.layers import DecoderLayer, EncoderLayer, FeedForward
from seq2seq.model.record import AttentionRecord
from seq2seq.model.rnn import RNNCache, RNNSession, Seq2SeqRNN
from seq2seq.model.session import Decodable, DecodingSession
from seq2seq.model.transformer import Seq2SeqTransformer, TransformerSession

__all__ = [
    "AttentionRecord",
    "Decodable",
    "DecoderCache",
    "DecoderOnlySession",
    "DecoderOnlyTransformer",
    "DecoderLayer",
    "DecodingSession",
    "EncoderLayer",
    "FeedForward",
    "Kernels",
    "LayerCache",
    "MultiHeadAttention",
    "RNNCache",
    "RNNSession",
    "Seq2SeqModel",
    "Seq2SeqRNN",
    "Seq2SeqTransformer",
    "TransformerSession",
    "build_model",
    "kernel_scope",
    "on_meta",
    "training_kernel",
]
