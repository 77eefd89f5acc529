"""Run by test_cpu_threads in a subprocess: 4 Python threads calling the CPU kernels at once.

Prints ``unavailable`` when Numba cannot load the threading layer named in
``NUMBA_THREADING_LAYER``, else the layer used and ``exact`` when every result matched.
"""

from __future__ import annotations

import sys
import threading

import ml_dtypes
import numba
import numpy as np

import ngram_cupy as nc
from ngram_cupy.codecs.dequant import BFLOAT16, FLOAT8_E4M3, reference_lookup
from ngram_cupy.hashing import reference
from ngram_cupy.ids.ids_numba import ngram_ids_numba
from ngram_cupy.tables.gather_numba import gather_rows

THREADS, ROUNDS = 4, 3


def main() -> int:
    try:
        numba.get_num_threads()
    except ValueError:  # "No threading layer could be loaded"
        print("unavailable")
        return 0
    print(numba.threading_layer(), run_threads())
    return 0


def run_threads() -> str:
    """``exact`` when 4 threads calling ids and gathers at once all got the right results."""
    config = nc.NGramConfig(vocab_size=1000, ngram_size=3, heads_per_ngram=2,
                            ngram_vocab_size_base=5000, eos_token_id=0)
    layout = nc.layer_layout(config, 0)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 1000, 8_000)
    starts = np.array([0, 3_000, 8_000])
    context = rng.integers(0, 1000, (2, 2))
    ids = reference.compute_ngram_ids(layout, tokens, starts, context)
    table = rng.integers(0, 256, (3000, 16), dtype=np.uint8)
    table[(table & 0x7F) == 0x7F] = 0x42  # no NaN codes: the kernels canonicalise NaN payloads
    rows = rng.integers(-5, 3005, (4096, 4))
    rows_expected = reference_lookup(table.view(ml_dtypes.float8_e4m3fn), rows, np.float32(0.5),
                                     ml_dtypes.bfloat16).view(np.uint16)
    failures: list[str] = []
    barrier = threading.Barrier(THREADS)

    def work(index: int) -> None:
        out = np.empty_like(ids)
        gathered = np.empty_like(rows_expected)
        barrier.wait()
        for _ in range(ROUNDS):
            ngram_ids_numba(layout, tokens, starts, context, out, parallel=True)
            gather_rows(table, FLOAT8_E4M3, 0, np.float32(0.5), rows, gathered, BFLOAT16,
                        parallel=True)
            if not np.array_equal(out, ids) or not np.array_equal(gathered, rows_expected):
                failures.append(f"thread {index}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return "exact" if not failures else f"wrong: {failures}"


if __name__ == "__main__":
    sys.exit(main())
