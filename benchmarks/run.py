"""The benchmark runner: choose sections, run them, print and write the tables and the plot."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from .report import MARK, REPORT_HEAD, Section, machine_summary, merge_into, plot, render

TRACKED = "BENCHMARKS.md"  # the published file, written only with --write-benchmarks-md
DEFAULT_OUTPUT = "bench-results.md"


@dataclass(frozen=True)
class Bench:
    """One section: its name, the device it needs, what it measures, and how."""

    name: str
    device: str
    summary: str
    run: Callable[[bool], Section]


def sections() -> list[Bench]:
    """Every section in report order (GPU sections import CuPy only when run)."""
    from . import sections_compile as compiled
    from . import sections_cpu as cpu
    from . import sections_disk as disk
    from . import sections_gpu as gpu
    from . import sections_hogwild as hogwild
    from . import sections_jax as jax
    from . import sections_mmap as mapped
    from . import sections_packed as packed
    from . import sections_pipeline as pipeline
    from . import sections_quantize as quantize
    from . import sections_shared as shared
    from . import sections_tiered as tiered
    from . import sections_train_model as train_model
    from . import sections_training as training
    from . import sections_transformers as hf

    return [
        Bench("ids-cpu", "cpu", "ids 1x4096, 32x512, 256x1, 1x1,048,576 tokens under four loads",
              cpu.bench_ids_cpu),
        Bench("engram-ids-cpu", "cpu", "Engram ids of 3 layers, 1,048,576 tokens, against "
              "Qwen4Exp ids under four loads", cpu.bench_engram_ids_cpu),
        Bench("ids-gpu", "gpu", "GPU ids kernel and decode-step latency", gpu.bench_ids_gpu),
        Bench("parquet-e2e", "cpu", "`ngram-cupy ids` on data/ against pyarrow read + write",
              cpu.bench_parquet_e2e),
        Bench("gather-cpu", "cpu", "fp8 -> bf16 gathers of 256, 4,096, 65,536 tokens under four "
              "loads", cpu.bench_gather_cpu),
        Bench("nvfp4-cpu", "cpu", "NVFP4 and MXFP8 -> bf16 gathers of 65,536 tokens against "
              "fp8 and the copy floor, under four loads", cpu.bench_nvfp4_gather_cpu),
        Bench("quantize-cpu", "cpu", "quantize_table of a 1 GiB bf16 table to fp8, nvfp4, mxfp8 "
              "against copying its bytes; peak extra memory", quantize.bench_quantize_cpu),
        Bench("gather-gpu", "gpu", "GPU-resident gathers, fused ids + gather",
              gpu.bench_gather_gpu),
        Bench("nvfp4-gpu", "gpu", "NVFP4 gathers: device, pinned UVA, tiered, fused, against "
              "fp8", gpu.bench_nvfp4_gpu),
        Bench("host-gpu", "gpu", "pinned host table over UVA, de-duplication, prefetch overlap",
              gpu.bench_host_gpu),
        Bench("tiered-gpu", "gpu", "tiered lookups against pinned and all-GPU tables (0% hits, "
              "Zipf ids)", tiered.bench_tiered_gpu),
        Bench("shared-cpu", "cpu", "4 processes share one 1 GiB fp8 table: fill, attach, "
              "resident memory", shared.bench_shared_cpu),
        Bench("hugepages-cpu", "cpu", "fp8 -> bf16 gather of 65,536 tokens: huge pages against "
              "4 KiB pages", shared.bench_huge_pages_cpu),
        Bench("tiered-cpu", "cpu", "host bytes per held-out token with 0, 1e5, 1e6, 1e7 hot rows "
              "(counters)", tiered.bench_tiered_cpu),
        Bench("train-cpu", "cpu", "backward + RowwiseAdagrad step of 65,536 x 16 x 160 on a 4 M-row"
              " table against torch SparseAdam and the gather; state bytes; shared Hogwild",
              training.bench_train_cpu),
        Bench("train-pipeline", "cpu", "per micro-step lookup + RowwiseAdagrad step, overlapped "
              "(asynchronous, prefetched) against synchronous against the lookup alone",
              pipeline.bench_train_pipeline),
        Bench("hogwild", "cpu", "two processes step on disjoint rows of one shared table "
              "against one process, alternating repeats, with the load average",
              hogwild.bench_hogwild),
        Bench("train-model", "cpu", "tiny Qwen4Exp trained 200 steps on data/: nn.Embedding "
              "tables + torch SGD against ngram_cupy tables + fused asynchronous SGD; loss "
              "curves (-losses.png), step-time ratio", train_model.bench_train_model),
        Bench("transformers-cpu", "cpu", "transformers Qwen4Exp: PLE table RSS fp8 / bf16 at "
              ">= 1 GiB, generate tokens/s with and without", hf.bench_transformers_cpu),
        Bench("packed-rows", "cpu", "NVFP4 / MXFP8 rows packed with their block scales against "
              "two arrays and fp8 rows, idle and one core busy", packed.bench_packed_rows),
        Bench("mmap-cold", "cpu", "cold mapped-table lookups (pages dropped, fresh process per "
              "case): plain, faults only, prefetched, against O_DIRECT reads at queue depth 64",
              mapped.bench_mmap_cold),
        Bench("disk", "cpu", "disk-table lookups in a memory cgroup of half the table: cold, "
              "warm, prefetched, against the device, the plain per-row approach and mmap",
              disk.bench_disk),
        Bench("torch-compile", "cpu", "torch.compile of the torch layer against eager: decode "
              "step 256 tokens, prefill 8,192; per-call overhead", compiled.bench_torch_compile),
        Bench("jax", "cpu", "ngram_cupy.jax under jax.jit against eager NumPy calls: lookups and a "
              "train step of 8,192 x 16 x 160; per-call overhead", jax.bench_jax_cpu),
        Bench("transformers-gpu", "gpu", "transformers Qwen4Exp generate: bf16 table on the GPU "
              "against a pinned fp8 table, prefetch on and off", hf.bench_transformers_gpu),
    ]


def gpu_available() -> bool:
    """Whether CuPy is importable and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options; ``--help`` lists the sections."""
    listing = "\n".join(f"  {b.name:<12} [{b.device}] {b.summary}" for b in sections())
    parser = argparse.ArgumentParser(
        prog="bench.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Benchmarks for ngram_cupy. Every ratio compares with a baseline measured in "
                    "the same run; CPU cases run idle, with one and every core busy, and beside "
                    "torch, against the same call on one thread.",
        epilog=f"sections:\n{listing}")
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                        help="run only the sections of this device (default: all this machine "
                        "can run)")
    parser.add_argument("--quick", action="store_true", help="small sizes, a short run")
    parser.add_argument("--sections", help="comma-separated section names (default: all)")
    parser.add_argument("--output", default=DEFAULT_OUTPUT,
                        help=f"markdown file to write (default {DEFAULT_OUTPUT}; - for none); "
                        "the plot goes beside it as .png")
    parser.add_argument("--write-benchmarks-md", action="store_true",
                        help=f"write the tracked {TRACKED} and benchmarks.png of the repository")
    return parser.parse_args(argv)


def output_paths(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(markdown, png)`` to write, or None for each when nothing is written."""
    if args.write_benchmarks_md:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return os.path.join(root, TRACKED), os.path.join(root, "benchmarks.png")
    if args.output == "-":
        return None, None
    return args.output, os.path.splitext(args.output)[0] + ".png"


