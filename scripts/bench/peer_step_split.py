"""Where a decode's time goes, ours against CTranslate2's: the fixed part (encoder, first step, setup) and the
cost of one more decoder step, from the peer suite's batch decoded to two lengths, in one process.

    P=~/.cache/peers-venv/bin/python
    SEQ2SEQ_SRC=$PWD $P scripts/bench/peer_step_split.py --config tiny --beam 1 --steps 8 32 --reps 7

CTranslate2's Python API has no per-operator profile, so the split is read from lengths: each system decodes the
suite's 64 sentences with exactly `short` and `long` decoder steps (seq2seq: short - 1 tokens and EOS, as the
suite's `seq2seq-32steps`; CTranslate2: min = max decoding length), all four in interleaved rounds (the start
rotated per round, a pause between calls as in `decode_interleaved.py`). Per round, a step costs
(t_long - t_short) / (long - short) and the fixed part is t_short - short * step; medians of the rounds are
printed, with each ratio to CTranslate2 per round. Both engines load as `peer_own_openmp.py` loads them (each
with its own OpenMP runtime). `SEQ2SEQ_PEER_QUANTIZE=int8` times our int8 decoding; `--ct2 int8` CTranslate2's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SUITE = Path(__file__).resolve().parents[3] / "shared" / "bench-peers"


@contextlib.contextmanager
def one_translator(ctranslate2: Any) -> Iterator[None]:
    """The suite's `make_ct2` builds a Translator per call; inside this block, calls with the same arguments
    share one, so that both lengths are decoded by one engine, as the suite's own runs have it.

    Two Translators in one process are two worker threads, each with its own OpenMP team: CTranslate2's
    runtime then counts more threads than CPUs and throttles every thread's spinning, and each engine runs
    about half as fast once the other has run (docs/results.md, "The peer table on the AVX512-BF16 EPYC
    with AVX-VNNI").
    """
    made: dict[str, Any] = {}
    plain = ctranslate2.Translator

    def shared(*args: Any, **kwargs: Any) -> Any:
        key = repr((args, sorted(kwargs.items())))
        if key not in made:
            made[key] = plain(*args, **kwargs)
        return made[key]

    ctranslate2.Translator = shared
    try:
        yield
    finally:
        ctranslate2.Translator = plain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", help="the suite's model shape (tiny, iwslt-small)")
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--steps", type=int, nargs=2, default=[8, 32], metavar=("SHORT", "LONG"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ct2", default="float32", help="CTranslate2's compute type")
    ap.add_argument("--suite", type=Path, default=Path(os.environ.get("SEQ2SEQ_PEERS", SUITE)))
    args = ap.parse_args()
    short, long = args.steps
    if not 1 <= short < long:
        ap.error("--steps needs 1 <= SHORT < LONG")

    root = os.environ.setdefault("SEQ2SEQ_SRC", str(Path(__file__).resolve().parents[2]))  # the suite reads it
    sys.path[:0] = [root, str(args.suite)]
    from seq2seq.deploy.exported import import_ctranslate2

    ctranslate2 = import_ctranslate2()  # its own OpenMP runtime, as seq2seq loads it (peer_own_openmp.py)
    import common
    import decode_interleaved as suite

    common.setup_threads()
    src, _, _ = common.load_decode_batch()
    systems: dict[tuple[str, int], Callable[[], object]] = {}
    with one_translator(ctranslate2):
        for steps in (short, long):
            run, expected = suite.make_seq2seq(args.config, args.beam, src, steps - 1)
            assert all(n == expected for n in run()), "seq2seq decoded another length"
            systems["seq2seq", steps] = run
            suite.DECODE_LEN = steps  # make_ct2 reads the suite's length when it builds its call
            run, expected = suite.make_ct2(args.config, args.beam, args.ct2)
            assert all(n == expected for n in run()), "CTranslate2 decoded another length"
            systems["ct2", steps] = run
    names = list(systems)
    times: dict[tuple[str, int], list[float]] = {name: [] for name in names}
    for name in names:
        systems[name]()  # warm-up
    for r in range(args.reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(suite.timed(systems[name]))

    def split(engine: str) -> tuple[list[float], list[float]]:
        a, b = times[engine, short], times[engine, long]
        step = [(y - x) / (long - short) for x, y in zip(a, b)]
        return step, [x - short * s for x, s in zip(a, step)]

    ours, theirs = split("seq2seq"), split("ct2")
    ms = lambda v: f"{statistics.median(v) * 1e3:.1f} ms"  # noqa: E731
    ratio = lambda a, b: statistics.median(y / x for x, y in zip(a, b))  # noqa: E731  their time / ours
    quant = os.environ.get("SEQ2SEQ_PEER_QUANTIZE", "none")
    print(
        f"{args.config}, beam {args.beam}, {short} and {long} steps, {args.reps} rounds, seq2seq {quant}, "
        f"CTranslate2 {args.ct2}"
    )
    for what, i in (("a decoder step", 0), ("fixed part", 1)):
        speed = ratio(ours[i], theirs[i])
        print(f"{what}: seq2seq {ms(ours[i])}, CTranslate2 {ms(theirs[i])}, speed ratio {speed:.3f}")
    for steps in (short, long):
        a, b = times["seq2seq", steps], times["ct2", steps]
        print(f"{steps} steps: seq2seq {ms(a)}, CTranslate2 {ms(b)}, speed ratio {ratio(a, b):.3f}")


if __name__ == "__main__":
    main()
