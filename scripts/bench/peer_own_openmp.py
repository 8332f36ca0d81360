"""Run a peer-suite script (../shared/bench-peers) in a process that loads CTranslate2 as seq2seq does.

    P=~/.cache/peers-venv/bin/python
    SEQ2SEQ_SRC=$PWD $P scripts/bench/peer_own_openmp.py ../shared/bench-peers/decode_interleaved.py \\
        --config tiny --beam 5 --systems seq2seq,ct2-float32,ct2-int8

The suite imports `ctranslate2` plainly after torch, so CTranslate2's OpenMP calls bind to torch's libgomp
and the two engines share (and throttle) one runtime; seq2seq imports it with its own
(`seq2seq.deploy.exported.import_ctranslate2`). This imports it that way first, then runs the script
unchanged: the same systems, batches and timing, each engine with the OpenMP runtime it ships with.
"""

from __future__ import annotations

import os
import runpy
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.environ.get("SEQ2SEQ_SRC", os.getcwd()))
    from seq2seq.deploy.exported import import_ctranslate2

    import_ctranslate2()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
