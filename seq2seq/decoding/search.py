"""Greedy, sampling and beam search over a model's decoding session.

Notation: B sentences, K beam size, V vocabulary, N hypothesis rows (B, or B * K).

The loops call only the model's `start` and the session's `step`, `reorder` and
`select` (`Decodable` and `DecodingSession`, seq2seq.model.session: the
protocols every model, the ensemble and their sessions implement). The selection rules (`beam_step`, `pick_greedy`,
`make_sampler`) and the score adjustments (`length_penalty`, `constrain`) are
separate pure functions.

Lengths. A hypothesis is its tokens followed by EOS; n counts the EOS. Sentence
i may have at most max_len_i = floor(a * s_i + b) tokens before its EOS, with
s_i its non-padding source tokens (EOS included), a = decode.max_len_a,
b = decode.max_len_b, capped by decode.max_len and the model's positions, and
raised to decode.min_len. EOS is forbidden before min_len tokens and forced
after max_len_i; a forced EOS scores the model's own log-probability. A row
left with no allowed token (n-gram blocking, tiny vocabularies) also ends.

Scores. A hypothesis with summed token log-probability L scores L / lp(n), with
the GNMT length penalty lp(n) = ((5 + n) / 6) ** alpha (Wu et al., 2016, eq. 14,
without the coverage penalty; alpha = decode.length_penalty; alpha = 0 ranks by
the plain sum). Token log-probabilities are the model's (log-softmax of its
logits, before any masking or temperature). The penalty ranks finished
hypotheses; live ones, all of one length at a step, compete on L.

Stopping rule (beam search). Each step takes the 2K best extensions of a
sentence's K live hypotheses by summed log-probability. EOS extensions ranked
among the top K finish (they leave the beam and never grow); the K best other
extensions live on. With decode.beam_stop: exact (the default) a sentence stops
only when no live hypothesis can still beat its K-th best finished one under
the length penalty (`still_searching` says how that is bounded), or when all
its live hypotheses are forced to end at max_len_i; with first_k it stops as
soon as K hypotheses have finished, as fairseq does.

Prefixes. A sentence may come with a target prefix (B, P) of tokens, PAD after
its end: its first tokens are forced to the prefix, in every strategy, and
search continues freely after it. A forced token is scored like any other (its
model log-probability counts in L and in token_scores), and the length limit
max_len_i is raised to the prefix's length when it is shorter (so the output
may be the prefix and EOS). Beam search carries one live hypothesis through
the prefix and widens after it.

Batch invariance. Every operation is per sentence (per row, or per group of K
rows), and a sampled sentence draws from its own random stream, seeded by
decode.seed and its source tokens, so a translation does not depend on which
sentences share its batch (up to floating-point rounding in the model's matmuls).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from seq2seq import interrupt
from seq2seq.config import DecodeConfig
from seq2seq.model.session import Decodable, DecodingSession
from seq2seq.text.vocab import BOS, EOS, PAD, UNK

NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    tokens: list[int]  # always ends with EOS
    score: float  # sum(token_scores) / length_penalty(len(tokens), alpha)
    token_scores: list[float] = field(default_factory=list)  # model log-probability of each token


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT length penalty ((5 + length) / 6) ** alpha."""
    return ((5 + length) / 6) ** alpha


def max_lengths(src_pad_mask: Tensor, cfg: DecodeConfig, limit: int, prefix: Tensor | None = None) -> Tensor:
    """Tokens allowed before EOS per sentence: a * source length + b, within [min_len, min(max_len, limit)],
    and at least the prefix's length (B, P) when there is one (still within limit). (B,)"""
    src_len = (~src_pad_mask).sum(dim=1).float()
    lengths = (cfg.max_len_a * src_len + cfg.max_len_b).floor().long()
    lengths = lengths.clamp(min=cfg.min_len).clamp(max=min(cfg.max_len, limit))
    if prefix is None:
        return lengths
    return torch.maximum(lengths, (prefix != PAD).sum(dim=1)).clamp(max=limit)


