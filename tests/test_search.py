"""Search on a scripted fake model (known best hypotheses and scores) and on the trained tiny model.

The fake model offers only `start` and a session with `step`, `reorder`/`select`,
so these tests also check that search needs nothing else.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor

from seq2seq.config import DecodeConfig
from seq2seq.decoding import search as search_module
from seq2seq.decoding.search import (
    NEG_INF,
    argmax_rows,
    beam_search,
    beam_step,
    block_repeated_ngrams,
    constrain,
    length_penalty,
    max_lengths,
    next_logprobs,
    restrict,
    search,
    top_k_rows,
)
from seq2seq.decoding.uncached import uncached_search
from seq2seq.model import AttentionRecord
from seq2seq.text.vocab import BOS, EOS, PAD, UNK

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a second thread only adds waiting

A, B, C, D = 4, 5, 6, 7  # word tokens of the fake vocabulary; 0-3 are PAD, UNK, BOS, EOS
V = 8
Script = Callable[[int, tuple[int, ...]], dict[int, float]]
"""(sentence id, tokens so far without BOS) -> next-token probabilities (missing tokens: 0)."""


class FakeSession:
    """Rows of (sentence id, prefix); checks that `reorder` never moves a row to another sentence."""

    def __init__(self, model: ScriptedModel, sentences: list[int]) -> None:
        self.model = model
        self.sentences = sentences
        self.prefixes: list[tuple[int, ...]] = [() for _ in sentences]
        self.calls: list[tuple[str, int]] = []
        self.attention: AttentionRecord | None = None  # search never records

    def reorder(self, index: Tensor) -> None:
        rows = index.tolist()
        assert [self.sentences[i] for i in rows] == self.sentences, "reorder moved a row across sentences"
        self.prefixes = [self.prefixes[i] for i in rows]
        self.calls.append(("reorder", len(rows)))

    def select(self, index: Tensor) -> None:
        rows = index.tolist()
        self.sentences = [self.sentences[i] for i in rows]
        self.prefixes = [self.prefixes[i] for i in rows]
        self.calls.append(("select", len(rows)))

    def step(self, tokens: Tensor) -> Tensor:
        return self.model.scripted_step(tokens, self)


class ScriptedModel:
    """Fixed next-token distributions per (sentence, prefix); the sentence id is the first source token."""

    def __init__(self, script: Script, vocab: int = V) -> None:
        self.script = script
        self.vocab = vocab
        self.fed: list[tuple[int, tuple[int, ...]]] = []  # every (sentence, prefix) the decoder was run on
        self.caches: list[FakeSession] = []  # every session started
        self.encoded = 0

    def start(self, src: Tensor, src_pad_mask: Tensor, need_attention: bool = False) -> FakeSession:
        self.encoded += 1
        memory = src.float()[:, :, None]  # (B, S, 1): stands in for the encoder output
        self.caches.append(FakeSession(self, memory[:, 0, 0].long().tolist()))
        return self.caches[-1]

    def scripted_step(self, tokens: Tensor, cache: FakeSession) -> Tensor:
        assert tokens.shape == (len(cache.sentences), 1)
        logits = torch.full((len(cache.sentences), self.vocab), NEG_INF)
        for row, (sentence, prefix, token) in enumerate(zip(cache.sentences, cache.prefixes, tokens[:, 0].tolist())):
            prefix = prefix + (token,) if token != BOS else prefix
            cache.prefixes[row] = prefix
            self.fed.append((sentence, prefix))
            for t, p in self.script(sentence, prefix).items():
                logits[row, t] = math.log(p) if p > 0 else NEG_INF
        return logits  # log-probabilities already: log_softmax leaves them unchanged


def sources(*lengths: int, ids: tuple[int, ...] | None = None) -> tuple[Tensor, Tensor]:
    """A padded source batch: sentence i is its id then filler tokens, EOS-terminated, `lengths[i]` tokens long."""
    ids = ids or tuple(range(10, 10 + len(lengths)))  # ids above the special tokens
    rows = [[i] + [A] * (n - 2) + [EOS] for i, n in zip(ids, lengths)]
    src = torch.full((len(rows), max(lengths)), PAD)
    for r, row in enumerate(rows):
        src[r, : len(row)] = torch.tensor(row)
    return src, src == PAD


def cfg(**kw: object) -> DecodeConfig:
    """Generous length limits unless a test sets them."""
    settings = {"max_len_a": 0.0, "max_len_b": 20, "max_len": 20, "length_penalty": 0.0, **kw}
    return DecodeConfig(**settings)  # type: ignore[arg-type]


Ranked = list[list[tuple[tuple[int, ...], float]]]  # per sentence: (tokens, score), best first


def run(script: Script, decode: DecodeConfig, strategy: str, n_sentences: int = 1) -> Ranked:
    src, mask = sources(*[3] * n_sentences)
    hyps = search(ScriptedModel(script), src, mask, replace(decode, strategy=strategy), 100)
    return [[(tuple(h.tokens), h.score) for h in sentence] for sentence in hyps]


def logp(*probs: float) -> float:
    return sum(math.log(p) for p in probs)


# Greedy is not the best sequence: A (.5) leads to A C EOS (.2), but B EOS has .36.
GREEDY_TRAP = {
    (): {A: 0.5, B: 0.4, C: 0.1},
    (A,): {C: 0.4, D: 0.35, EOS: 0.25},
    (B,): {EOS: 0.9, C: 0.1},
}
# Short A EOS (.33) beats long B C D EOS (.3) on the sum, but not with alpha = 1.
LENGTH_FLIP = {
    (): {A: 0.55, B: 0.45},
    (A,): {EOS: 0.6, C: 0.4},
    (A, C): {D: 0.6, EOS: 0.4},
    (B,): {C: 1.0},
    (B, C): {D: 1.0},
    (B, C, D): {EOS: 2 / 3, A: 1 / 3},
}


def scripted(table: dict[tuple[int, ...], dict[int, float]]) -> Script:
    return lambda sentence, prefix: table.get(prefix, {EOS: 1.0})


def test_beam_finds_the_best_sequence_greedy_misses() -> None:
    (greedy,) = run(scripted(GREEDY_TRAP), cfg(), "greedy")
    assert greedy == [((A, C, EOS), pytest.approx(logp(0.5, 0.4)))]
    (beam,) = run(scripted(GREEDY_TRAP), cfg(beam_size=2, nbest=2), "beam")
    assert beam == [((B, EOS), pytest.approx(logp(0.4, 0.9))), ((A, C, EOS), pytest.approx(logp(0.5, 0.4)))]


def test_length_penalty_flips_the_order() -> None:
    short, long = (A, EOS), (B, C, D, EOS)
    (plain,) = run(scripted(LENGTH_FLIP), cfg(beam_size=2, nbest=2, length_penalty=0.0), "beam")
    assert plain == [(short, pytest.approx(logp(0.55, 0.6))), (long, pytest.approx(logp(0.45, 1, 1, 2 / 3)))]
    (gnmt,) = run(scripted(LENGTH_FLIP), cfg(beam_size=2, nbest=2, length_penalty=1.0), "beam")
    assert gnmt == [
        (long, pytest.approx(logp(0.45, 1, 1, 2 / 3) / ((5 + 4) / 6))),
        (short, pytest.approx(logp(0.55, 0.6) / ((5 + 2) / 6))),
    ]


def test_beam_size_one_is_greedy() -> None:
    for table in (GREEDY_TRAP, LENGTH_FLIP):
        for alpha in (0.0, 1.0):
            decode = cfg(beam_size=1, length_penalty=alpha)
            assert run(scripted(table), decode, "beam") == run(scripted(table), decode, "greedy")


def random_script(seed: int, words: int = 2, eos: float = 0.3) -> Script:
    """Distributions drawn from the prefix, so any prefix gets a fixed, arbitrary one."""

    def script(sentence: int, prefix: tuple[int, ...]) -> dict[int, float]:
        g = torch.Generator().manual_seed(hash((seed, sentence, prefix)) % 2**31)
        p = torch.rand(words, generator=g) + 0.05
        p = (1 - eos) * p / p.sum()
        return {EOS: eos, **{A + i: float(p[i]) for i in range(words)}}

    return script


def brute_force(script: Script, words: int, max_len: int, alpha: float) -> list[tuple[tuple[int, ...], float]]:
    """Every hypothesis of the first sentence (id 10) with at most max_len tokens before EOS, best first (min_len 0)."""
    found = []
    for n in range(max_len + 1):
        for prefix in itertools.product(range(A, A + words), repeat=n):
            tokens = (*prefix, EOS)
            total = sum(math.log(script(10, tokens[:t])[tokens[t]]) for t in range(len(tokens)))
            found.append((tokens, total / ((5 + len(tokens)) / 6) ** alpha))
    return sorted(found, key=lambda h: -h[1])


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_a_wide_beam_is_exhaustive(alpha: float) -> None:
    """With K at least the number of complete hypotheses, beam search returns all of them, in order."""
    script = random_script(1)
    expected = brute_force(script, words=2, max_len=3, alpha=alpha)  # 1 + 2 + 4 + 8 = 15 hypotheses
    decode = cfg(beam_size=16, nbest=16, min_len=0, max_len=3, length_penalty=alpha)
    (got,) = run(script, decode, "beam")
    assert [h for h, _ in got] == [h for h, _ in expected]
    assert [s for _, s in got] == pytest.approx([s for _, s in expected])


def test_nbest_lists_are_sorted_distinct_and_scored_consistently() -> None:
    script = random_script(2, words=4, eos=0.15)
    decode = cfg(beam_size=5, nbest=5, length_penalty=1.0, max_len=8)
    src, mask = sources(3, 4, 5)
    for sentence in search(ScriptedModel(script), src, mask, decode, 100):
        assert len(sentence) == 5
        assert len({tuple(h.tokens) for h in sentence}) == 5
        assert [h.score for h in sentence] == sorted((h.score for h in sentence), reverse=True)
        for h in sentence:
            assert h.tokens[-1] == EOS and EOS not in h.tokens[:-1]
            assert h.score == pytest.approx(sum(h.token_scores) / length_penalty(len(h.tokens), 1.0))


def test_finished_hypotheses_never_grow() -> None:
    """No prefix the decoder ever sees contains EOS: a finished hypothesis is never extended."""
    model = ScriptedModel(random_script(3, words=3, eos=0.4))
    src, mask = sources(3, 5, 4, 6)
    for strategy in ("beam", "greedy", "sample"):
        search(model, src, mask, cfg(beam_size=4, nbest=4, max_len=6, strategy=strategy), 100)
    assert model.fed and all(EOS not in prefix for _, prefix in model.fed)


def test_search_uses_the_cache_as_designed() -> None:
    """Encode and project once; expand to the beam once; shrink only when sentences stop."""
    model = ScriptedModel(random_script(4, words=3, eos=0.3))
    src, mask = sources(3, 5, 4)
    beam_search(model, src, mask, cfg(beam_size=3, max_len=5), 100)
    assert model.encoded == 1 and len(model.caches) == 1
    calls = model.caches[0].calls
    assert calls[0] == ("select", 9)  # expanded to K rows per sentence
    sizes = [n for kind, n in calls if kind == "select"]
    assert sizes == sorted(sizes, reverse=True) and all(n % 3 == 0 for n in sizes)
    assert sum(kind == "reorder" for kind, _ in calls) > 0


def test_tiny_vocabulary_with_everything_forbidden_still_finishes() -> None:
    """V = 5: UNK suppressed, A blocked after its first use, EOS blocked by min_len: EOS is the way out."""
    script: Script = lambda sentence, prefix: {A: 0.7, EOS: 0.2, UNK: 0.1}  # noqa: E731
    decode = cfg(beam_size=3, nbest=3, min_len=2, no_repeat_ngram=1, suppress_unk=True)
    src, mask = sources(3)
    for strategy in ("beam", "greedy", "sample"):
        (hyps,) = search(ScriptedModel(script, vocab=5), src, mask, replace(decode, strategy=strategy), 100)
        assert [(h.tokens, h.token_scores) for h in hyps] == [([A, EOS], pytest.approx([math.log(0.7), math.log(0.2)]))]


def test_length_limits_per_sentence_and_absolute_cap() -> None:
    """max_len_i = a * source length + b, capped by decode.max_len; the forced EOS keeps its model score."""
    script: Script = lambda sentence, prefix: {A: 0.5, B: 0.45, EOS: 0.05}  # noqa: E731
    src, mask = sources(2, 6, 4)  # limits: 1 * 2 + 1 = 3, 6 + 1 = 7 -> capped at 5, 4 + 1 = 5
    decode = cfg(max_len_a=1.0, max_len_b=1, max_len=5, beam_size=2, nbest=2)
    assert max_lengths(mask, decode, 100).tolist() == [3, 5, 5]
    assert max_lengths(mask, decode, 4).tolist() == [3, 4, 4]  # the model's positions cap it too
    for strategy in ("greedy", "beam"):
        hyps = search(ScriptedModel(script), src, mask, replace(decode, strategy=strategy), 100)
        assert [len(h[0].tokens) for h in hyps] == [4, 6, 6]
        assert all(h[0].token_scores[-1] == pytest.approx(math.log(0.05)) for h in hyps)
    # A model that never ends: sampling stops at the limits too, the forced EOS counted as a cut (0).
    never_ends: Script = lambda sentence, prefix: {A: 0.5, B: 0.5}  # noqa: E731
    hyps = search(ScriptedModel(never_ends), src, mask, replace(decode, strategy="sample"), 100)
    assert [(len(h[0].tokens), h[0].token_scores[-1]) for h in hyps] == [(4, 0.0), (6, 0.0), (6, 0.0)]


def test_min_len_blocks_early_eos() -> None:
    script: Script = lambda sentence, prefix: {A: 0.2, B: 0.1, EOS: 0.7}  # noqa: E731
    for strategy in ("greedy", "beam"):
        ((best, *_),) = run(script, cfg(min_len=3, beam_size=2), strategy)
        assert best[0] == (A, A, A, EOS)


def test_results_do_not_depend_on_the_batch() -> None:
    script = random_script(5, words=3, eos=0.25)
    src, mask = sources(3, 6, 4, 5, 3)
    for strategy in ("beam", "greedy", "sample"):
        decode = cfg(beam_size=3, nbest=3, max_len=7, temperature=1.5, strategy=strategy)
        together = search(ScriptedModel(script), src, mask, decode, 100)
        for i in range(5):
            n = int((~mask[i]).sum())
            alone = search(ScriptedModel(script), src[i : i + 1, :n], mask[i : i + 1, :n], decode, 100)
            assert alone == [together[i]]
        reordered = search(ScriptedModel(script), src.flip(0), mask.flip(0), decode, 100)
        assert reordered == together[::-1]


def test_sampling_is_seeded_and_respects_top_k_and_top_p() -> None:
    script = random_script(6, words=4, eos=0.2)
    decode = cfg(max_len=10)
    samples = {tuple(run(script, replace(decode, seed=seed), "sample")[0][0][0]) for seed in range(20)}
    assert len(samples) > 5  # sampling really samples
    assert run(script, replace(decode, seed=3), "sample") == run(script, replace(decode, seed=3), "sample")
    greedy = run(script, decode, "greedy")
    assert run(script, replace(decode, top_k=1), "sample") == greedy
    assert run(script, replace(decode, top_p=0.01), "sample") == greedy
    assert run(script, replace(decode, temperature=1e-4), "sample") == greedy


# The pure pieces.


def test_restrict_keeps_top_k_then_nucleus() -> None:
    scores = torch.tensor([[0.1, 0.4, 0.3, 0.2]]).log()
    assert torch.isfinite(restrict(scores, 2, 1.0)).tolist() == [[False, True, True, False]]
    assert torch.isfinite(restrict(scores, 0, 0.6)).tolist() == [[False, True, True, False]]
    assert torch.isfinite(restrict(scores, 0, 0.4)).tolist() == [[False, True, False, False]]
    assert torch.isfinite(restrict(scores, 0, 1.0)).all()


def test_beam_step_separates_finished_from_live() -> None:
    # One sentence, K = 2, V = 6 (words A, B); beam 1 is empty at the first step.
    scores = torch.tensor([[0.0, NEG_INF]])
    logprobs = torch.full((2, 6), NEG_INF)
    logprobs[0, [EOS, A, B]] = torch.tensor([0.5, 0.3, 0.2]).log()
    logprobs[1] = torch.tensor([0.2] * 6).log()
    out = beam_step(scores, logprobs)
    assert out.eos_rows.tolist() == [0] and out.eos_scores.tolist() == pytest.approx([math.log(0.5)])
    assert out.next_tokens.tolist() == [[A, B]] and out.next_rows.tolist() == [[0, 0]]
    assert out.next_scores[0].tolist() == pytest.approx([math.log(0.3), math.log(0.2)])
    # Only one live candidate: the other slot stays empty (-inf, PAD), never an EOS that could grow.
    logprobs[0, B] = NEG_INF
    out = beam_step(scores, logprobs)
    assert out.next_tokens.tolist() == [[A, PAD]] and out.next_scores[0, 1] == NEG_INF


@pytest.mark.parametrize("V", [1000, 8000, 8003, 32000])
@pytest.mark.parametrize("k", [1, 2, 10])
def test_top_k_rows_equals_a_full_top_k(V: int, k: int) -> None:
    generator = torch.Generator().manual_seed(V + k)
    x = torch.randn(37, V, generator=generator)
    x[0] = NEG_INF  # a row with nothing allowed
    x[1, :] = NEG_INF
    x[1, [5, V - 1]] = torch.tensor([-1.0, 0.0])  # fewer finite entries than k, one after the last whole block
    x[2, -3:] = torch.tensor([10.0, 10.1, 10.2])  # the best entries all in those columns
    spread = x[3, ::257]
    x[3, ::257] = 5.0 + torch.arange(spread.numel()) / 100  # the best entries spread over many blocks
    values, indices = top_k_rows(x, k)
    expected_values, expected_indices = x.topk(k, dim=1)
    assert torch.equal(values, expected_values)
    assert torch.equal(x.gather(1, indices), values)  # the indices point at the values (ties may pick others)
    finite = torch.isfinite(expected_values)
    assert torch.equal(indices[finite], expected_indices[finite])  # no ties among these finite values


@pytest.mark.parametrize("V", [1000, 8000, 8003])
@pytest.mark.parametrize("rows", [1, 3])
def test_top_k_rows_of_groups_with_offsets_equals_a_top_k_of_their_sums(V: int, rows: int) -> None:
    """A beam step's selection: the 2K best of each sentence's rows plus their scores (-inf for an empty slot),
    equal to a top-k over the formed (B, rows * V) table."""
    generator = torch.Generator().manual_seed(V * rows)
    x = torch.randn(6 * rows, V, generator=generator).log_softmax(dim=1)
    offset = -torch.rand(6 * rows, generator=generator) * 5
    offset[1] = NEG_INF  # an empty slot
    x[2, -3:] = torch.tensor([3.0, 3.1, 3.2])  # the best entries of a row in the columns after the last whole block
    x[rows, :] = NEG_INF  # a row with nothing allowed
    k = min(10, rows * V)
    values, indices = top_k_rows(x, k, offset, rows)
    table = (x + offset[:, None]).view(6, rows * V)
    expected_values, expected_indices = table.topk(k, dim=1)
    assert torch.equal(values, expected_values)
    assert torch.equal(table.gather(1, indices), values)
    finite = torch.isfinite(expected_values)
    assert torch.equal(indices[finite], expected_indices[finite])


@pytest.mark.parametrize("V", [100, 1000, 8000, 8003])
def test_argmax_rows_is_argmax_ties_included(V: int) -> None:
    """The first index of a row's maximum, as torch.argmax: ties in one block, across blocks, with the
    columns after the last whole block, rows with nothing allowed."""
    generator = torch.Generator().manual_seed(V)
    x = torch.randn(41, V, generator=generator)
    x[0] = NEG_INF
    x[1, [7, V // 2, V - 1]] = 9.0  # a tie across blocks (and the last column)
    x[2, [300 % V, 301 % V]] = 9.0  # a tie inside one block
    x[3, -2:] = 9.0  # the best in the columns after the last whole block
    x[4, [V // 3, V - 1]] = 9.0  # a tie between a block and those columns: the block's comes first
    x[5] = 1.0  # one value everywhere
    x[6:10] = torch.randint(-2, 3, (4, V), generator=generator).float()  # many ties
    assert torch.equal(argmax_rows(x), x.argmax(dim=1))
    assert torch.equal(argmax_rows(x[:, : V - 1]), x[:, : V - 1].argmax(dim=1))  # a strided view


def test_next_logprobs_normalises_the_logits_in_place() -> None:
    logits = torch.randn(6, V) * 3
    expected = constrain(torch.log_softmax(logits, dim=-1), 0, torch.full((6,), 5), torch.full((6, 1), BOS), cfg())
    out = next_logprobs(logits, 0, torch.full((6,), 5), torch.full((6, 1), BOS), cfg(), None)
    assert out.data_ptr() == logits.data_ptr()  # fp32 logits become the log-probabilities: no second table
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_constrain_forces_eos_at_the_limit_and_blocks_it_before_min_len() -> None:
    decode = cfg(min_len=2, suppress_unk=True)
    logprobs = torch.log_softmax(torch.randn(3, V), dim=-1)
    model_eos = logprobs[:, EOS].clone()
    history = torch.full((3, 2), BOS)
    out = constrain(logprobs.clone(), 1, torch.tensor([5, 1, 0]), history, decode)
    assert (out[:, [PAD, BOS, UNK]] == NEG_INF).all()
    assert out[0, EOS] == NEG_INF and torch.isfinite(out[0, A:]).all()  # step 1 < min_len
    for row in (1, 2):  # at or past the limit: EOS only, with the model's score (min_len gives way)
        assert torch.isfinite(out[row]).tolist() == [t == EOS for t in range(V)]
        assert out[row, EOS] == model_eos[row]


def test_block_repeated_ngrams_matches_a_direct_count() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(A, V, (50, 9), generator=g)
    for n in (1, 2, 3):
        logprobs = torch.zeros(50, V)
        block_repeated_ngrams(logprobs, tokens, n)
        for row, seq in enumerate(tokens.tolist()):
            prefix = tuple(seq[len(seq) - n + 1 :]) if n > 1 else ()
            banned = {seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i : i + n - 1]) == prefix}
            assert {t for t in range(V) if logprobs[row, t] == NEG_INF} == banned


def test_no_repeat_ngram_in_search() -> None:
    script: Script = lambda sentence, prefix: {A: 0.6, B: 0.3, EOS: 0.1}  # noqa: E731
    ((best, *_),) = run(script, cfg(no_repeat_ngram=2, max_len=6, min_len=6), "greedy")
    assert best[0] == (A, A, B, A, EOS)  # then A A and A B are both used: EOS is all that is left
    ((best, *_),) = run(script, cfg(no_repeat_ngram=2, max_len=6, min_len=6, beam_size=3), "beam")
    tokens = best[0][:-1]
    bigrams = list(zip(tokens, tokens[1:]))
    assert len(bigrams) == len(set(bigrams))


# The trained tiny model: the cache and beam size 1 against their references.


def on(
    device: torch.device, model: torch.nn.Module, src: Tensor, mask: Tensor
) -> tuple[torch.nn.Module, Tensor, Tensor]:
    """The shared tiny model and its batch on `device` (a copy there: the fixture's model stays on the CPU)."""
    if device.type == "cpu":
        return model, src, mask
    return copy.deepcopy(model).to(device), src.to(device), mask.to(device)


@pytest.fixture(scope="module")
def tiny(trained_run: Path) -> tuple[torch.nn.Module, Tensor, Tensor]:
    from conftest import reversal_pairs

    from seq2seq.runs.checkpoint import load_checkpoint
    from seq2seq.text.corpus import pad

    loaded = load_checkpoint(trained_run / "checkpoint_best.pt")
    lines, _ = reversal_pairs(12, seed=42)
    src = pad([ids + [EOS] for ids in loaded.tokenizer.encode_src(lines)])
    return loaded.model, src, src == PAD


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_cached_decoding_equals_uncached(
    tiny: tuple[torch.nn.Module, Tensor, Tensor], strategy: str, device: torch.device
) -> None:
    model, src, mask = on(device, *tiny)
    decode = DecodeConfig(strategy=strategy, beam_size=4, nbest=4)  # type: ignore[arg-type]
    cached = search(model, src, mask, decode, 100)
    uncached = uncached_search(model, src, mask, decode, 100)
    assert [[h.tokens for h in s] for s in cached] == [[h.tokens for h in s] for s in uncached]
    for c, u in zip(itertools.chain(*cached), itertools.chain(*uncached)):
        assert c.token_scores == pytest.approx(u.token_scores, abs=1e-4)


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_packing_off_translates_the_same(tiny: tuple[torch.nn.Module, Tensor, Tensor], strategy: str) -> None:
    """CPU float32 decoding runs oneDNN-packed decoder linears; with packing forced off, the modules: the same
    translations, the same log-probs within float rounding."""
    from seq2seq.model.packed import onednn_available
    from seq2seq.model.transformer import DecodingPlan, Seq2SeqTransformer

    model, src, mask = tiny
    assert isinstance(model, Seq2SeqTransformer)
    plain_model = copy.deepcopy(model)
    plain_model.plan = DecodingPlan(plain_model.decoder, pack=False)
    decode = DecodeConfig(strategy=strategy, beam_size=4, nbest=4)  # type: ignore[arg-type]
    packed = search(model, src, mask, decode, 100)
    assert model.plan.holds_packed == onednn_available()
    plain = search(plain_model, src, mask, decode, 100)
    assert not plain_model.plan.holds_packed
    assert [[h.tokens for h in s] for s in packed] == [[h.tokens for h in s] for s in plain]
    for p, q in zip(itertools.chain(*packed), itertools.chain(*plain)):
        assert p.token_scores == pytest.approx(q.token_scores, abs=1e-5)


def test_beam_size_one_is_greedy_on_the_tiny_model(
    tiny: tuple[torch.nn.Module, Tensor, Tensor], device: torch.device
) -> None:
    model, src, mask = on(device, *tiny)
    decode = DecodeConfig(beam_size=1)
    beam = search(model, src, mask, replace(decode, strategy="beam"), 100)
    greedy = search(model, src, mask, replace(decode, strategy="greedy"), 100)
    assert [s[0].tokens for s in beam] == [s[0].tokens for s in greedy]
    assert [s[0].score for s in beam] == pytest.approx([s[0].score for s in greedy], abs=1e-4)


# Every architecture (untrained, so with arbitrary distributions): the search-level proofs.

ARCHITECTURES = [
    "relative",
    "rope",
    "none",
    "t5_bias",
    "rnn-lstm-none-unidirectional",
    "rnn-gru-none-context-unidirectional",
    "rnn-gru-general",
    "rnn-lstm-mlp-untied",
    "decoder_only-prefix",
    "decoder_only-causal-learned",
    "decoder_only-prefix-t5_bias",
]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_beam_one_is_greedy_and_the_batch_does_not_matter_for_every_architecture(
    name: str, device: torch.device
) -> None:
    from test_model import on, source_batch, tiny_model, variant

    model = tiny_model(**variant(name)).to(device)
    src, mask = on(device, *source_batch())
    decode = cfg(beam_size=1, max_len=8, length_penalty=1.0)
    beam = search(model, src, mask, replace(decode, strategy="beam"), 31)
    greedy = search(model, src, mask, replace(decode, strategy="greedy"), 31)
    assert [s[0].tokens for s in beam] == [s[0].tokens for s in greedy]
    assert [s[0].score for s in beam] == pytest.approx([s[0].score for s in greedy], abs=1e-4)
    for strategy in ("beam", "greedy", "sample"):
        wide = replace(decode, strategy=strategy, beam_size=3, nbest=3)
        together = search(model, src, mask, wide, 31)
        for i, n in enumerate([7, 5, 3]):
            (alone,) = search(model, src[i : i + 1, :n], mask[i : i + 1, :n], wide, 31)
            assert [h.tokens for h in alone] == [h.tokens for h in together[i]]
            assert [h.score for h in alone] == pytest.approx([h.score for h in together[i]], abs=1e-4)


# The stopping rule: a sentence stops only when no live hypothesis can still beat its K-th best finished one.

# A EOS and B EOS finish first (two of a beam of two), but A C C C EOS, which the beam still holds, scores
# better under alpha = 1: log .16 / (10 / 6) = -1.10 against log .24 / (7 / 6) = -1.22. Stopping once K
# hypotheses have finished (fairseq's and CTranslate2's rule) returns A EOS.
LATE_BEST = {
    (): {A: 0.4, B: 0.35, EOS: 0.25},
    (A,): {EOS: 0.6, C: 0.4},
    (B,): {EOS: 0.55, D: 0.45},
    (A, C): {C: 1.0},
    (B, D): {EOS: 1.0},
    (A, C, C): {C: 1.0},
    (A, C, C, C): {EOS: 1.0},
}


def test_beam_search_finds_a_better_hypothesis_after_k_have_finished() -> None:
    (best, second) = run(scripted(LATE_BEST), cfg(beam_size=2, nbest=2, length_penalty=1.0), "beam")[0]
    assert best == ((A, C, C, C, EOS), pytest.approx(logp(0.4, 0.4) / (10 / 6)))
    assert second == ((A, EOS), pytest.approx(logp(0.4, 0.6) / (7 / 6)))
    early = run(scripted(LATE_BEST), cfg(beam_size=2, nbest=2, length_penalty=1.0, beam_stop="first_k"), "beam")
    assert [tokens for tokens, _ in early[0]] == [(A, EOS), (B, EOS)]  # stopped once two had finished


def never_stopping(scores: Tensor, kth: Tensor, step: int, max_len: Tensor, alpha: float, exact: bool) -> Tensor:
    """The reference rule: a sentence searches on while it has a live hypothesis (EOS is forced at max_len)."""
    return torch.isfinite(scores).any(dim=1)


@pytest.mark.parametrize("alpha", [-0.5, 0.0, 0.6, 1.0, 2.0])
@pytest.mark.parametrize("beam", [2, 3])
def test_stopping_early_never_loses_what_the_beam_would_find_by_max_len(
    alpha: float, beam: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random distributions, four sentences a batch: the K best hypotheses are those of the same beam run
    until every live hypothesis reached max_len."""
    decode = cfg(beam_size=beam, nbest=beam, length_penalty=alpha, max_len=7, max_len_b=7)
    for seed in range(12):
        script = random_script(seed, words=3, eos=0.15)
        exact = run(script, decode, "beam", n_sentences=4)
        with monkeypatch.context() as patch:
            patch.setattr(search_module, "still_searching", never_stopping)
            full = run(script, decode, "beam", n_sentences=4)
        for got, want in zip(exact, full, strict=True):
            assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-5)


def test_the_stopping_rule_holds_on_a_trained_model(
    tiny: tuple[torch.nn.Module, Tensor, Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, src, mask = tiny
    for alpha in (0.0, 1.0, 2.0):
        decode = DecodeConfig(strategy="beam", beam_size=4, nbest=4, length_penalty=alpha, max_len=40)
        exact = search(model, src, mask, decode, 100)
        with monkeypatch.context() as patch:
            patch.setattr(search_module, "still_searching", never_stopping)
            full = search(model, src, mask, decode, 100)
        for got, want in zip(exact, full, strict=True):
            assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-4)


def test_a_sentence_that_can_end_at_once_keeps_its_own_hypotheses_in_a_batch() -> None:
    """min_len 0: EOS can finish a hypothesis at the first step, when each sentence has one row, not K."""
    decode = cfg(beam_size=3, nbest=3, min_len=0, length_penalty=1.0)
    script = random_script(7, words=2, eos=0.4)
    together = run(script, decode, "beam", n_sentences=3)
    for i, sentence in enumerate(together):
        src, mask = sources(3, ids=(10 + i,))
        (alone,) = search(ScriptedModel(script), src, mask, replace(decode, strategy="beam"), 100)
        assert [tuple(h.tokens) for h in alone] == [tokens for tokens, _ in sentence]
