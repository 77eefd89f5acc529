"""Short GPU workloads for scripts/device_check.sh, each checked against the CPU path.

    python scripts/gpu_workload.py CASE [CASE ...]

Cases: ``kernels`` (ids, context rolling, plain and deduplicating gathers, the fused kernel and a
prefetch, on gpu and pinned tables, fp8 and NVFP4 records with a hot tier; small enough for
compute-sanitizer memcheck), ``packed-uva`` (the UVA gather from pinned memory of
NVFP4 records, fp8 rows and NVFP4 in two arrays: bytes per token and GB/s against a copy of the
same bytes, results written to the file named by ``PACKED_UVA_OUT``, if set),
``graph`` (a ``torch.cuda.graph`` capture of ``forward`` replayed on new tokens, results taken
with ``torch.from_dlpack``), ``misaligned`` (a table adopted from a device view 1 byte past an
8-byte boundary, plain and fused) and ``fresh-fill`` (rows written, then read at once on another
stream), ``train`` (20 steps of every row optimizer on GPU tables, and of a host table given GPU
gradients, against the CPU's bits; their state saved and resumed). Prints one line per case,
``ok`` or the error; exits 1 if any failed.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, not installed

import ngram_cupy as nc  # noqa: E402

CONFIG = nc.NGramConfig(vocab_size=248320, ngram_size=3, heads_per_ngram=8,
                        ngram_vocab_size_base=20_000, eos_token_id=248044, embedding_dim=2560)
HEAD_DIM = 160


def layer_inputs(rng, num_tokens: int, num_requests: int):
    """``(layout, tokens, query_start_loc, context, fp8 weight)`` on the host."""
    layout = nc.layer_layout(CONFIG, 0)
    tokens = rng.integers(0, CONFIG.vocab_size, num_tokens)
    tokens[rng.random(num_tokens) < 0.05] = CONFIG.eos_token_id
    starts = np.linspace(0, num_tokens, num_requests + 1).astype(np.int64)
    context = rng.integers(0, CONFIG.vocab_size, (num_requests, 2))
    weight = (rng.standard_normal((layout.padded_rows, HEAD_DIM)) * 4).astype(
        ml_dtypes.float8_e4m3fn)
    return layout, tokens, starts, context, weight


def nvfp4_rows(rng, rows: int):
    """Random NVFP4 codes ``[rows, HEAD_DIM / 2]`` and finite E4M3 block scales, as bytes."""
    codes = rng.integers(0, 256, (rows, HEAD_DIM // 2), dtype=np.uint8)
    return codes, rng.integers(0, 0x7F, (rows, HEAD_DIM // 16), dtype=np.uint8)


def bits(array) -> np.ndarray:
    """Raw bits on the host of a CuPy, torch or NumPy result."""
    if hasattr(array, "get"):
        array = array.get()
    elif hasattr(array, "cpu"):
        import torch

        same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        array = array.detach().cpu().view(same_size[array.element_size()]).numpy()
    array = np.asarray(array)
    return array.view(f"u{array.dtype.itemsize}")


def case_kernels() -> None:
    import cupy

    rng = np.random.default_rng(0)
    layout, tokens, starts, context, weight = layer_inputs(rng, 300, 4)
    cpu_table = nc.EmbeddingTable(weight, scale=0.5)
    cpu_ids = nc.compute_ngram_ids(layout, tokens, starts, context)
    cpu_rows = bits(cpu_table.lookup(cpu_ids))
    device = [cupy.asarray(a) for a in (tokens, starts, context)]
    ids = nc.compute_ngram_ids(layout, *device)
    np.testing.assert_array_equal(ids.get(), cpu_ids)
    np.testing.assert_array_equal(nc.advance_context(layout, *device).get(),
                                  nc.advance_context(layout, tokens, starts, context))
    for placement in ("gpu", "pinned"):  # every placement a GPU reads
        for dedup in (False, True):
            table = nc.EmbeddingTable(weight, scale=0.5, placement=placement, dedup=dedup)
            np.testing.assert_array_equal(bits(table.lookup(ids)), cpu_rows, err_msg=placement)
        for fused in (False, True):
            layer = nc.NGramEmbedding(layout, table, fused=fused)
            np.testing.assert_array_equal(bits(layer(*device)), cpu_rows)
        layer = nc.NGramEmbedding(layout, table)
        layer.start_prefetch(*device)
        np.testing.assert_array_equal(bits(layer(*device)), cpu_rows, err_msg="prefetch")
    # NVFP4 records through gather.cu (its instances are in the kernel cache already; the
    # fused kernel over records, a compile of its own, is left to the gpu tests)
    codes, scales = nvfp4_rows(rng, layout.padded_rows)
    fp4 = dict(dtype="nvfp4", block_scales=scales, scale=0.5)
    fp4_rows = bits(nc.EmbeddingTable(codes, **fp4).lookup(cpu_ids))
    for placement, hot_rows in (("gpu", None), ("pinned", None),
                                ("pinned", np.arange(0, layout.padded_rows, 7))):
        table = nc.EmbeddingTable(codes, placement=placement, hot_rows=hot_rows, **fp4)
        assert table.storage.cold.packed, placement
        np.testing.assert_array_equal(bits(table.lookup(ids)), fp4_rows,
                                      err_msg=f"nvfp4 {placement}, hot={hot_rows is not None}")
    cupy.cuda.Device().synchronize()


def case_graph() -> None:
    import torch

    rng = np.random.default_rng(1)
    layout, tokens, starts, context, weight = layer_inputs(rng, 64, 8)
    table = nc.EmbeddingTable(weight, scale=0.5, placement="gpu")
    cpu = nc.NGramEmbedding(layout, nc.EmbeddingTable(weight, scale=0.5))
    layer = nc.NGramEmbedding(layout, table)
    inputs = [torch.as_tensor(a, device="cuda") for a in (tokens, starts, context)]
    out = torch.empty((64, layout.num_heads * HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, upload constants, allocate
        layer(*inputs, out=out, stream=side)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = layer(*inputs, out=out, stream=torch.cuda.current_stream())
    fresh = rng.integers(0, CONFIG.vocab_size, 64)
    inputs[0].copy_(torch.as_tensor(fresh))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = bits(cpu(fresh, starts, context))
    got = result if isinstance(result, torch.Tensor) else torch.from_dlpack(result)
    np.testing.assert_array_equal(bits(got), want)
    import cupy

    on_cupy = [cupy.asarray(a) for a in (fresh, starts, context)]
    ids = torch.from_dlpack(layer.compute_ids(*on_cupy))  # a CuPy result handed to torch
    torch.cuda.synchronize()
    np.testing.assert_array_equal(ids.cpu().numpy(), nc.compute_ngram_ids(layout, fresh, starts,
                                                                          context))


def case_misaligned() -> None:
    import torch

    rng = np.random.default_rng(2)
    layout, tokens, starts, context, weight = layer_inputs(rng, 100, 2)
    raw = torch.zeros(weight.size + 8, dtype=torch.uint8, device="cuda")
    view = raw[1 : 1 + weight.size].view(torch.float8_e4m3fn).reshape(weight.shape)
    view.view(torch.uint8).copy_(torch.as_tensor(weight.view(np.uint8)))
    assert view.data_ptr() % 8 == 1
    table = nc.EmbeddingTable(view, scale=0.5, placement="gpu")
    cpu = nc.NGramEmbedding(layout, nc.EmbeddingTable(weight, scale=0.5))
    want = bits(cpu(tokens, starts, context))
    inputs = [torch.as_tensor(a, device="cuda") for a in (tokens, starts, context)]
    for fused in (False, True):
        got = nc.NGramEmbedding(layout, table, fused=fused)(*inputs)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(bits(got), want, err_msg=f"fused={fused}")


def case_fresh_fill() -> None:
    import cupy

    rng = np.random.default_rng(3)
    rows = 1 << 18  # 40 MiB of fp8 rows: the copy is still running when the lookup is queued
    weight = (rng.standard_normal((rows, HEAD_DIM)) * 4).astype(ml_dtypes.float8_e4m3fn)
    ids = np.stack([np.arange(rows - 256, rows), np.arange(256)], axis=1)
    want = bits(nc.EmbeddingTable(weight, scale=0.5).lookup(ids))
    for attempt in range(3):
        table = nc.EmbeddingTable.empty(rows, HEAD_DIM, ml_dtypes.float8_e4m3fn,
                                        placement="gpu", scale=0.5)
        table.write_rows(0, weight)
        other = cupy.cuda.Stream(non_blocking=True)
        got = table.lookup(cupy.asarray(ids), stream=other)
        other.synchronize()
        np.testing.assert_array_equal(bits(got), want, err_msg=f"attempt {attempt}")


def timed(run, repeats: int = 20) -> float:
    """Seconds per call of ``run`` on the GPU (CUDA events, after two warm-up calls)."""
    import cupy

    for _ in range(2):
        run()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        run()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / repeats


def sectors(addresses: np.ndarray, size: int) -> np.ndarray:
    """32-byte sectors that ``size`` bytes from each address touch."""
    return (addresses + size - 1) // 32 - addresses // 32 + 1


def case_packed_uva() -> None:
    """The UVA gather of random rows from pinned host memory (a link-bound read): NVFP4 as one
    96-byte record a row, fp8 rows (160 B) and NVFP4 in two arrays (80 B + 10 B of scales),
    each beside a copy of the same number of bytes from pinned memory (cudaMemcpy) and checked
    bit for bit against the CPU gather."""
    import cupy

    from ngram_cupy.formats import BFLOAT16, FLOAT8_E4M3, NVFP4
    from ngram_cupy.memory.pinned import PinnedBuffer
    from ngram_cupy.runtime.backends import data_address
    from ngram_cupy.tables.gather_cupy import gather_rows

    rng = np.random.default_rng(4)
    rows, tokens, heads = 1 << 21, 4096, 16  # 192 MiB of records: far past the GPU's caches
    codes, scales = nvfp4_rows(rng, rows)
    fp8 = rng.integers(0, 256, (rows, HEAD_DIM), dtype=np.uint8)
    ids = rng.integers(0, rows, (tokens, heads))
    device_ids = cupy.asarray(ids)
    out = cupy.empty((tokens, heads * HEAD_DIM), np.uint16)
    packed = nc.EmbeddingTable(codes, dtype="nvfp4", block_scales=scales, scale=0.5,
                               placement="pinned").storage
    plain = nc.EmbeddingTable(fp8.view(ml_dtypes.float8_e4m3fn), scale=0.5,
                              placement="pinned").storage
    apart = [PinnedBuffer(array.nbytes) for array in (codes, scales)]
    for buffer, array in zip(apart, (codes, scales), strict=True):
        buffer.array[:] = array.reshape(-1)
    two = [buffer.device_array(array.shape, np.uint8)
           for buffer, array in zip(apart, (codes, scales), strict=True)]
    want = bits(nc.EmbeddingTable(codes, dtype="nvfp4", block_scales=scales,
                                  scale=0.5).lookup(ids))
    variants = {  # name: (gather, bytes a row asks for, sectors a row touches)
        "nvfp4 records (96 B)": (
            lambda: gather_rows(packed.device_view, NVFP4, 0, 0.5, device_ids, out, BFLOAT16,
                                scales=packed.device_scales),
            96, sectors(data_address(packed.device_view) + 96 * ids, 96)),
        "fp8 rows (160 B)": (
            lambda: gather_rows(plain.device_view, FLOAT8_E4M3, 0, 0.5, device_ids, out,
                                BFLOAT16),
            160, sectors(data_address(plain.device_view) + 160 * ids, 160)),
        "nvfp4 two arrays (80 + 10 B)": (
            lambda: gather_rows(two[0], NVFP4, 0, 0.5, device_ids, out, BFLOAT16,
                                scales=two[1]),
            90, sectors(data_address(two[0]) + 80 * ids, 80)
            + sectors(data_address(two[1]) + 10 * ids, 10)),
    }
    staging = cupy.empty(tokens * heads * 160, np.uint8)
    lines = [f"UVA gather of {tokens} tokens x {heads} heads, random rows of {rows:,}; GB/s of "
             "the bytes the rows hold; copy: cudaMemcpy of as many bytes from pinned memory",
             "| rows | bytes/token | sector bytes/token | gather us | gather GB/s | copy GB/s | "
             "gather / copy |", "|---|---:|---:|---:|---:|---:|---:|"]
    seconds = {}
    for name, (gather, row_bytes, touched) in variants.items():
        out.fill(0)
        gather()
        if name.startswith("nvfp4"):
            np.testing.assert_array_equal(bits(out), want, err_msg=name)
        nbytes = tokens * heads * row_bytes
        pointer = (packed if name.startswith("nvfp4 records") else plain).buffer.pointer
        copy = timed(lambda n=nbytes, p=pointer: cupy.cuda.runtime.memcpyAsync(
            staging.data.ptr, p, n, cupy.cuda.runtime.memcpyHostToDevice,
            cupy.cuda.get_current_stream().ptr))
        seconds[name] = timed(gather)
        lines.append(f"| {name} | {heads * row_bytes:,} | {32 * touched.sum() / tokens:,.0f} | "
                     f"{seconds[name] * 1e6:,.0f} | {nbytes / seconds[name] / 1e9:.2f} | "
                     f"{nbytes / copy / 1e9:.2f} | {copy / seconds[name]:.2f} |")
    records, fp8_time, two_time = seconds.values()
    lines.append(f"records / fp8 time {records / fp8_time:.2f}, records / two arrays time "
                 f"{records / two_time:.2f} (below 1: records faster)")
    for buffer in apart:
        buffer.close()
    report = "\n".join(lines)
    print(report)
    if os.environ.get("PACKED_UVA_OUT"):
        Path(os.environ["PACKED_UVA_OUT"]).write_text(report + "\n")


TRAIN_OPTIMIZERS = [
    (nc.SGD, {"lr": 0.05, "weight_decay": 0.01, "weight_decay_mode": "decoupled",
              "max_norm": 8.0}),
    (nc.RowwiseAdagrad, {"lr": 0.05, "weight_decay": 0.01, "max_norm": 8.0}),
    (nc.RowwiseAdagrad, {"lr": 0.05, "weight_decay": 0.01, "weight_decay_mode": "decoupled"}),
    (nc.Adam, {"lr": 0.01}),
    (nc.Adam, {"lr": 0.01, "rowwise": True}),
]


def case_train() -> None:
    """Every row optimizer, float32 and bfloat16 (stochastic rounding) rows, 20 steps: a GPU
    table (CuPy and torch inputs, fused and sparse-row steps) and a host table given GPU
    gradients end with the CPU's rows and state bits, and a GPU state resumes on the CPU."""
    import tempfile

    import cupy
    import torch

    rng = np.random.default_rng(4)
    rows, dim = 3000, 64
    weight = rng.standard_normal((rows, dim)).astype(np.float32)
    batches = [(rng.integers(0, rows, (256, 4)),
                rng.standard_normal((256, 4 * dim)).astype(np.float32)) for _ in range(20)]
    folder = Path(tempfile.mkdtemp())
    for dtype, extra in ((np.float32, {}),
                         (ml_dtypes.bfloat16, {"stochastic_rounding": True, "seed": 5})):
        for cls, kwargs in TRAIN_OPTIMIZERS:
            label = f"{cls.__name__} {kwargs} {np.dtype(dtype).name}"
            made = [cls(nc.EmbeddingTable(weight.astype(dtype), placement=placement),
                        **kwargs, **extra) for placement in ("cpu", "gpu", "cpu")]
            cpu, gpu, host = made
            for step, (ids, grad) in enumerate(batches):
                cpu.step_from_output_grad(ids, grad)
                if step % 2:
                    gpu.step_from_output_grad(cupy.asarray(ids), cupy.asarray(grad))
                else:
                    gpu.step(nc.embedding_backward(cupy.asarray(ids), cupy.asarray(grad)))
                host.step_from_output_grad(torch.as_tensor(ids, device="cuda"),
                                           torch.as_tensor(grad, device="cuda"))
            want = cpu.state_dict()
            for name, optimizer in (("gpu", gpu), ("host", host)):
                np.testing.assert_array_equal(bits(optimizer.rows), bits(cpu.rows),
                                              err_msg=f"{label}: {name} rows")
                for key, array in optimizer.state_dict()["state"].items():
                    np.testing.assert_array_equal(bits(array), bits(want["state"][key]),
                                                  err_msg=f"{label}: {name} state {key}")
            ids = cupy.arange(rows).reshape(-1, 1)
            np.testing.assert_array_equal(bits(gpu.table.lookup(ids)),
                                          bits(cpu.table.lookup(ids.get())), err_msg=label)
            path = nc.save_training_state(folder / "gpu.safetensors", gpu)
            resumed = cls(nc.EmbeddingTable(np.zeros((rows, dim), dtype)), **kwargs, **extra)
            nc.load_training_state(path, resumed)
            np.testing.assert_array_equal(bits(resumed.rows), bits(cpu.rows), err_msg=label)
    cupy.cuda.Device().synchronize()


CASES = {"kernels": case_kernels, "packed-uva": case_packed_uva, "graph": case_graph,
         "misaligned": case_misaligned, "fresh-fill": case_fresh_fill, "train": case_train}


def main(names: list[str], cases: dict | None = None) -> int:
    """Run the named cases (of ``cases``, default ``CASES``), one line each."""
    cases = CASES if cases is None else cases
    unknown = [name for name in names if name not in cases]
    if unknown or not names:
        print(f"cases: {', '.join(cases)}; unknown: {unknown}", file=sys.stderr)
        return 2
    failed = 0
    for name in names:
        start = time.perf_counter()
        try:
            cases[name]()
            print(f"{name}: ok ({time.perf_counter() - start:.1f} s)", flush=True)
        except Exception:
            failed += 1
            print(f"{name}: FAILED\n{traceback.format_exc()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