def constrain(logprobs: Tensor, step: int, max_len: Tensor, history: Tensor, cfg: DecodeConfig) -> Tensor:
    """Forbid PAD/BOS (and UNK, repeated n-grams, an early EOS); force EOS at the length limit. In place.

    logprobs: (N, V) for the token at 0-based position `step`; max_len: (N,) tokens allowed before EOS;
    history: (N, step + 1) tokens so far, BOS first. A row left with no allowed token (tiny vocabularies,
    n-gram blocking) ends with EOS, so every hypothesis can always finish.
    """
    model_eos = logprobs[:, EOS].clone()  # (N,)
    logprobs[:, PAD] = NEG_INF
    logprobs[:, BOS] = NEG_INF
    if cfg.suppress_unk:
        logprobs[:, UNK] = NEG_INF
    if step < cfg.min_len:
        logprobs[:, EOS] = NEG_INF
    if cfg.no_repeat_ngram > 0:
        block_repeated_ngrams(logprobs, history[:, 1:], cfg.no_repeat_ngram)
    forced = (max_len <= step) | (logprobs.amax(dim=-1) == NEG_INF)  # (N,)
    if forced.any():
        logprobs[forced] = NEG_INF
        # A model that rules EOS out entirely (possible only with -inf logits) gets a cut, scored 0.
        logprobs[forced, EOS] = scored_zero_if_ruled_out(model_eos[forced])
    return logprobs


def scored_zero_if_ruled_out(logprobs: Tensor) -> Tensor:
    """`logprobs` with a -inf one (a token the model rules out entirely) replaced by log-probability 0."""
    return logprobs.nan_to_num(neginf=0.0)


def next_logprobs(
    logits: Tensor, step: int, max_len: Tensor, history: Tensor, cfg: DecodeConfig, forced: Tensor | None
) -> Tensor:
    """The model's log-probabilities (N, V) for position `step`, constrained (see `constrain`).

    fp32 logits are normalised in place (one fused pass a row, no second (N, V) table), so the caller
    gives up `logits`. `forced` (N,) holds a prefix token for the rows that must take one (PAD for the
    others): such a row keeps only that token, at the model's log-probability.
    """
    logprobs = logits.float()
    torch.log_softmax(logprobs, dim=-1, out=logprobs)
    if forced is None:
        return constrain(logprobs, step, max_len, history, cfg)
    # (N,) before constrain masks them; a model that rules the token out entirely (only -inf logits
    # can) gets it scored 0, as constrain does for a forced EOS, so that the prefix always appears.
    model_scores = scored_zero_if_ruled_out(logprobs.gather(1, forced[:, None])[:, 0])
    logprobs = constrain(logprobs, step, max_len, history, cfg)
    rows = (forced != PAD).nonzero().flatten()
    logprobs[rows] = NEG_INF
    logprobs[rows, forced[rows]] = model_scores[rows]
    return logprobs


def top_k_rows(
    x: Tensor, k: int, offset: Tensor | None = None, rows: int = 1, block: int = 128
) -> tuple[Tensor, Tensor]:
    """The k best of each group of `rows` consecutive rows of x (N, V), each row plus its `offset` (N,): the
    values and indices of `(x + offset[:, None]).view(N // rows, rows * V).topk(k, dim=1)`, best first (the
    same values, the same indices but among ties), without forming that sum.

    On the CPU, with V much larger than k, it looks at the k blocks of `block` columns of a group with the
    largest maxima (plus their row's offset), and at the columns after the last whole block, instead of
    whole rows: a group's k best entries lie there, since each block holding one has a maximum at least as
    large (adding an offset keeps the order), and fewer than k other blocks can have a larger one. A beam
    step's (B, K * V) candidates cost about a third of a row-wise top-k over (B * K, V) this way.
    """
    N, V = x.shape
    B, n_blocks = N // rows, V // block
    if x.device.type != "cpu" or n_blocks < 4 * k or x.stride(1) != 1:
        full = x if offset is None else x + offset[:, None]
        return full.reshape(B, rows * V).topk(k, dim=1)
    blocks = x.as_strided((N, n_blocks, block), (x.stride(0), block, 1))  # (N, n_blocks, block), a view
    maxima = blocks.amax(dim=2)  # (N, n_blocks)
    if offset is not None:
        maxima += offset[:, None]
    chosen = maxima.view(B, rows * n_blocks).topk(k, dim=1).indices  # (B, k): a row of the group and a block
    first_row = torch.arange(B, device=x.device)[:, None] * rows
    row, within = chosen // n_blocks + first_row, chosen % n_blocks  # (B, k) each: a row and its block
    candidates = blocks[row, within]  # (B, k, block)
    if offset is not None:
        candidates = candidates + offset[row][:, :, None]
    candidates = candidates.view(B, k * block)
    tail = n_blocks * block  # the columns after the last whole block are always candidates
    if tail < V:
        rest = x[:, tail:] if offset is None else x[:, tail:] + offset[:, None]
        candidates = torch.cat([candidates, rest.reshape(B, rows * (V - tail))], dim=1)
    values, where = candidates.topk(k, dim=1)  # (B, k)
    which = where.div(block, rounding_mode="floor")  # (B, k): which chosen block, or >= k for the tail
    in_block = which.clamp(max=k - 1)
    from_blocks = (row.gather(1, in_block) - first_row) * V + within.gather(1, in_block) * block + where % block
    if tail == V:
        return values, from_blocks
    after = (where - k * block).clamp(min=0)  # position among the group's tail columns, row by row
    from_tail = after.div(V - tail, rounding_mode="floor") * V + tail + after % (V - tail)
    return values, torch.where(which < k, from_blocks, from_tail)


