"""The on-disk kernel cache: keys, atomic concurrent fills, loads instead of compiles, broken
entries rebuilt; and ``ngram-cupy compile``, which fills it ahead without a GPU."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli

from ngram_cupy.ids import fused_cuda, ids_cuda, kernel_set
from ngram_cupy.runtime import cuda_launch, kernel_cache, nvrtc
from ngram_cupy.runtime.atomic import TEMP_PREFIX
from ngram_cupy.runtime.kernel_cache import KernelCache, decode_entry, encode_entry, entry_key
from ngram_cupy.tables import gather_cupy

ROOT = Path(__file__).resolve().parents[2]
FAKE_PTX = ".version 8.0\n.target sm_90\n.visible .entry fake(\n.param .u64 a\n)\n{\n}\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh process cache over a temporary folder (as ``NGRAM_CUPY_CACHE_DIR``)."""
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path / "kernels"))
    fresh = KernelCache()
    monkeypatch.setattr(kernel_cache, "KERNELS", fresh)
    return fresh


@pytest.fixture
def fake_numba(monkeypatch):
    """Numba's compiler and nvJitLink replaced by fakes that count their calls."""
    calls = []
    monkeypatch.setattr(cuda_launch.cuda, "compile_ptx",
                        lambda fn, sig, cc: calls.append((fn.__name__, sig, cc)) or (FAKE_PTX,))
    monkeypatch.setattr(cuda_launch, "assemble", lambda ptx, cc: b"cubin for %d%d" % cc)
    return calls


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_cache.CACHE_ENV, str(tmp_path / "mine"))
    assert kernel_cache.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(kernel_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.cache_dir() == tmp_path / "xdg" / "ngram_cupy"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_cache.cache_dir() == tmp_path / "home" / ".cache" / "ngram_cupy"


def test_keys_change_with_every_part():
    base = ("numba", "digest", ("array(int64, 1d, C)",), (9, 0), ("0.68", "0.30"))
    keys = {entry_key(*base)}
    for index, other in enumerate(["nvrtc", "other", ("array(int32, 1d, C)",), (8, 0),
                                   ("0.68", "0.31")]):
        keys.add(entry_key(*base[:index], other, *base[index + 1:]))
    assert len(keys) == 6 and entry_key(*base) == entry_key(*base)


def test_function_digests_follow_closure_constants_and_sources(monkeypatch):
    """Two layer shapes are two kernels; the same shape is one, in any process (no addresses);
    an edit of a module the kernel inlines from is another kernel."""
    digest = lambda *shape: kernel_cache.function_digest(  # noqa: E731
        ids_cuda.ids_kernel(*shape)[0].py_func)
    assert digest(3, 8) == digest(3, 8) != digest(3, 4) != digest(2, 8)
    fused = kernel_cache.function_digest(fused_cuda.fused_kernel(3, 8, 160, 3, 2)[0].py_func)
    # the tiered fused kernel inlines the hashing, the dequantisation (with the format codes
    # it freezes in) and the slot map; the launcher, the cache and the CLI are no part of it
    tiered = fused_cuda.fused_kernel(3, 8, 160, 3, 2, tiered=True)[0].py_func
    assert [m.__name__ for m in kernel_cache.kernel_modules(tiered)] == [
        "ngram_cupy.codecs.dequant", "ngram_cupy.formats", "ngram_cupy.hashing.arithmetic",
        "ngram_cupy.ids.fused_cuda", "ngram_cupy.tables.hot_rows", "ngram_cupy.tables.row_ids"]
    real = kernel_cache.inspect.getsource

    def edited(name):
        monkeypatch.setattr(kernel_cache.inspect, "getsource", lambda module: real(module) + (
            "# edited" if module.__name__ == name else ""))
        return kernel_cache.function_digest(fused_cuda.fused_kernel(3, 8, 160, 3, 2)[0].py_func)

    assert edited("ngram_cupy.codecs.dequant") != fused
    assert edited("ngram_cupy.formats") != fused
    assert edited("ngram_cupy.runtime.cuda_launch") == fused == edited("ngram_cupy.cli.main")
    assert digest(3, 8) == kernel_cache.function_digest(ids_cuda.ids_kernel(3, 8)[0].py_func)


def test_entries_round_trip_and_broken_ones_read_as_missing():
    fields = {"ptx": "text", "image": b"\0\1binary\xff"}
    data = encode_entry(fields)
    assert decode_entry(data) == fields
    flipped = bytearray(data)
    flipped[-3] ^= 1
    for broken in (data[:-1], bytes(flipped), b"", b"garbage", data[:20],
                   data.replace(b"cache 1", b"cache 2")):
        assert decode_entry(broken) is None


def test_a_second_process_compiles_nothing(cache, fake_numba):
    """The first process compiles per (signature, capability) and stores; a new process (a new
    cache object, nothing in memory) loads every entry and compiles none."""
    kernel, _ = ids_cuda.ids_kernel(3, 2)
    signature = (cuda_launch.numba_type(np.zeros(1, np.int64)),)
    first = kernel.compiled(signature, (9, 0))
    assert kernel.compiled(signature, (8, 0))["image"] == b"cubin for 80"
    assert first == {"ptx": FAKE_PTX, "image": b"cubin for 90"}
    assert cache.builds == 2 and len(fake_numba) == 2
    second = KernelCache()
    kernel_cache.KERNELS = second  # the fixture's monkeypatch restores it
    assert kernel.compiled(signature, (9, 0)) == first
    assert kernel.compiled(signature, (8, 0))["image"] == b"cubin for 80"
    assert second.builds == 0 and second.loads == 2 and len(fake_numba) == 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "wrong fields"])
