"""The peer suite's interleaved decoding, with the page faults of every timed call counted.

    P=~/.cache/peers-venv/bin/python
    SEQ2SEQ_SRC=$PWD $P scripts/bench/peer_faults.py ../shared/bench-peers/decode_interleaved.py \\
        --config tiny --beam 1 --systems seq2seq,ct2-float32 --reps 9

Loads CTranslate2 with its own OpenMP runtime first (as `peer_own_openmp.py` does), then runs the suite's
script unchanged except for its `timed`, which this wraps to read the process's minor page faults
(`getrusage`) before and after each call. Prints, on stderr, each system's faults per call (sorted) beside
its sentences/s per round, then the suite's own JSON line. A fault is the first touch of a 4 KB page that
malloc took from the system: it shows which engine keeps its memory between batches.
"""

from __future__ import annotations

import os
import resource
import runpy
import sys
import time
from collections.abc import Callable
from typing import Any


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    sys.path.insert(0, os.environ.get("SEQ2SEQ_SRC", os.getcwd()))
    from seq2seq.deploy.exported import import_ctranslate2

    import_ctranslate2()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    suite = runpy.run_path(script, run_name="peer_suite")  # defines its functions, runs nothing
    faults: dict[int, list[int]] = {}
    timed = suite["timed"]

    def counted(fn: Callable[[], Any]) -> float:
        before = minor_faults()
        seconds = timed(fn)
        faults.setdefault(id(fn), []).append(minor_faults() - before)
        return seconds

    suite["main"].__globals__["timed"] = counted
    made: dict[int, str] = {}
    make = suite["make"]

    def named(name: str, *args: Any) -> Any:
        fn, expect = make(name, *args)
        made[id(fn)] = name
        return fn, expect

    suite["main"].__globals__["make"] = named
    started = time.perf_counter()
    suite["main"]()
    for key, counts in faults.items():
        print(f"{made.get(key, '?')}: page faults per timed call {sorted(counts)}", file=sys.stderr)
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
