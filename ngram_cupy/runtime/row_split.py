"""How rows are cut into contiguous blocks: checkpoint shards, and the rows each rank owns."""

from __future__ import annotations

from .checks import check_integer


def split_rows(total_rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of block ``index`` when ``total_rows`` are cut into ``parts``
    contiguous blocks of ``ceil(total_rows / parts)`` rows (the last ones shorter or empty).

    The rule for both checkpoint shards (``parts = split_ngram_parts``) and the rows each rank
    owns under row sharding (``parts = world_size``, ``index = rank``).
    """
    for name, value in (("total_rows", total_rows), ("parts", parts), ("index", index)):
        check_integer(name, value)
    if total_rows < 0 or parts < 1:
        raise ValueError(f"need total_rows >= 0 and parts >= 1, got {total_rows} and {parts}")
    if not 0 <= index < parts:
        raise ValueError(f"index must lie in [0, {parts}), got {index}")
    size = -(-int(total_rows) // int(parts))
    return min(index * size, total_rows), min((index + 1) * size, total_rows)
