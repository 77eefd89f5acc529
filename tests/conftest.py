"""Shared fixtures: the golden vectors vendored in tests/data/golden, loaded as they are."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

import ngram_cupy as nc
from ngram_cupy.runtime.backends import gpu_available

GOLDEN_DIR = Path(__file__).resolve().parent / "data" / "golden"
# Qwen4Exp cases; the Engram family's engram_*.json are read by tests/ids/test_engram_ids.py.
GOLDEN_FILES = sorted(p for p in GOLDEN_DIR.glob("*.json") if not p.name.startswith("engram_"))

if not GOLDEN_FILES:  # a broken checkout must fail, not skip
    raise RuntimeError(f"no golden vectors found in {GOLDEN_DIR}")

# The CUDA simulator and wrapping uint64 scalar arithmetic warn on intended overflow.
warnings.simplefilter("ignore", RuntimeWarning)


HAS_GPU = gpu_available()  # the library's own probe: CuPy, a driver and a device

# tests/kernel_builds.py shares the CUDA kernels it lowers between the session's processes here.
BUILDS_ENV = "NGRAM_CUPY_TEST_BUILDS"
BUILDS_MADE = pytest.StashKey[str]()


def pytest_configure(config):
    """The session's first process makes the shared build folder; pytest-xdist workers, started
    after it, inherit its name."""
    if BUILDS_ENV not in os.environ:
        folder = tempfile.mkdtemp(prefix="ngram_cupy-test-builds-")
        config.stash[BUILDS_MADE] = os.environ[BUILDS_ENV] = folder


def pytest_unconfigure(config):
    """The folder goes with the process that made it."""
    folder = config.stash.get(BUILDS_MADE, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(BUILDS_ENV, None)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly on machines without a CUDA device."""
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not keywords: a folder named gpu
            item.add_marker(skip)


def load_ngram_golden(path: Path):
    """(layout, expected layout dict, batches as NumPy arrays) of one golden file."""
    case = json.loads(path.read_text())
    config = nc.NGramConfig(**case["config"])
    layout = nc.layer_layout(config, case["layer"])
    width = config.ngram_size - 1
    batches = [
        dict(
            input_ids=np.array(b["input_ids"], dtype=np.int64),
            query_start_loc=np.array(b["query_start_loc"], dtype=np.int64),
            ngram_context=np.array(b["ngram_context"], dtype=np.int64).reshape(-1, width),
            ngram_ids=np.array(b["ngram_ids"], dtype=np.int64).reshape(-1, layout.num_heads),
        )
        for b in case["batches"]
    ]
    return layout, case["layout"], batches


@pytest.fixture(params=GOLDEN_FILES, ids=lambda p: p.stem)
def golden(request):
    """Each golden case in turn."""
    return load_ngram_golden(request.param)


@pytest.fixture(scope="session")
def released_config():
    """The released model's PLE configuration (SPEC section 1)."""
    return nc.NGramConfig(
        vocab_size=248320, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000,
        eos_token_id=248044, embedding_dim=2560, make_ngram_vocab_size_divisible_by=512,
        split_ngram_parts=128,
    )


@pytest.fixture
def simulate(monkeypatch):
    """Every ``NumbaKernel`` launch runs in the CUDA simulator with bounds- and alignment-checked
    arrays, in this process (tests/simulator.py)."""
    import simulator

    simulator.install(monkeypatch)


@pytest.fixture(scope="session")
def host_gather():
    """kernels/gather.cu built once by g++ (cached by source text) and run thread by thread."""
    import host_kernels

    if host_kernels.compiler() is None:
        pytest.skip("no g++ on PATH: gather.cu cannot be built for the host")
    return host_kernels.HostGather(host_kernels.build_library())


@pytest.fixture(scope="session")
def shm_root():
    """This process's folder under /dev/shm (one per pytest-xdist worker) that holds every
    test's ``shm_dir``; removed at the end of the session whatever its outcome, so failing or
    interrupted tests leave nothing there."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    folder = Path(tempfile.mkdtemp(prefix="ngram_cupy-test-", dir=root))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def shm_dir(monkeypatch, shm_root):
    """A fresh scope (a directory in ``shm_root``) for the test's shared segments; at the end no
    segment of it is held and nothing was written there."""
    from ngram_cupy.memory import shared as shared_memory

    folder = Path(tempfile.mkdtemp(dir=shm_root))
    monkeypatch.setenv(shared_memory.SHM_DIR_ENV, str(folder))
    yield folder
    left = sorted(os.listdir(folder)) + shared_memory.own_segments(folder)
    shutil.rmtree(folder)
    assert not left, f"segments left behind: {left}"


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch intra-op thread for a module (``usefixtures``): on a loaded 2-core machine two
    threads make small training loops ~10x slower, and both arms of a comparison run alike."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same(got, want, message=""):
    """Equal bits, NaNs as a class (their payload and sign differ between platforms)."""
    from ngram_cupy.formats import find_format

    want = np.asarray(want)
    raw = find_format(want.dtype).raw
    got = np.asarray(got).view(want.dtype)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=message)
    np.testing.assert_array_equal(got.view(raw)[~nan], want.view(raw)[~nan], err_msg=message)


def layer_rows(config, dtype, seed: int = 0) -> np.ndarray:
    """Random values in [-4, 4) for every row of PLE layer 0 of ``config`` (its padded rows),
    as ``dtype``: a whole table to save, load and look up."""
    layout = nc.layer_layout(config, 0)
    values = np.random.default_rng(seed).uniform(-4, 4, (layout.padded_rows, layout.head_dim))
    return values.astype(np.float32).astype(dtype)


def laid_out(codes: np.ndarray, scales: np.ndarray, fmt, packed: bool):
    """``(rows, scales)`` of a block-scaled table as the kernels get them: the two arrays as
    they are, or (``packed``) views into one record per row (``codecs.records``)."""
    from ngram_cupy.codecs.records import packed_rows

    if not packed:
        return codes, scales
    _, rows, row_scales = packed_rows(codes.shape[0], codes.shape[1] * fmt.pack, fmt)
    rows = rows.view(np.uint8)
    rows[...], row_scales[...] = codes, scales
    return rows, row_scales