def argmax_rows(x: Tensor, block: int = 128) -> Tensor:
    """`x.argmax(dim=1)` for (N, V) rows: the first index of each row's maximum.

    On the CPU it looks inside one block of `block` columns per row, the first whose maximum is the row's
    (found by one `amax` over all blocks), and at the columns after the last whole block: PyTorch's argmax
    over a whole row of 8,000 columns costs about three times that.
    """
    N, V = x.shape
    n_blocks = V // block
    if x.device.type != "cpu" or n_blocks < 4 or x.stride(1) != 1:
        return x.argmax(dim=1)
    blocks = x.as_strided((N, n_blocks, block), (x.stride(0), block, 1))  # (N, n_blocks, block), a view
    maxima = blocks.amax(dim=2)  # (N, n_blocks)
    first = maxima.argmax(dim=1)  # (N,) the first block holding the row's largest value
    rows = torch.arange(N, device=x.device)
    best = first * block + blocks[rows, first].argmax(dim=1)
    tail = n_blocks * block
    if tail == V:
        return best
    rest = x[:, tail:]  # after every block: its maximum wins only when strictly larger
    rest_best = rest.argmax(dim=1)
    larger = rest[rows, rest_best] > maxima[rows, first]
    return torch.where(larger, rest_best + tail, best)


def forced_tokens(prefix: Tensor | None, step: int, sentence: Tensor) -> Tensor | None:
    """The prefix token each row must take at `step` (PAD: none), or None when no row has one.

    prefix: (B, P) PAD after each prefix's end; sentence: (N,) the batch index of each row.
    """
    if prefix is None or step >= prefix.shape[1]:
        return None
    return prefix[sentence, step]


def block_repeated_ngrams(logprobs: Tensor, tokens: Tensor, n: int) -> None:
    """Forbid any token that would complete an n-gram already in the row's tokens (N, t). In place."""
    N, t = tokens.shape
    if t < n:
        return
    grams = tokens.unfold(1, n, 1)  # (N, t - n + 1, n)
    if n > 1:
        match = (grams[:, :, :-1] == tokens[:, None, t - n + 1 :]).all(dim=-1)  # (N, t - n + 1)
    else:
        match = torch.ones(grams.shape[:2], dtype=torch.bool, device=tokens.device)
    hits = torch.zeros_like(logprobs).scatter_add_(1, grams[:, :, -1], match.to(logprobs.dtype))  # (N, V)
    logprobs.masked_fill_(hits > 0, NEG_INF)


# Greedy and sampling: one hypothesis per sentence, one loop, two selection rules.

Picker = Callable[[Tensor, Tensor, int], Tensor]
"""(logprobs (N, V), sentence index of each row (N,), step) -> chosen tokens (N,)."""


