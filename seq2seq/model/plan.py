"""How a Transformer decoding session runs its steps: its `StepPlan`, chosen once when the session starts.

Three things describe a session, kept apart:
- the model's weights (the modules' parameters), which a step never changes;
- the plan (`StepPlan`): for each projection, whether a step runs the module
  itself or a copy of its weight prepacked by oneDNN (seq2seq.model.packed);
  every layer's cross-attention W_K, W_V stacked for one matmul over the
  encoder output; and the attention kernel of a step;
- the cache's data (`seq2seq.model.cache.DecoderCache`): keys, values and
  positions, which every step extends.

`DecodingPlan` is the model's side of it (`Seq2SeqTransformer.plan`): it keeps
the packed copies between sessions, while the parameters stay where and as
they were, and hands each new session its `StepPlan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from seq2seq.model.packed import Linear, ParameterKey, can_pack, onednn_available, parameter_key

if TYPE_CHECKING:
    from seq2seq.model.attention import MultiHeadAttention
    from seq2seq.model.transformer import Decoder

CPU_KERNEL = "cpu"  # two batched matmuls (seq2seq.model.attention.decode_attention): faster for a step's few queries
FUSED_KERNEL = "fused"  # PyTorch's scaled_dot_product_attention


@dataclass(frozen=True)
class StepPlan:
    """One decoding session's way of running a step, fixed for the session.

    A step asks it in one way only: `linear(module)` for a projection (and
    `query(attention)` for a cross-attention's W_Q, a slice of its in_proj,
    cut once per session rather than at every step).
    The kernel is the attention of a step that records nothing; while an
    attention record is active (seq2seq.model.record), cross-attention spells
    the attention out instead, to keep the weights.
    """

    linears: Mapping[nn.Module, Linear]  # what runs instead of a module: packed copies; a cross-attention's W_Q
    cross_kv: tuple[Tensor, Tensor]  # every layer's W_K, W_V stacked, (L * 2D, D), and their biases (L * 2D,)
    kernel: str  # CPU_KERNEL or FUSED_KERNEL

    def linear(self, module: nn.Module) -> Linear:
        """How a step runs `module` (an nn.Linear, or a feed-forward network): its packed copy, or itself."""
        return self.linears.get(module, module)

    def query(self, attention: MultiHeadAttention) -> Linear:
        """How a step projects cross-attention queries: W_Q (the first third of in_proj), packed or not."""
        return self.linears[attention]


class DecodingPlan:
    """The plans of a model's decoding sessions; owned by the model (`Seq2SeqTransformer.plan`).

    With `pack`, CPU float32 eval decoding without autograd runs the decoder's
    linears with weights prepacked by oneDNN (seq2seq.model.packed), packed once
    and reused while the parameters stay where and as they were; everything
    else runs the modules themselves. `pack=False` always runs the modules: for
    torch.compile, and to test that both give the same translations.
    """

    def __init__(self, decoder: Decoder, pack: bool = True) -> None:
        self.decoder = decoder
        self.pack = pack and onednn_available()
        self._packed: tuple[ParameterKey, StepPlan] | None = None

    def session(self, memory: Tensor) -> StepPlan:
        """The plan of the session that starts now, over the encoder output `memory` (B, S, D)."""
        kernel = CPU_KERNEL if memory.device.type == "cpu" else FUSED_KERNEL
        if self.pack and can_pack(self.decoder):
            key = parameter_key(self.decoder)
            if self._packed is None or self._packed[0] != key:
                self._packed = None
                try:
                    self._packed = (key, StepPlan(self.decoder.packed_linears(), self.cross_kv(), kernel))
                except RuntimeError:  # oneDNN refused: the modules will do
                    pass
            if self._packed is not None:
                return self._packed[1]
        return StepPlan(self.decoder.plain_queries(), self.cross_kv(), kernel)

    def cross_kv(self) -> tuple[Tensor, Tensor]:
        """Every decoder layer's W_K, W_V stacked, and their biases: one matmul projects the encoder
        output for all layers instead of one per layer."""
        weights, biases = zip(*(attention.memory_weights() for attention in self.decoder.cross_attentions()))
        return torch.cat(weights), torch.cat(biases)

    @property
    def holds_packed(self) -> bool:
        """Whether packed copies of the weights are kept now (the last batch on CPU float32 ran with them)."""
        return self._packed is not None

    def invalidate(self) -> None:
        """Drop the packed copies: the weights may change from now on, and fused optimizers change them
        without bumping their versions."""
        self._packed = None

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_packed": None}  # copies and pickles pack again when they decode
