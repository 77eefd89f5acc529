"""Where a table's rows lie in a checkpoint's files, for ``placement="disk"``."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from ..formats import Format
from ..tables.row_cache import DEFAULT_POLICY, check_policy
from ..tables.storage import placement_named
from ..tables.storage.disk import DiskBlock
from .safetensors_files import Checkpoint


def disk_files(checkpoint: Checkpoint, pieces: Sequence[tuple], fmt: Format, head_dim: int,
               ) -> Callable[[], tuple[list[DiskBlock], Callable[[], None]]]:
    """``RowsSource.files`` of ``pieces``: ``(tensor, its block scales' tensor or None, first
    row, stop row, first local row)`` of ``fmt`` rows in the checkpoint; gives the ``DiskBlock``s
    and the guard checking their files (``Checkpoint.check_files``, each file advised
    ``POSIX_FADV_RANDOM``: its header reads bring in no read-ahead)."""

    def files():
        width = fmt.row_width(head_dim) * fmt.itemsize
        blocks = []
        for name, scales, a, b, local in pieces:
            info = checkpoint.info(name)
            scale = None if scales is None else checkpoint.info(scales)
            blocks.append(DiskBlock(
                local, b - a, info.path, info.begin + a * width,
                None if scale is None else scale.begin + a * fmt.scale_width(head_dim),
                checkpoint.descriptor(info.path), None if scale is None else scale.path,
                None if scale is None else checkpoint.descriptor(scale.path)))
        paths = sorted({block.path for block in blocks}
                       | {block.scale_path for block in blocks if block.scale_path is not None})
        for path in paths:  # the guard's header reads pull in no read-ahead
            os.posix_fadvise(checkpoint.descriptor(path), 0, 0, os.POSIX_FADV_RANDOM)
        return blocks, lambda: checkpoint.check_files(paths)

    return files


def disk_options(placement: str, cache_bytes: int, cache_policy: str) -> dict:
    """``place``'s options for the row cache: those of a ``"disk"`` table; for any other
    placement none, and a ValueError when a cache was asked for."""
    if placement_named(placement, mapped=True).name == "disk":
        return {"cache_bytes": cache_bytes, "cache_policy": check_policy(cache_policy)}
    if cache_bytes or cache_policy != DEFAULT_POLICY:
        raise ValueError(f"cache_bytes and cache_policy are placement='disk''s row cache, not "
                         f"placement={placement!r}'s")
    return {}