def pick_greedy(logprobs: Tensor, sentence: Tensor, step: int) -> Tensor:
    return argmax_rows(logprobs)  # (N,)


def restrict(scores: Tensor, top_k: int, top_p: float) -> Tensor:
    """Keep the top-k tokens, then the smallest set whose probability reaches top_p (nucleus). (N, V)"""
    if top_k > 0:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]  # (N, 1)
        scores = scores.masked_fill(scores < kth, NEG_INF)
    if top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches p
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, NEG_INF))
    return scores


def make_sampler(cfg: DecodeConfig, src: Tensor, src_pad_mask: Tensor, steps: int) -> Picker:
    """Temperature, top-k and top-p sampling by inverse CDF, with one seeded stream per sentence."""
    uniforms = sentence_uniforms(src, src_pad_mask, cfg.seed, steps)  # (B, steps)

    def pick(logprobs: Tensor, sentence: Tensor, step: int) -> Tensor:
        probs = restrict(logprobs / cfg.temperature, cfg.top_k, cfg.top_p).softmax(dim=-1)
        cdf = probs.double().cumsum(dim=-1)  # (N, V); float64 so that u * total stays below total
        u = uniforms[sentence, step, None] * cdf[:, -1:]  # (N, 1)
        # right=True skips tokens of probability 0, whose CDF equals their predecessor's.
        return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)

    return pick


def sentence_uniforms(src: Tensor, src_pad_mask: Tensor, seed: int, steps: int) -> Tensor:
    """Uniform [0, 1) numbers (B, steps) from a generator seeded by `seed` and each sentence's tokens."""
    rows = []
    for ids, pad in zip(src.tolist(), src_pad_mask.tolist()):
        key = repr((seed, [i for i, p in zip(ids, pad) if not p])).encode()
        seed_of_row = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        generator = torch.Generator().manual_seed(seed_of_row)
        rows.append(torch.rand(steps, generator=generator, dtype=torch.float64))
    return torch.stack(rows).to(src.device)