def test_a_broken_entry_is_ignored_and_rebuilt(cache, fake_numba, damage):
    kernel = ids_cuda.advance_context_kernel
    signature = (cuda_launch.numba_type(np.zeros((1, 2), np.int32)),)
    kernel.compiled(signature, (9, 0))
    (path,) = cache.path("x").parent.iterdir()
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 0x20]))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # checks out, but not a Numba kernel's entry
        path.write_bytes(encode_entry({"ptx": b"not text"}))
    assert kernel.compiled(signature, (9, 0)) == {"ptx": FAKE_PTX, "image": b"cubin for 90"}
    assert cache.builds == 2 and len(fake_numba) == 2
    assert decode_entry(path.read_bytes()) == {"ptx": FAKE_PTX, "image": b"cubin for 90"}


def test_an_unwritable_cache_folder_still_runs(tmp_path, fake_numba, monkeypatch):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(kernel_cache, "KERNELS", KernelCache(blocker / "kernels"))
    signature = (cuda_launch.numba_type(np.zeros(1, np.int64)),)
    assert ids_cuda.advance_context_kernel.compiled(signature, (9, 0))["ptx"] == FAKE_PTX


def fill(folder: str, worker: int, rounds: int) -> int:
    """One of several processes storing and reading entries of one folder at once: half the
    keys shared by all, half its own; returns the reads that did not check out (must be 0)."""
    cache = KernelCache(folder)
    broken = 0
    for index in range(rounds):
        key = f"shared{index // 2 % 4}" if index % 2 else f"own{worker}-{index}"
        payload = {"image": bytes([index % 251]) * (50_000 + index), "key": key}
        cache.store(key, payload)
        for read in ("shared0", "shared1", "shared2", "shared3", key):
            got = cache.load(read)
            if got is not None and (got["key"] != read or len(set(got["image"])) != 1):
                broken += 1
        if cache.load(key) is None:
            broken += 1
    return broken


def test_processes_filling_the_cache_at_once_never_see_a_partial_entry(tmp_path):
    folder = str(tmp_path / "kernels")
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        broken = pool.starmap(fill, [(folder, worker, 30) for worker in range(4)])
    assert broken == [0, 0, 0, 0]
    names = os.listdir(folder)
    assert not [name for name in names if name.startswith(TEMP_PREFIX)]
    assert len(names) == 4 + 4 * 15  # 4 shared entries, 15 own per worker


