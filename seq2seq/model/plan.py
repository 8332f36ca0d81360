"""How a Transformer decoding session runs its steps: its `StepPlan`, chosen once when the session starts.

This module is data only: it imports no other part of the model but
seq2seq.model.packed, and the attention modules, the cache and the layers
read it.

Three things describe a session, kept apart:
- the model's weights (the modules' parameters), which a step never changes;
- the plan (`StepPlan`): for each projection, whether a step runs the module
  itself or a copy of its weight prepacked by oneDNN (seq2seq.model.packed);
  every layer's cross-attention W_K, W_V stacked for one matmul over the
  encoder output (`memory`); and the attention kernel of a step;
- the cache's data (`seq2seq.model.cache.DecoderCache`): keys, values and
  positions, which every step extends.

`seq2seq.model.transformer.DecodingPlan` is the model's side of it
(`Seq2SeqTransformer.plan`): it keeps the packed copies between sessions,
while the parameters stay where and as they were, and hands each new session
its `StepPlan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from seq2seq.model.packed import Linear

CPU_KERNEL = "cpu"  # two batched matmuls (seq2seq.model.attention.decode_attention): faster for a step's few queries
FUSED_KERNEL = "fused"  # PyTorch's scaled_dot_product_attention


@dataclass(frozen=True)
class StepPlan:
    """One decoding session's way of running a step, fixed for the session.

    A step asks it in one way only: `linear(module)` for a projection (and
    `query(attention)` for a cross-attention's W_Q, a slice of its in_proj,
    cut once per session rather than at every step).
    The kernel is the attention of a step; a cross-attention whose weights are
    asked for (`need_attention`) spells the attention out instead, to return them.
    """

    linears: Mapping[nn.Module, Linear]  # what runs instead of a module: packed copies; a cross-attention's W_Q
    memory: Linear  # every layer's cross-attention W_K, W_V as one projection: encoder output (n, D) -> (n, L * 2D)
    kernel: str  # CPU_KERNEL or FUSED_KERNEL

    def linear(self, module: nn.Module) -> Linear:
        """How a step runs `module` (an nn.Linear, or a feed-forward network): its packed copy, or itself."""
        return self.linears.get(module, module)

    def query(self, attention: nn.Module) -> Linear:
        """How a step projects a cross-attention module's queries: W_Q (the first third of its in_proj), packed
        or not."""
        return self.linears[attention]