def output_problem(markdown: str | None) -> str | None:
    """Why ``markdown`` cannot take the report (checked before the run, not after it), or None:
    a folder, a missing folder, or an existing file that is not a report (it would be lost)."""
    if markdown is None:
        return None
    if os.path.isdir(markdown):
        return "is a directory"
    if not os.path.isdir(os.path.dirname(os.path.abspath(markdown))):
        return "its folder does not exist"
    if os.path.exists(markdown):
        try:
            with open(markdown, encoding="utf-8") as f:
                head = f.read(len(REPORT_HEAD))
        except (OSError, UnicodeDecodeError):
            head = ""
        if head != REPORT_HEAD:
            return "exists and is not a bench.py report (it would be replaced)"
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the chosen sections, print the tables, and write them."""
    args = parse(argv)
    benches = sections()
    has_gpu = gpu_available()
    if args.device == "gpu" and not has_gpu:
        print("bench.py: --device gpu asked for, but CuPy sees no CUDA device", file=sys.stderr)
        return 2
    wanted = set(args.sections.split(",")) if args.sections else None
    unknown = (wanted or set()) - {b.name for b in benches}
    if unknown:
        print(f"bench.py: unknown sections {sorted(unknown)}", file=sys.stderr)
        return 2
    markdown, png = output_paths(args)
    problem = output_problem(markdown)
    if problem:
        print(f"bench.py: --output {markdown}: {problem}", file=sys.stderr)
        return 2
    fresh: dict[str, str] = {}
    measured: list[Section] = []
    failed: list[str] = []
    stamp = f"{datetime.date.today().isoformat()}{', --quick' if args.quick else ''}"
    run_start = time.perf_counter()
    for bench in benches:
        if wanted is not None and bench.name not in wanted:
            continue
        if bench.device == "gpu" and not has_gpu:
            print(f"[skip] {bench.name}: no GPU")
            continue
        if args.device != "auto" and bench.device != args.device:
            continue
        print(f"[run] {bench.name}", flush=True)
        section_start = time.perf_counter()
        try:
            measured.append(bench.run(args.quick))
            print(f"[time] {bench.name}: {time.perf_counter() - section_start:.0f} s", flush=True)
        except Exception:  # one failing section must not cost the others' figures
            traceback.print_exc()
            failed.append(bench.name)
            continue
        table = render(measured[-1])
        print(table, flush=True)
        fresh[bench.name] = (f"{MARK.format(bench.name)}\n{table}\n"
                             f"_{stamp}: {machine_summary(has_gpu)}_\n")
        if markdown is not None:  # after each section: a run cut short keeps what it measured
            merge_into(markdown, fresh, [b.name for b in benches])
            print(f"wrote {markdown}", flush=True)
        if png is not None and plot(measured, png):  # the plot too
            print(f"wrote {png}", flush=True)
    for section in measured:
        if png is not None and section.curves is not None:
            from .sections_train_model import plot_losses

            losses = os.path.splitext(png)[0] + "-losses.png"
            if plot_losses(section.curves, losses):
                print(f"wrote {losses}")
    print(f"bench.py: the run took {(time.perf_counter() - run_start) / 60:.1f} min", flush=True)
    if failed:
        print(f"bench.py: sections failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