def test_the_gather_module_compiles_once_per_architecture(cache, monkeypatch):
    calls = []
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, names, arch, options: (
        calls.append(arch) or (b"cubin " + arch.encode(), {n: f"_Z{i}" for i, n in
                                                          enumerate(names)})))
    first = gather_cupy.module_build("sm_90")
    assert gather_cupy.module_build("sm_90") == first and calls == ["sm_90"]
    assert first["image"] == b"cubin sm_90"
    gather_cupy.module_build("sm_80")
    assert calls == ["sm_90", "sm_80"] and cache.builds == 2 and cache.loads == 1


def test_nvrtc_builds_a_cubin_without_a_gpu():
    pytest.importorskip("cuda.bindings.nvrtc")
    name = gather_cupy.instance_name(3, 2, 16, np.int64)
    cubin, lowered = nvrtc.compile_cubin(gather_cupy.kernel_source("gather.cu"), "gather.cu",
                                         [name], "sm_90", gather_cupy.NVRTC_OPTIONS)
    assert cubin.startswith(b"\x7fELF") and lowered[name].startswith("_Z")
    with pytest.raises(RuntimeError, match="does not compile for sm_90"):
        nvrtc.compile_cubin("this is not C", "bad.cu", [], "sm_90", ())


def test_the_kernel_set_records_what_the_launchers_pass(monkeypatch):
    """The variants are the launchers' own launches: the fused kernel of the released shape is
    built for the very signature a lookup with int64 inputs passes (written out by hand here,
    as in test_gpu_compiles), over 8-byte words of the fp8 table into bfloat16 bits."""
    from numba import types

    variants = kernel_set.kernel_variants([kernel_set.SCHEMES["released"]])
    names = [v.name for v in variants]
    assert names[0] == "gather.cu" and len(names) == len(set(names)) == 9
    built = []
    monkeypatch.setattr(cuda_launch.NumbaKernel, "compiled",
                        lambda kernel, signature, cc: built.append((kernel, signature, cc)))
    (fused,) = [v for v in variants if v.name == "fused[released float8_e4m3fn->bfloat16 "
                "int64,int64,int64]"]
    fused.build((9, 0))
    matrix = lambda dtype: types.Array(dtype, 2, "C")  # noqa: E731
    vector = types.Array(types.int64, 1, "C")
    ((kernel, signature, cc),) = built
    assert signature == (vector, vector, matrix(types.int64), matrix(types.int64), types.int64,
                         matrix(types.uint64), types.int64, types.float32, types.boolean,
                         matrix(types.int64), matrix(types.uint16), matrix(types.uint8),
                         types.int64, types.int64, types.Array(types.uint64, 1, "C")) \
        and cc == (9, 0)  # block scales (a placeholder for an fp8 table), their byte column,
    # total rows, the bad word
    assert kernel is fused_cuda.fused_kernel(3, 8, 160, 3, 2, None, 8, False)[0]
    with cuda_launch.recorded_launches() as launches:
        ids_cuda.launch_ngram_ids(kernel_set.SCHEMES["released"].layout, np.zeros(0, np.int64),
                                  np.zeros(1, np.int64), np.zeros((0, 2), np.int64), None, None)
    assert launches == []  # nothing to launch for no tokens


# ---------------------------------------------------------------- ngram-cupy compile


def test_compile_fills_the_cache_and_a_second_run_is_much_faster(cache, capsys):
    """The real compilers (Numba's NVVM and nvJitLink, no GPU), one small kernel."""
    argv = ["compile", "--arch", "sm_80,sm_90", "--only", "advance_context[int64", "--jobs", 1]
    start = time.perf_counter()
    status, out, err = run_cli(argv, capsys)
    first = time.perf_counter() - start
    assert status == 0 and err == ""
    assert "2 kernel builds for sm_80, sm_90: 2 compiled, 0 cached" in out
    start = time.perf_counter()
    status, out, _ = run_cli(argv, capsys)
    second = time.perf_counter() - start
    assert status == 0 and "2 compiled" not in out and ": 0 compiled, 2 cached" in out
    assert second * 5 <= first, (first, second)


