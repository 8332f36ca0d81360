"""Greedy, sampling and beam search over the model's incremental API.

Notation: B sentences, K beam size, V vocabulary, N = B * K hypothesis rows.

The loops here call only `encode`, `init_cache`, `decode_step` and the
cache's `reorder`/`select`; the selection rules (`beam_step`, `pick_*`) and the
score adjustments (`length_penalty`, `constrain`) are separate pure functions.

Scores: a hypothesis of n tokens (EOS included) with summed log-probability L
scores L / lp(n), with the GNMT length penalty lp(n) = ((5 + n) / 6) ** alpha
(Wu et al., 2016, eq. 14; alpha = 0 gives the plain sum).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from seq2seq.config import DecodeConfig
from seq2seq.tokenizer import BOS, EOS, PAD, UNK

NEG_INF = float("-inf")


class IncrementalModel(Protocol):
    def encode(self, src: Tensor, src_pad_mask: Tensor) -> Tensor: ...
    def init_cache(self, memory: Tensor, src_pad_mask: Tensor) -> Any: ...
    def decode_step(self, tokens: Tensor, cache: Any) -> Tensor: ...


@dataclass
class Hypothesis:
    tokens: list[int]  # ends with EOS unless cut at the length limit
    score: float  # length-normalised log-probability
    token_scores: list[float] = field(default_factory=list)  # log-probability of each token


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty ((5 + length) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


def max_lengths(src_pad_mask: Tensor, cfg: DecodeConfig, limit: int) -> Tensor:
    """Per-sentence output limit a * source length + b, capped by decode.max_len and `limit`. (B,)"""
    src_len = (~src_pad_mask).sum(dim=1).float()
    lengths = (cfg.max_len_a * src_len + cfg.max_len_b).long()
    return lengths.clamp(min=1, max=min(cfg.max_len, limit))


def constrain(logprobs: Tensor, step: int, limits: Tensor, history: Tensor, cfg: DecodeConfig) -> Tensor:
    """Apply length limits, UNK suppression and n-gram blocking to next-token scores.

    logprobs: (N, V) for the token at position `step` (0-based); limits: (N,)
    maximum lengths; history: (N, step + 1) tokens so far, BOS first.
    """
    logprobs[:, PAD] = NEG_INF
    logprobs[:, BOS] = NEG_INF
    if cfg.suppress_unk:
        logprobs[:, UNK] = NEG_INF
    if step < cfg.min_len:
        logprobs[:, EOS] = NEG_INF
    if cfg.no_repeat_ngram > 0:
        _block_repeated_ngrams(logprobs, history, cfg.no_repeat_ngram)
    at_limit = limits <= step + 1  # this token is the last allowed: it must be EOS
    if at_limit.any():
        eos_scores = logprobs[at_limit, EOS].clone()
        logprobs[at_limit] = NEG_INF
        logprobs[at_limit, EOS] = torch.where(torch.isinf(eos_scores), 0.0, eos_scores)
    return logprobs


def _block_repeated_ngrams(logprobs: Tensor, history: Tensor, n: int) -> None:
    """Forbid any token that would complete an n-gram already in the row's history."""
    if history.shape[1] < n:
        return
    rows = history[:, 1:].tolist()  # without BOS
    for row, tokens in enumerate(rows):
        if len(tokens) < n - 1:
            continue
        prefix = tuple(tokens[len(tokens) - n + 1 :]) if n > 1 else ()
        banned = [
            tokens[i + n - 1]
            for i in range(len(tokens) - n + 1)
            if tuple(tokens[i : i + n - 1]) == prefix
        ]
        if banned:
            logprobs[row, banned] = NEG_INF


# Greedy and sampling: one hypothesis per sentence, one loop, two selection rules.


def pick_greedy(logprobs: Tensor) -> Tensor:
    return logprobs.argmax(dim=-1)  # (N,)


