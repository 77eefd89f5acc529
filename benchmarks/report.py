"""Results: rows and sections, markdown tables, the merged markdown file and the plot."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

import numpy as np

from ngram_cupy.runtime.atomic import atomic_file

MARK = "<!-- section: {} -->"
REPORT_HEAD = "# Benchmarks"  # the first line of every report (bench.py refuses other files)
CONTENDED_LIMIT = 1.2  # the most a contended default call may take, in one-thread times


@dataclass
class Row:
    """One measured case: what ran, how long one call took, and how it compares."""

    case: str
    seconds: float
    rate: str = ""
    notes: str = ""
    tokens: int = 0  # tokens per call, for the throughput plot (0: not plotted)
    condition: str = ""  # the load it ran under (conditions sections only)
    one_thread: float = 0.0  # the same call on one thread, same condition (0: not measured)
    ratio: float = 0.0  # median of paired default / one-thread rounds (0: seconds / one_thread)

    @property
    def thread_ratio(self) -> float:
        """Default time over one-thread time: the paired median when measured."""
        return self.ratio or self.seconds / self.one_thread


@dataclass
class Section:
    """A named group of rows with the device it ran on."""

    title: str
    device: str
    rows: list[Row] = field(default_factory=list)
    curves: np.ndarray | None = None  # loss curves [arms, steps] (train-model), plotted apart

    @property
    def by_condition(self) -> bool:
        """Whether the rows compare default calls with one thread under load conditions."""
        return any(row.one_thread for row in self.rows)


def render(section: Section) -> str:
    """One section as a markdown table."""
    if section.by_condition:
        lines = [f"### {section.title}", "",
                 "| case | condition | default | one thread | default / one thread | rate | "
                 "notes |", "|---|---|---:|---:|---:|---:|---|"]
        for row in section.rows:
            ratio = row.thread_ratio
            lines.append(f"| {row.case} | {row.condition} | {row.seconds * 1e6:,.1f} us | "
                         f"{row.one_thread * 1e6:,.1f} us | {ratio:.2f} | {row.rate} | "
                         f"{row.notes} |")
        return "\n".join(lines) + "\n"
    lines = [f"### {section.title}", "", "| case | time per call | rate | compared with |",
             "|---|---:|---:|---|"]
    for row in section.rows:
        lines.append(f"| {row.case} | {row.seconds * 1e6:,.1f} us | {row.rate} | {row.notes} |")
    return "\n".join(lines) + "\n"


def machine_summary(gpu: bool) -> str:
    """One line naming the host (and the GPU when there is one)."""
    import numba

    from ngram_cupy.runtime.cpu_threads import threading_layer

    line = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, NumPy {np.__version__}, "
            f"Numba {numba.__version__} ({numba.get_num_threads()} threads, "
            f"{threading_layer()} layer)")
    if gpu:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        line += f"; GPU {props['name'].decode()}, CuPy {cupy.__version__}"
    return line


def merge_into(path: str, fresh: dict[str, str], order: list[str]) -> None:
    """Rewrite ``path`` atomically, replacing the sections just run and keeping the others."""
    blocks: dict[str, str] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name in order:
            start = text.find(MARK.format(name))
            if start >= 0:
                end = text.find("<!-- section: ", start + 1)
                blocks[name] = text[start : end if end >= 0 else len(text)].rstrip() + "\n"
    blocks.update(fresh)
    body = "\n".join(blocks[name] for name in order if name in blocks)
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{REPORT_HEAD}\n\n{report_intro(os.path.splitext(os.path.basename(path))[0])}"
                f"\n\n{body}")


def report_intro(plot_name: str) -> str:
    """What every report says before its sections: how to read the ratio columns, the run's
    sizes and duration, and the plot beside it."""
    return (
        "Written by `python bench.py`; each section says where and when it ran. Ratios compare "
        "with baselines measured in the same run; CPU sections run every case idle, beside busy "
        "programs and beside torch, against the same call on one thread.\n\n"
        "- **Ratio columns** (`default / one thread`, `x fp8`, ...) are the *median of paired "
        "ratios*: the two calls run in alternation, each pair gives one ratio, and the column is "
        "the median of those ratios. It is not the quotient of the two time columns beside it "
        "(those are medians of each call's own times), and it follows a load that changes "
        "between pairs.\n"
        "- **Sizes**: the tables are the full run's. `--quick` runs smaller cases (ids 1 x "
        "262,144 tokens instead of 1 x 1,048,576; gathers from 1,048,576 rows instead of "
        "4,194,304, without the 65,536-token case; 5 end-to-end rounds instead of 15; a cold "
        "mapped table of 0.24 GiB read by 1,024 tokens once instead of 4.05 GiB by 4,096 tokens "
        "5 times; GPU sections smaller tables and copies) and marks its stamps `--quick`.\n"
        "- **Duration**: `--quick` takes about 4 minutes on a busy 2-core machine; the full run "
        "was not timed as a whole (the figures here were measured section by section); bench.py "
        "now prints each section's time and the whole run's at the end.\n\n"
        f"![Throughput against batch size and contended times in one-thread times]"
        f"({plot_name}.png)")


def plot(sections: list[Section], path: str) -> bool:
    """A PNG: throughput against batch size (idle), and each contended case's time in one-thread
    times (matplotlib; False without it or without rows to plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    throughput = [s for s in sections if any(r.tokens for r in s.rows)]
    contended = [s for s in sections if s.by_condition]
    if not throughput and not contended:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    left, right = axes
    for section in throughput:
        rows = sorted((r for r in section.rows if r.tokens and r.condition in ("", "idle")),
                      key=lambda r: r.tokens)
        left.plot([r.tokens for r in rows], [r.tokens / r.seconds / 1e6 for r in rows],
                  marker="o", label=section.title.split(":")[0])
    left.set(xscale="log", yscale="log", xlabel="tokens per call (batch size)",
             ylabel="Mtoken/s", title="throughput, idle")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize="small")
    cases = [(s.title.split(",")[0], r) for s in contended for r in s.rows]
    labels = list(dict.fromkeys(f"{title}: {r.case}" for title, r in cases))
    names = list(dict.fromkeys(r.condition for _, r in cases))
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        ratios = {f"{title}: {r.case}": r.thread_ratio for title, r in cases
                  if r.condition == name}
        right.bar([i + j * width for i in range(len(labels))],
                  [ratios.get(label, np.nan) for label in labels], width, label=name)
    right.axhline(1.0, color="black", linewidth=0.8)
    right.axhline(CONTENDED_LIMIT, color="red", linestyle="--", linewidth=0.8,
                  label=f"limit {CONTENDED_LIMIT}x")
    right.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, rotation=35,
                     ha="right", fontsize="small")
    right.set(yscale="log", ylabel="default / one-thread time",
              title="parallel calls under load (below 1: faster than one thread)")
    right.legend(fontsize="small")
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return True