@torch.inference_mode()
def sequential_search(
    model: Decodable,
    src: Tensor,
    src_pad_mask: Tensor,
    cfg: DecodeConfig,
    pick: Picker,
    limit: int,
    prefix: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Decode one hypothesis per sentence, choosing each token with `pick` (after the forced prefix, if any).

    Finished sentences leave the batch, so later steps compute only live rows.
    """
    B = src.shape[0]
    session = model.start(src, src_pad_mask)
    max_len = max_lengths(src_pad_mask, cfg, limit, prefix)  # (B,)
    alive = torch.arange(B, device=src.device)  # batch index of each row
    history = torch.full((B, 1), BOS, dtype=torch.long, device=src.device)  # (N, step + 1)
    step_scores = torch.zeros(B, 0, device=src.device)  # (N, step)
    results: list[list[Hypothesis]] = [[] for _ in range(B)]
    for step in itertools.count():  # ends: EOS is forced once step reaches max_len
        interrupt.check_cancelled()  # a server stopping: its decoding thread stops here
        logits = session.step(history[:, -1:])  # (N, V)
        forced = forced_tokens(prefix, step, alive)
        logprobs = next_logprobs(logits, step, max_len[alive], history, cfg, forced)
        token = pick(logprobs, alive, step)  # (N,)
        history = torch.cat([history, token[:, None]], dim=1)
        step_scores = torch.cat([step_scores, logprobs.gather(1, token[:, None])], dim=1)
        done = token == EOS
        if not done.any():
            continue
        ended = done.nonzero().flatten()
        rows = zip(alive[ended].tolist(), history[ended, 1:].tolist(), step_scores[ended].tolist())
        for b, tokens, token_scores in rows:
            results[b] = [make_hypothesis(tokens, token_scores, cfg.length_penalty)]
        if done.all():
            return results
        keep = (~done).nonzero().flatten()
        alive, history, step_scores = alive[keep], history[keep], step_scores[keep]
        session.select(keep)
    raise AssertionError("unreachable")


def make_hypothesis(tokens: list[int], token_scores: list[float], alpha: float) -> Hypothesis:
    return Hypothesis(tokens, sum(token_scores) / float(length_penalty(len(tokens), alpha)), token_scores)


# Beam search.


@dataclass
class BeamStep:
    """The outcome of one beam step for every sentence still searching."""

    next_scores: Tensor  # (B, K) summed log-probabilities of the kept live hypotheses; -inf for empty slots
    next_tokens: Tensor  # (B, K) their last token; PAD in empty slots
    next_rows: Tensor  # (B, K) the row (in N) each one extends
    finishing: Tensor  # (B, 2K) which of each sentence's best candidates, best first, are EOS ranked among the top K
    eos_rows: Tensor  # (M,) the rows those EOS extensions extend, sentence by sentence, best first ...
    eos_scores: Tensor  # (M,) ... and their summed log-probabilities


def beam_step(scores: Tensor, logprobs: Tensor, beam_size: int = 0) -> BeamStep:
    """The selection rule: the K best live extensions, and the EOS ones among the top K.

    scores: (B, R) summed log-probabilities of each sentence's R rows (-inf for
    empty slots); logprobs: (B * R, V) next-token log-probabilities (-inf where
    forbidden); beam_size K (0: R). R is K, or 1 at the first
    step, when every hypothesis is BOS alone. Among the 2K best candidates at
    most K are EOS ranked in the top K, so K live ones remain whenever K finite
    non-EOS candidates exist; otherwise slots stay empty.

    A sentence's candidates are its R rows' log-probabilities plus their
    scores; its 2K best are found blockwise, without forming the (B, R * V)
    table (`top_k_rows`).
    """
    B, R = scores.shape
    K = beam_size or R
    V = logprobs.shape[-1]
    top_scores, top_index = top_k_rows(logprobs, min(2 * K, R * V), scores.flatten(), R)  # (B, 2K), best first
    top_tokens = top_index % V
    top_rows = top_index // V + torch.arange(B, device=scores.device)[:, None] * R
    finite = torch.isfinite(top_scores)
    is_eos = top_tokens == EOS
    rank = torch.arange(top_scores.shape[1], device=scores.device)
    finishing = is_eos & finite & (rank < K)
    live = ~is_eos & finite
    order = (~live).to(torch.uint8).argsort(dim=1, stable=True)[:, :K]  # live candidates first, best first
    kept = live.gather(1, order)
    next_scores = top_scores.gather(1, order).masked_fill(~kept, NEG_INF)
    next_tokens = top_tokens.gather(1, order).masked_fill(~kept, PAD)
    next_rows = top_rows.gather(1, order)
    if order.shape[1] < K:  # fewer than K candidates in all (a tiny vocabulary at the first step): empty slots
        missing = K - order.shape[1]
        next_scores = torch.cat([next_scores, next_scores.new_full((B, missing), NEG_INF)], dim=1)
        next_tokens = torch.cat([next_tokens, next_tokens.new_full((B, missing), PAD)], dim=1)
        next_rows = torch.cat([next_rows, next_rows[:, :1].expand(B, missing)], dim=1)
    return BeamStep(next_scores, next_tokens, next_rows, finishing, top_rows[finishing], top_scores[finishing])


class Finished:
    """Finished hypotheses, kept as tensors step by step and turned into `Hypothesis` objects once, at the end.

    Every EOS extension a step ranks among its top K is kept, in the order they finish (best first within
    a step); `kth` is each sentence's K-th best length-normalised score so far, which the stopping rule
    (`still_searching`) compares the live hypotheses against.
    """

    def __init__(self, n_sentences: int, beam_size: int, alpha: float, device: torch.device) -> None:
        self.K, self.alpha = beam_size, alpha
        self.best = torch.full((n_sentences, beam_size), NEG_INF, device=device)  # (B, K) best scores, best first
        self.found: list[tuple[Tensor, Tensor, Tensor]] = []  # (sentence (M,), tokens (M, n), scores (M, n))

    @property
    def kth(self) -> Tensor:
        """(B,) each searching sentence's K-th best normalised score; -inf until K have finished."""
        return self.best[:, -1]

    def collect(
        self, out: BeamStep, sentence: Tensor, history: Tensor, step_scores: Tensor, eos_logprobs: Tensor
    ) -> None:
        """Keep this step's EOS extensions.

        sentence: (B,) batch index of each searching sentence; history (N, step + 1)
        and step_scores (N, step): each row's tokens (BOS first) and their log-probabilities;
        eos_logprobs (N,): each row's log-probability of EOS now.
        """
        rows = out.eos_rows  # (M,)
        if rows.numel() == 0:
            return
        normalised = torch.full(out.finishing.shape, NEG_INF, device=self.best.device)  # (B, 2K)
        normalised[out.finishing] = out.eos_scores / length_penalty(history.shape[1], self.alpha)  # EOS included
        self.best = torch.cat([self.best, normalised], dim=1).topk(self.K, dim=1).values
        eos = torch.full((rows.shape[0], 1), EOS, dtype=history.dtype, device=history.device)
        tokens = torch.cat([history[rows, 1:], eos], dim=1)
        scores = torch.cat([step_scores[rows], eos_logprobs[rows, None]], dim=1)
        rows_per_sentence = history.shape[0] // out.finishing.shape[0]  # 1 at the first step, K after
        self.found.append((sentence[torch.div(rows, rows_per_sentence, rounding_mode="floor")], tokens, scores))

    def drop(self, keep: Tensor) -> None:
        """Follow the searching sentences when some stop: keep (B',) their indices."""
        self.best = self.best[keep]

    def hypotheses(self, n_sentences: int, alpha: float) -> list[list[Hypothesis]]:
        """Each sentence's finished hypotheses, in the order they finished. Scores are recomputed from the
        token log-probabilities (in float64, as for greedy search), so beam size 1 and greedy agree exactly."""
        results: list[list[Hypothesis]] = [[] for _ in range(n_sentences)]
        for sentence, tokens, scores in self.found:
            for b, t, sc in zip(sentence.tolist(), tokens.tolist(), scores.tolist()):
                results[b].append(make_hypothesis(t, sc, alpha))
        return results