def make_sampler(cfg: DecodeConfig, device: torch.device) -> Callable[[Tensor], Tensor]:
    """Temperature, top-k and nucleus (top-p) sampling with its own seeded generator."""
    generator = torch.Generator(device=device).manual_seed(cfg.seed)

    def pick(logprobs: Tensor) -> Tensor:
        scores = logprobs / cfg.temperature
        if cfg.top_k > 0:
            kth = scores.topk(min(cfg.top_k, scores.shape[-1]), dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, NEG_INF)
        if cfg.top_p < 1.0:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative - sorted_scores.softmax(dim=-1) >= cfg.top_p  # keep the first token past p
            scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, NEG_INF))
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(-1)

    return pick


@torch.no_grad()
def sequential_search(
    model: IncrementalModel,
    src: Tensor,
    src_pad_mask: Tensor,
    cfg: DecodeConfig,
    pick: Callable[[Tensor], Tensor],
    limit: int,
) -> list[list[Hypothesis]]:
    """Decode one hypothesis per sentence, choosing each token with `pick`.

    Finished sentences leave the batch, so later steps only compute live rows.
    """
    B = src.shape[0]
    cache = model.init_cache(model.encode(src, src_pad_mask), src_pad_mask)
    limits = max_lengths(src_pad_mask, cfg, limit)
    alive = torch.arange(B, device=src.device)  # original sentence of each row
    history = torch.full((B, 1), BOS, dtype=torch.long, device=src.device)
    step_scores = torch.zeros(B, 0, device=src.device)
    results: list[list[Hypothesis]] = [[] for _ in range(B)]
    step = 0
    while alive.numel() > 0:
        logits = model.decode_step(history[:, -1:], cache)
        logprobs = constrain(torch.log_softmax(logits.float(), dim=-1), step, limits[alive], history, cfg)
        token = pick(logprobs)  # (N,)
        history = torch.cat([history, token[:, None]], dim=1)
        step_scores = torch.cat([step_scores, logprobs.gather(1, token[:, None])], dim=1)
        done = token == EOS
        for row in done.nonzero().flatten().tolist():
            results[int(alive[row])] = [_hypothesis(history[row, 1:], step_scores[row], cfg.length_penalty)]
        if done.any():
            keep = (~done).nonzero().flatten()
            alive, history, step_scores = alive[keep], history[keep], step_scores[keep]
            cache.select(keep)
        step += 1
    return results


def _hypothesis(tokens: Tensor, scores: Tensor, alpha: float) -> Hypothesis:
    token_scores = scores.tolist()
    return Hypothesis(tokens.tolist(), sum(token_scores) / float(length_penalty(len(token_scores), alpha)), token_scores)


# Beam search.


@dataclass
class BeamStep:
    """The outcome of one beam step for every sentence still searching."""

    next_scores: Tensor  # (B, K) cumulative log-probabilities of the kept live hypotheses
    next_tokens: Tensor  # (B, K)
    next_rows: Tensor  # (B, K) row (in N) each kept hypothesis extends
    eos_rows: Tensor  # (M,) rows whose EOS extension is among the top K ...
    eos_scores: Tensor  # (M,) ... and its cumulative log-probability


def beam_step(scores: Tensor, logprobs: Tensor) -> BeamStep:
    """The selection rule: the K best live extensions, and the EOS ones among the top K.

    scores: (B, K) cumulative log-probabilities (-inf for unused beams);
    logprobs: (B * K, V) next-token log-probabilities.
    """
    B, K = scores.shape
    V = logprobs.shape[-1]
    candidates = (scores[:, :, None] + logprobs.view(B, K, V)).view(B, K * V)
    top_scores, top_index = candidates.topk(min(2 * K, K * V), dim=1)  # (B, 2K): at most K end in EOS
    top_tokens = top_index % V
    top_rows = top_index // V + torch.arange(B, device=scores.device)[:, None] * K
    is_eos = (top_tokens == EOS) | torch.isinf(top_scores)
    # EOS candidates ranked among the top K finish; the first K others live on.
    rank = torch.arange(top_scores.shape[1], device=scores.device).expand_as(top_scores)
    finishing = (top_tokens == EOS) & (rank < K) & ~torch.isinf(top_scores)
    live_order = (is_eos.long() * top_scores.shape[1] + rank).argsort(dim=1)[:, :K]  # stable: live first
    return BeamStep(
        next_scores=top_scores.gather(1, live_order).masked_fill(is_eos.gather(1, live_order), NEG_INF),
        next_tokens=top_tokens.gather(1, live_order),
        next_rows=top_rows.gather(1, live_order),
        eos_rows=top_rows[finishing],
        eos_scores=top_scores[finishing],
    )


