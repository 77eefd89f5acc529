"""Host memory for tables: anonymous mappings backed by transparent huge pages where offered.

A table in host memory (placements ``"cpu"``, ``"pinned"``, ``"shared"``) is one mapping of
exactly its size. With huge pages (the default) the mapping is advised ``MADV_HUGEPAGE``: the
fill faults it in 2 MiB pages, so lookups miss the TLB far less and page-locking touches 512
times fewer pages. The switch: ``huge_pages=False`` where a function takes it, or the
environment variable ``NGRAM_CUPY_HUGE_PAGES=0`` for every table of the process. Kernels
without transparent huge pages (or with them off) give ordinary 4 KiB pages, silently.
"""

from __future__ import annotations

import mmap
import os

HUGE_PAGES_ENV = "NGRAM_CUPY_HUGE_PAGES"


def huge_pages_wanted(huge_pages: bool | None = None) -> bool:
    """``huge_pages`` when given, else the environment switch (on unless ``0``/``false``/
    ``no``/``off``)."""
    if huge_pages is not None:
        return bool(huge_pages)
    return os.environ.get(HUGE_PAGES_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def advise(memory: mmap.mmap, option_name: str) -> bool:
    """``memory.madvise`` with the named option where the platform has it; whether it was
    applied (a kernel refusing it, e.g. huge pages off, is not an error)."""
    option = getattr(mmap, option_name, None)
    if option is None or not hasattr(memory, "madvise"):
        return False
    try:
        memory.madvise(option)
    except OSError:
        return False
    return True


def advise_huge_pages(memory: mmap.mmap, huge_pages: bool | None = None) -> bool:
    """Advise ``MADV_HUGEPAGE`` when huge pages are wanted; whether it was applied."""
    return huge_pages_wanted(huge_pages) and advise(memory, "MADV_HUGEPAGE")


def anonymous_memory(nbytes: int, huge_pages: bool | None = None) -> mmap.mmap:
    """``nbytes`` of private anonymous memory (zero pages until written), in huge pages when
    wanted and offered."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    advise_huge_pages(memory, huge_pages)
    return memory
