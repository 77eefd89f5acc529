"""ngram_cupy.jax on a GPU (scripts/device_check.sh, step jax-gpu): ids and lookups of CUDA JAX
arrays, eagerly and under jax.jit, against the CPU's bits. Exit 0 when every case matches, 1
when one differs; without a CUDA build of jax it says so and exits 0 (nothing to check)."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np


def main() -> int:
    """Check every case; print one line each."""
    try:
        import jax

        gpus = jax.devices("gpu")
    except Exception as error:  # no jax, or a CPU-only jaxlib: nothing to check here
        print(f"jax-gpu: skipped, no CUDA jax ({error!r})")
        return 0
    import ngram_cupy as nc
    import ngram_cupy.jax as ncj

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4096, 64)).astype(np.float32)
    ids = rng.integers(0, 4096, (512, 8)).astype(np.int32)
    gpu_ids = jax.device_put(ids, gpus[0])
    cases = {
        "float32 gpu": (weight, {"placement": "gpu"}),
        "bfloat16 pinned": (weight.astype(ml_dtypes.bfloat16), {"placement": "pinned"}),
        "fp8 gpu": (weight.astype(ml_dtypes.float8_e4m3fn), {"placement": "gpu", "scale": 0.5}),
        "nvfp4 pinned": (nc.quantize_table(weight, "nvfp4"), {"placement": "pinned"}),
        "hot rows pinned": (weight, {"placement": "pinned", "hot_rows": np.arange(0, 4096, 5)}),
    }
    failed = 0
    for name, (rows, options) in cases.items():
        want = nc.EmbeddingTable(rows, **{k: v for k, v in options.items()
                                          if k == "scale"}).lookup(ids)
        table = nc.EmbeddingTable(rows, **options)
        jitted = jax.jit(lambda i, table=table: ncj.lookup(table, i))
        for how, got in (("eager", ncj.lookup(table, gpu_ids)), ("jit", jitted(gpu_ids))):
            same = bool(np.array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8)))
            failed += not same
            print(f"lookup {name} {how}: {'same bits' if same else 'DIFFERENT'} "
                  f"({got.dtype} on {got.devices()})")
    layout = nc.layer_layout(nc.NGramConfig(1000, 3, 2, 500, 0), 0)
    tokens = rng.integers(0, 1000, (4, 64)).astype(np.int32)
    want = nc.compute_ngram_ids(layout, tokens)
    got = jax.jit(lambda t: ncj.compute_ngram_ids(layout, t))(jax.device_put(tokens, gpus[0]))
    same = bool(np.array_equal(np.asarray(got), want))
    failed += not same
    print(f"ids jit: {'same values' if same else 'DIFFERENT'} ({got.dtype})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