@torch.no_grad()
def beam_search(
    model: IncrementalModel, src: Tensor, src_pad_mask: Tensor, cfg: DecodeConfig, limit: int
) -> list[list[Hypothesis]]:
    """Batched beam search; returns up to `cfg.nbest` hypotheses per sentence, best first.

    A sentence stops once it has K finished hypotheses (or reaches its length
    limit); its rows then leave the batch. Finished hypotheses never grow.
    """
    B, K, device = src.shape[0], cfg.beam_size, src.device
    cache = model.init_cache(model.encode(src, src_pad_mask), src_pad_mask)
    cache.select(torch.arange(B, device=device).repeat_interleave(K))  # cross K/V expanded once
    limits = max_lengths(src_pad_mask, cfg, limit).repeat_interleave(K)  # (N,)
    sentence = torch.arange(B, device=device)  # original index of each searching sentence
    scores = torch.full((B, K), NEG_INF, device=device)
    scores[:, 0] = 0.0  # all beams start identical: expand only the first
    history = torch.full((B * K, 1), BOS, dtype=torch.long, device=device)
    step_scores = torch.zeros(B * K, 0, device=device)
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    step = 0
    while sentence.numel() > 0:
        logits = model.decode_step(history[:, -1:], cache)
        logprobs = constrain(torch.log_softmax(logits.float(), dim=-1), step, limits, history, cfg)
        out = beam_step(scores, logprobs)
        _collect_finished(finished, out, sentence, history, step_scores, logprobs, K, cfg.length_penalty)
        rows = out.next_rows.flatten()
        history = torch.cat([history[rows], out.next_tokens.view(-1, 1)], dim=1)
        step_scores = torch.cat(
            [step_scores[rows], logprobs[rows, out.next_tokens.flatten()][:, None]], dim=1
        )
        scores = out.next_scores
        searching = torch.tensor(
            [len(finished[int(s)]) < K for s in sentence.tolist()], device=device
        ) & ~torch.isinf(scores).all(dim=1)
        if searching.all():
            cache.reorder(rows)
        else:
            keep = searching.nonzero().flatten()
            keep_rows = (keep[:, None] * K + torch.arange(K, device=device)).flatten()
            cache.select(rows[keep_rows])
            sentence, scores, limits = sentence[keep], scores[keep], limits[keep_rows]
            history, step_scores = history[keep_rows], step_scores[keep_rows]
        step += 1
    return [sorted(hyps, key=lambda h: -h.score)[: cfg.nbest] for hyps in finished]


def _collect_finished(
    finished: list[list[Hypothesis]],
    out: BeamStep,
    sentence: Tensor,
    history: Tensor,
    step_scores: Tensor,
    logprobs: Tensor,
    K: int,
    alpha: float,
) -> None:
    """Turn this step's EOS extensions into finished hypotheses (at most K per sentence)."""
    for row, total in zip(out.eos_rows.tolist(), out.eos_scores.tolist()):
        hyps = finished[int(sentence[row // K])]
        if len(hyps) >= K:
            continue
        tokens = history[row, 1:].tolist() + [EOS]
        token_scores = step_scores[row].tolist() + [float(logprobs[row, EOS])]
        hyps.append(Hypothesis(tokens, total / float(length_penalty(len(tokens), alpha)), token_scores))


def search(
    model: IncrementalModel, src: Tensor, src_pad_mask: Tensor, cfg: DecodeConfig, limit: int,
    strategy: str | None = None,
) -> list[list[Hypothesis]]:  # fmt: skip
    """Dispatch on `strategy` (default: `cfg.strategy`)."""
    strategy = strategy or cfg.strategy
    if strategy == "beam":
        return beam_search(model, src, src_pad_mask, cfg, limit)
    pick = pick_greedy if strategy == "greedy" else make_sampler(cfg, src.device)
    return sequential_search(model, src, src_pad_mask, cfg, pick, limit)