@torch.inference_mode()
def beam_search(
    model: Decodable,
    src: Tensor,
    src_pad_mask: Tensor,
    cfg: DecodeConfig,
    limit: int,
    prefix: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search; up to `cfg.nbest` distinct hypotheses per sentence, best first.

    Rows of a sentence are contiguous (sentence b owns rows b*K .. b*K+K-1). The
    first step runs one row per sentence (all K hypotheses are BOS then); its K
    best extensions expand the cache to K rows per sentence, which are then
    reordered within sentences at each step and shrunk only when a sentence stops.
    """
    B, K, device = src.shape[0], cfg.beam_size, src.device
    session = model.start(src, src_pad_mask)
    max_len = max_lengths(src_pad_mask, cfg, limit, prefix)  # (N,)
    sentence = torch.arange(B, device=device)  # batch index of each searching sentence
    scores = torch.zeros(B, 1, device=device)  # (B, rows per sentence)
    history = torch.full((B, 1), BOS, dtype=torch.long, device=device)  # (N, step + 1)
    step_scores = torch.zeros(B, 0, device=device)  # (N, step)
    finished = Finished(B, K, cfg.length_penalty, device)
    exact = cfg.beam_stop == "exact"
    for step in itertools.count():  # ends: EOS is forced once step reaches max_len
        interrupt.check_cancelled()
        logits = session.step(history[:, -1:])  # (N, V)
        forced = forced_tokens(prefix, step, sentence.repeat_interleave(scores.shape[1]))
        logprobs = next_logprobs(logits, step, max_len, history, cfg, forced)
        out = beam_step(scores, logprobs, K)
        finished.collect(out, sentence, history, step_scores, logprobs[:, EOS])
        rows, tokens = out.next_rows.flatten(), out.next_tokens.flatten()  # (B * K,)
        history = torch.cat([history[rows], tokens[:, None]], dim=1)
        step_scores = torch.cat([step_scores[rows], logprobs[rows, tokens][:, None]], dim=1)
        expanding = scores.shape[1] != K
        scores, max_len = out.next_scores, max_len[rows]
        searching = still_searching(scores, finished.kth, step, max_len.view(scores.shape), cfg.length_penalty, exact)
        if not searching.any():
            break
        stopped = follow_hypotheses(session, rows, searching, expanding, K)
        if stopped is None:
            continue
        keep, keep_rows = stopped
        sentence, scores, max_len = sentence[keep], scores[keep], max_len[keep_rows]
        history, step_scores = history[keep_rows], step_scores[keep_rows]
        finished.drop(keep)
    hypotheses = finished.hypotheses(B, cfg.length_penalty)
    return [sorted(hyps, key=lambda h: -h.score)[: cfg.nbest] for hyps in hypotheses]


def still_searching(scores: Tensor, kth: Tensor, step: int, max_len: Tensor, alpha: float, exact: bool) -> Tensor:
    """(B,) whether a sentence's live hypotheses can still finish above its K-th best finished one
    (`exact`, `decode.beam_stop: exact`), or whether fewer than K have finished (`first_k`).

    The stopping rule, exact under any length penalty: a live hypothesis's summed log-probability
    `scores` (B, K) can only fall (each token adds log p <= 0), so its final score is at most that sum
    divided by the largest length penalty among the lengths it can still end with: from step + 2 tokens
    with EOS (it ends at the next step) to max_len (B, K) + 1 (EOS forced), the longest for alpha > 0,
    the shortest for alpha < 0. A sentence stops when no live hypothesis's bound beats its K-th best
    finished score: the search never returns a worse list than the same beam running to max_len would.

    A beam of one is greedy search by definition, as in CTranslate2: it stops at its first EOS.
    (fairseq and CTranslate2 stop a sentence once K hypotheses have finished, and Hugging Face's
    `early_stopping=False` bounds the live ones at their current length, not the longest: with a
    length penalty that grows with length, each can stop before a better hypothesis its beam would
    still find; tests/test_search.py has such a case.)
    """
    live = torch.isfinite(scores).any(dim=1)
    if scores.shape[1] == 1 or not exact:
        return live & ~torch.isfinite(kth)
    shortest = float(length_penalty(step + 2, alpha))
    longest = length_penalty(max_len.float() + 1, alpha)
    assert isinstance(longest, Tensor)
    bound = (scores / torch.clamp(longest, min=shortest)).max(dim=1).values  # scores <= 0: divide by the largest
    return live & (bound > kth)


def follow_hypotheses(
    session: DecodingSession, rows: Tensor, searching: Tensor, expanding: bool, K: int
) -> tuple[Tensor, Tensor] | None:
    """Move the session's rows to the step's kept hypotheses, rows (B * K,) of the last step's rows, leaving
    out the sentences that stopped (searching (B,) False). Returns None when none stopped, else the
    searching sentences' indices (B',) and their rows (B' * K,)."""
    if searching.all():
        if expanding:
            session.select(rows)  # each sentence's row becomes its K hypotheses
        else:
            session.reorder(rows)
        return None
    keep = searching.nonzero().flatten()
    keep_rows = (keep[:, None] * K + torch.arange(K, device=rows.device)).flatten()
    session.select(rows[keep_rows])  # rows of a kept sentence share its cross K/V, so this is exact
    return keep, keep_rows


def search(
    model: Decodable,
    src: Tensor,
    src_pad_mask: Tensor,
    cfg: DecodeConfig,
    limit: int,
    prefix: Tensor | None = None,
) -> list[list[Hypothesis]]:
    """Hypotheses for each sentence of src (B, S) with `cfg.strategy`, best first.

    `limit` caps the tokens before EOS (the model's positions minus one); `prefix`
    (B, P), PAD after each prefix's end, forces the first tokens of each sentence.
    """
    if cfg.strategy == "beam":
        return beam_search(model, src, src_pad_mask, cfg, limit, prefix)
    if cfg.strategy == "greedy":
        return sequential_search(model, src, src_pad_mask, cfg, pick_greedy, limit, prefix)
    if cfg.strategy == "sample":
        longest = max(min(cfg.max_len, limit), prefix.shape[1] if prefix is not None else 0)
        pick = make_sampler(cfg, src, src_pad_mask, longest + 1)
        return sequential_search(model, src, src_pad_mask, cfg, pick, limit, prefix)
    raise ValueError(f"unknown decoding strategy {cfg.strategy!r}: use beam, greedy or sample")
