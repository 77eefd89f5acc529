"""Benchmarks for ngram_cupy: prints one table per section and writes BENCHMARKS.md.

Every figure is measured in the same run as its baselines (the NumPy reference, a plain memory
copy of the same size), so ratios hold on any machine. Usage:

    python bench.py                 # every section that this machine can run
    python bench.py --quick         # small sizes, for a smoke run
    python bench.py --device gpu    # GPU sections only (needs CuPy and a device)
    python bench.py --sections ids-cpu --output -   # one section, no file written
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import ngram_cupy as nc
from ngram_cupy import reference

RELEASED = nc.NGramConfig(
    vocab_size=248320, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=20_000_000,
    eos_token_id=248044, embedding_dim=2560, make_ngram_vocab_size_divisible_by=512,
    split_ngram_parts=128,
)


@dataclass
class Row:
    """One measured case: what ran, how long one call took, and how it compares."""

    case: str
    seconds: float
    rate: str
    notes: str = ""


@dataclass
class Section:
    """A named group of rows with the device it ran on."""

    title: str
    device: str
    rows: list[Row] = field(default_factory=list)


def timeit(fn: Callable[[], object], min_time: float = 0.3, max_calls: int = 100_000) -> float:
    """Median seconds per call of ``fn`` over repeated batches lasting at least ``min_time``."""
    fn()  # warm-up: compilation, first-touch page faults
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time / 5 or calls >= max_calls:
            break
        calls *= 4
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    return float(np.median(samples))


def released_batch(num_requests: int, tokens_per_request: int, seed: int = 0):
    """A packed batch of random valid tokens (2% EOS) for the released config."""
    rng = np.random.default_rng(seed)
    num_tokens = num_requests * tokens_per_request
    tokens = rng.integers(0, RELEASED.vocab_size, num_tokens, dtype=np.int64)
    tokens[rng.random(num_tokens) < 0.02] = RELEASED.eos_token_id
    starts = np.arange(0, num_tokens + 1, tokens_per_request, dtype=np.int64)
    context = rng.integers(0, RELEASED.vocab_size, (num_requests, RELEASED.ngram_size - 1))
    return tokens, starts, context


def copy_floor(nbytes: int) -> float:
    """Seconds to copy ``nbytes`` once between two preallocated host arrays: the memory floor."""
    source = np.ones(nbytes // 8, dtype=np.int64)
    target = np.empty_like(source)
    return timeit(lambda: np.copyto(target, source))


def bench_ids_cpu(quick: bool) -> Section:
    """Fast CPU ids against the NumPy reference and the output-sized copy floor."""
    layout = nc.layer_layout(RELEASED, 0)
    section = Section("n-gram ids, CPU (Numba), released config layer 0", "cpu")
    cases = [(1, 4096), (32, 512), (256, 1), (1, 1 << 20), (2048, 512)]
    if quick:
        cases = [(1, 4096), (32, 512), (256, 1), (1, 1 << 16)]
    for num_requests, length in cases:
        tokens, starts, context = released_batch(num_requests, length)
        out = np.empty((tokens.size, layout.num_heads), dtype=np.int64)
        fast = timeit(lambda: nc.compute_ngram_ids(layout, tokens, starts, context, out=out))
        slow = timeit(lambda: reference.compute_ngram_ids(layout, tokens, starts, context),
                      min_time=0.05)
        floor = copy_floor(out.nbytes)
        section.rows.append(Row(
            case=f"{num_requests} x {length} tokens",
            seconds=fast,
            rate=f"{tokens.size / fast / 1e6:.1f} Mtoken/s",
            notes=f"{slow / fast:.0f}x the NumPy reference; {floor / fast:.0%} of the copy floor",
        ))
    return section


# Each section: (name, device it needs, function). Add new ones here.
SECTIONS: list[tuple[str, str, Callable[[bool], Section]]] = [
    ("ids-cpu", "cpu", bench_ids_cpu),
]


def gpu_available() -> bool:
    """Whether CuPy is importable and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def machine_summary() -> str:
    """One line naming the host (and the GPU when there is one)."""
    import numba

    line = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, NumPy {np.__version__}, "
            f"Numba {numba.__version__} ({numba.get_num_threads()} threads)")
    if gpu_available():
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        line += f"; GPU {props['name'].decode()}, CuPy {cupy.__version__}"
    return line


def render(section: Section) -> str:
    """One section as a markdown table."""
    lines = [f"### {section.title}", "", "| case | time per call | rate | compared with |",
             "|---|---:|---:|---|"]
    for row in section.rows:
        lines.append(f"| {row.case} | {row.seconds * 1e6:,.1f} us | {row.rate} | {row.notes} |")
    return "\n".join(lines) + "\n"


MARK = "<!-- section: {} -->"


def merge_into(path: str, fresh: dict[str, str]) -> None:
    """Rewrite ``path`` atomically, replacing the sections just run and keeping the others."""
    blocks: dict[str, str] = {}
    if os.path.exists(path):
        text = open(path, encoding="utf-8").read()
        for name, _, _ in SECTIONS:
            start = text.find(MARK.format(name))
            if start >= 0:
                end = text.find("<!-- section: ", start + 1)
                blocks[name] = text[start : end if end >= 0 else len(text)].rstrip() + "\n"
    blocks.update(fresh)
    body = "\n".join(blocks[name] for name, _, _ in SECTIONS if name in blocks)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("# Benchmarks\n\nWritten by `python bench.py`; each section says where and when it "
                "ran. Ratios compare with baselines measured in the same run.\n\n" + body)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, print the tables, and write them to ``--output``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--sections", help="comma-separated section names (default: all)")
    parser.add_argument("--output", default="BENCHMARKS.md", help="markdown file, or - for none")
    args = parser.parse_args(argv)

    has_gpu = gpu_available()
    if args.device == "gpu" and not has_gpu:
        print("bench.py: --device gpu asked for, but CuPy sees no CUDA device", file=sys.stderr)
        return 2
    wanted = set(args.sections.split(",")) if args.sections else None
    unknown = (wanted or set()) - {name for name, _, _ in SECTIONS}
    if unknown:
        print(f"bench.py: unknown sections {sorted(unknown)}", file=sys.stderr)
        return 2

    fresh: dict[str, str] = {}
    stamp = f"{datetime.date.today().isoformat()}{', --quick' if args.quick else ''}"
    for name, device, run in SECTIONS:
        if wanted is not None and name not in wanted:
            continue
        if device == "gpu" and not has_gpu:
            print(f"[skip] {name}: no GPU")
            continue
        if args.device != "auto" and device != args.device:
            continue
        print(f"[run] {name}", flush=True)
        table = render(run(args.quick))
        print(table, flush=True)
        fresh[name] = f"{MARK.format(name)}\n{table}\n_{stamp}: {machine_summary()}_\n"

    if args.output != "-" and fresh:
        merge_into(args.output, fresh)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
