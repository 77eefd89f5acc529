"""``ngram-cupy compile``: every GPU kernel of the schemes, built ahead into the kernel cache."""

from __future__ import annotations

import argparse
import os
import re
import time

from ..runtime import interrupts
from .common import UserError


def parse_arches(text: str) -> list[tuple[int, int]]:
    """Compute capabilities from ``sm_80,sm_90`` (``sm_XY``: major X, minor Y)."""
    arches = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*sm_(\d+)(\d)\s*", part)
        if not match:
            raise argparse.ArgumentTypeError(
                f"not a GPU architecture: {part!r} (examples: sm_80, sm_90, sm_80,sm_90)")
        arches.append((int(match.group(1)), int(match.group(2))))
    return list(dict.fromkeys(arches))


def load_schemes(names: list[str]) -> list:
    """The schemes named (``released``) or read from model config files."""
    from ..ids.kernel_set import SCHEMES, scheme_from_config

    schemes = []
    for name in names:
        if name in SCHEMES:
            schemes.append(SCHEMES[name])
        elif os.path.exists(name):
            try:
                schemes.append(scheme_from_config(name))
            except (ValueError, TypeError) as e:
                raise UserError(f"bad config {name}: {e}") from None
        else:
            raise UserError(f"--scheme {name}: neither a scheme ({', '.join(SCHEMES)}) nor a "
                            f"model config file")
    return schemes


def build_variant(names: tuple[str, ...], only: str | None, index: int,
                  cc: tuple[int, int]) -> tuple[int, bool, float]:
    """Build variant ``index`` of the schemes ``names`` for ``cc`` into the kernel cache (in
    this process or a worker); ``(index, whether it was compiled, seconds)``."""
    from ..runtime import kernel_cache

    variant = selected_variants(names, only)[index]
    builds, start = kernel_cache.KERNELS.builds, time.perf_counter()
    variant.build(cc)
    return index, kernel_cache.KERNELS.builds > builds, time.perf_counter() - start


def selected_variants(names: tuple[str, ...], only: str | None) -> list:
    """The kernel variants of the schemes ``names`` whose name contains ``only``."""
    from ..ids.kernel_set import kernel_variants

    return [v for v in kernel_variants(load_schemes(list(names)))
            if only is None or only in v.name]


def is_cached(variant, cc: tuple[int, int]) -> bool:
    """Whether ``variant`` for ``cc`` loads from the kernel cache (inside ``loads_only``)."""
    from ..runtime.kernel_cache import NotCached

    try:
        variant.build(cc)
    except NotCached:
        return False
    return True


def cmd_compile(args: argparse.Namespace) -> int:
    """Build every GPU kernel of the schemes for the architectures into the kernel cache."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from ..runtime import kernel_cache

    names = tuple(args.scheme)
    variants = selected_variants(names, args.only)
    if not variants:
        raise UserError(f"--only {args.only!r} matches no kernel")
    if args.list:
        print("\n".join(variant.name for variant in variants))
        return 0
    if args.jobs < 1:
        raise UserError(f"--jobs must be at least 1, got {args.jobs}")
    jobs = [(names, args.only, index, cc) for cc in args.arch for index in range(len(variants))]
    start = time.perf_counter()
    built = 0

    def report(job, result) -> None:
        nonlocal built
        index, compiled, seconds = result
        built += compiled
        if not args.quiet:
            print(f"sm_{job[3][0]}{job[3][1]} {variants[index].name}: "
                  f"{'compiled' if compiled else 'cached'} in {seconds:.2f} s", flush=True)

    missing = []
    with kernel_cache.KERNELS.loads_only():  # what is cached already: no workers for those
        for job in jobs:
            begin = time.perf_counter()
            if is_cached(variants[job[2]], job[3]):
                report(job, (job[2], False, time.perf_counter() - begin))
            else:
                missing.append(job)
    if args.jobs == 1 or len(missing) <= 1:
        for job in missing:
            interrupts.check()
            report(job, build_variant(*job))
    else:
        # spawn: a forked Numba/LLVM is not safe to compile in
        with ProcessPoolExecutor(min(args.jobs, len(missing)),
                                 mp_context=get_context("spawn")) as pool:
            for job, result in zip(missing, pool.map(build_variant, *zip(*missing, strict=True)),
                                   strict=True):
                report(job, result)
    arches = ", ".join(f"sm_{major}{minor}" for major, minor in args.arch)
    print(f"{len(jobs)} kernel builds for {arches}: {built} compiled, {len(jobs) - built} "
          f"cached, in {time.perf_counter() - start:.1f} s (cache: {kernel_cache.cache_dir()})")
    return 0


def add_parser(commands) -> None:
    """Add the ``compile`` command to the sub-parsers ``commands``."""
    build = commands.add_parser(
        "compile", help="build the GPU kernels into the kernel cache ahead of time (no GPU "
        "needed)", description="Compile every GPU kernel the library launches for the schemes "
        "(model shapes) and architectures into the kernel cache (NGRAM_CUPY_CACHE_DIR), so "
        "that a process's first GPU call loads them instead of compiling.")
    build.add_argument("--arch", type=parse_arches, default=[(8, 0), (9, 0)],
                       metavar="sm_XY[,sm_XY...]", help="GPU architectures (default sm_80,sm_90)")
    build.add_argument("--scheme", nargs="+", default=["released"], metavar="SCHEME",
                       help="model shapes: 'released' (the released model) or model config "
                       "files (default: released)")
    build.add_argument("--only", metavar="TEXT", help="only the kernels whose name contains TEXT")
    build.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                       help="compiler processes (default: the CPUs, at most 8)")
    build.add_argument("--quiet", action="store_true", help="only the summary line")
    build.add_argument("--list", action="store_true",
                       help="print the names of the kernels selected, one a line, and build none")
    build.set_defaults(run=cmd_compile)