@pytest.mark.parametrize("argv, message", [
    (["--arch", "sm_9"], "not a GPU architecture: 'sm_9'"),
    (["--arch", "compute_90"], "not a GPU architecture"),
    (["--scheme", "nonesuch"], "--scheme nonesuch: neither a scheme (released) nor"),
    (["--only", "no such kernel"], "--only 'no such kernel' matches no kernel"),
    (["--jobs", "0"], "--jobs must be at least 1"),
])
def test_compile_errors_are_one_line_and_exit_2(argv, message, cache, capsys):
    status, out, err = run_cli(["compile", *argv], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1 and message in err


def test_a_config_file_is_a_scheme(tmp_path, cache, capsys):
    config = tmp_path / "config.json"
    config.write_text((ROOT / "data" / "config.json").read_text())
    schemes = [kernel_set.scheme_from_config(str(config))]
    assert schemes[0].formats == ((3, 2),) and schemes[0].layout.head_dim == 160
    bad = tmp_path / "bad.json"
    bad.write_text('{"vocab_size": 10}')
    status, _, err = run_cli(["compile", "--scheme", bad], capsys)
    assert status == 2 and err.startswith(f"ngram-cupy: error: bad config {bad}")


def test_an_engram_config_file_is_a_scheme_of_its_kernels(tmp_path, monkeypatch):
    """An Engram config builds the Engram ids and lookback kernels of its shape, for the very
    signature compute_engram_ids launches with int64 inputs (on a stand-in device)."""
    import json

    from numba import types

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"text_config": dict(
        engram_layer_ids=[2, 14], engram_max_ngram_size=3, engram_n_heads=4,
        engram_head_dim=64, engram_vocab_size=1000, engram_num_embeddings=[9000, 9000],
        engram_compressed_vocab_size=7, engram_pad_token_id=2)}))
    variants = kernel_set.kernel_variants([kernel_set.scheme_from_config(str(config))])
    names = [v.name for v in variants]
    assert names[0] == "gather.cu" and not any(n.startswith(("ids[", "fused[")) for n in names)
    assert sum(n.startswith("engram_ids[") for n in names) == len(kernel_set.INDEX_TYPES)
    assert "advance_engram_lookback[dead mask]" in names
    built = []
    monkeypatch.setattr(cuda_launch.NumbaKernel, "compiled",
                        lambda kernel, signature, cc: built.append(signature))
    (ids,) = [v for v in variants if v.name == f"engram_ids[{config} int64,int64]"]
    ids.build((9, 0))
    vector, matrix = (lambda dtype: types.Array(dtype, 1, "C")), \
        (lambda dtype: types.Array(dtype, 2, "C"))
    assert built == [(vector(types.int64), vector(types.int64), vector(types.int64),
                      vector(types.uint8), matrix(types.int64), matrix(types.uint8),
                      vector(types.int32), types.int64, types.Array(types.int64, 3, "C"),
                      matrix(types.int32))]


@pytest.mark.gpu
def test_a_new_process_first_gpu_call_loads_from_the_cache(tmp_path):
    """On a GPU: a process fills the cache with its first call's kernels; the next process's
    first call compiles nothing."""
    script = (
        "import cupy, ngram_cupy as nc\n"
        "from ngram_cupy.runtime import kernel_cache\n"
        "layout = nc.layer_layout(nc.NGramConfig(vocab_size=100, ngram_size=3, "
        "heads_per_ngram=2, ngram_vocab_size_base=1000, eos_token_id=0), 0)\n"
        "nc.compute_ngram_ids(layout, cupy.arange(8), cupy.array([0, 8]), "
        "cupy.zeros((1, 2), cupy.int64))\n"
        "cupy.cuda.Device().synchronize()\n"
        "print(kernel_cache.KERNELS.builds, kernel_cache.KERNELS.loads)\n")
    env = {**os.environ, kernel_cache.CACHE_ENV: str(tmp_path / "kernels"),
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, check=True).stdout.split() for _ in range(2)]
    assert runs == [["1", "0"], ["0", "1"]]
