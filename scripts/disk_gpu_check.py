"""GPU ids on a placement="disk" table (scripts/device_check.sh): the bits of CPU lookups, a
prefetch joined by its lookup, and a CUDA graph that captured a lookup replaying new ids.

    python3 scripts/disk_gpu_check.py
"""

from __future__ import annotations

import os
import sys
import tempfile

import cupy
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ngram_cupy as nc  # noqa: E402

CONFIG = nc.NGramConfig(vocab_size=248320, eos_token_id=248044, ngram_size=3, heads_per_ngram=8,
                        ngram_vocab_size_base=20_000, split_ngram_parts=8, embedding_dim=2560,
                        ple_embedding_dtype="float8_e4m3fn")


def main() -> int:
    layout = nc.layer_layout(CONFIG, 0)
    rng = np.random.default_rng(0)
    weight = rng.integers(0, 0x7F, (layout.padded_rows, layout.head_dim), dtype=np.uint8)
    batches = [rng.integers(0, layout.padded_rows, (256, layout.num_heads)) for _ in range(3)]
    with tempfile.TemporaryDirectory() as work:
        nc.save_ngram_embedding(work + "/m", CONFIG, 0, weight.view(ml_dtypes.float8_e4m3fn),
                                0.5, num_files=2)
        cpu = nc.load_ngram_embedding(work + "/m", CONFIG, 0).table
        disk = nc.load_ngram_embedding(work + "/m", CONFIG, 0, placement="disk",
                                       cache_bytes=1 << 24).table
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            ids = cupy.asarray(batches[0])
            got = disk.lookup(ids)
            assert np.array_equal(got.get().view(np.uint16), cpu.lookup(batches[0]).view(np.uint16))
            disk.prefetch(cupy.asarray(batches[1]))
            got = disk.lookup(cupy.asarray(batches[1]))
            assert np.array_equal(got.get().view(np.uint16), cpu.lookup(batches[1]).view(np.uint16))
            out = cupy.empty(got.shape, got.dtype)
            disk.lookup(ids, out=out)  # the captured shape's buffers, made outside the capture
            stream.begin_capture()
            disk.lookup(ids, out=out)
            graph = stream.end_capture()
            for batch in batches:
                ids[...] = cupy.asarray(batch)
                graph.launch(stream)
                stream.synchronize()
                assert np.array_equal(out.get().view(np.uint16), cpu.lookup(batch).view(np.uint16))
        print("disk-gpu: lookups, prefetch and graph replays equal the CPU's bits;",
              disk.cache_stats()["overall"])
        disk.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
