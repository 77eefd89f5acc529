"""Plain reference for docs/engram.md's Engram ids and lookback: Python integers, one token at a
time, written from the definition and sharing nothing with the kernels. Slow and obviously right:
every fast path is tested against it."""

from __future__ import annotations

import numpy as np

from .engram_layout import EngramLayout

MASK64 = (1 << 64) - 1
DEAD = object()  # a dead token's source: never equal to a compressed id


def _signed(value: int) -> int:
    """A 64-bit pattern read as two's complement."""
    return value - (1 << 64) if value >> 63 else value


def compute_engram_ids(layout: EngramLayout, input_ids, positions, query_start_loc,
                       lookback_token_ids=None, dead_mask=None,
                       lookback_dead_mask=None) -> np.ndarray:
    """``[T, L, H]`` int32 ids of a packed batch, straight from docs/engram.md."""
    tokens = [int(x) for x in np.asarray(input_ids).ravel()]
    where = [int(x) for x in np.asarray(positions).ravel()]
    starts = [int(x) for x in np.asarray(query_start_loc).ravel()]
    n, k, num_layers = layout.ngram_size, layout.heads_per_ngram, layout.num_layers
    dead = np.zeros(len(tokens), bool) if dead_mask is None else np.asarray(dead_mask)
    lookback = None if lookback_token_ids is None else np.asarray(lookback_token_ids)
    lookback_dead = (None if lookback_dead_mask is None else np.asarray(lookback_dead_mask))
    token_map, pad = layout.token_map, layout.pad_id
    out = np.zeros((len(tokens), num_layers, (n - 1) * k), dtype=np.int32)
    for r in range(len(starts) - 1):
        if starts[r] == starts[r + 1]:
            continue
        chunk_start = where[starts[r]]
        for t in range(starts[r], starts[r + 1]):
            p = where[t]
            if t > starts[r] and p != where[t - 1] + 1:
                raise ValueError(f"request {r}: positions must be consecutive, got {p} after "
                                 f"{where[t - 1]}")
            for layer in range(num_layers):
                blocked, rolling = False, 0
                for s in range(n):
                    q = p - s
                    if q >= chunk_start:
                        source = DEAD if dead[t - s] else int(token_map[tokens[t - s]])
                    else:
                        entry = -1 if lookback is None else int(lookback[r, chunk_start - 1 - q])
                        if entry < 0:
                            source = pad
                        elif lookback_dead is not None and lookback_dead[r, chunk_start - 1 - q]:
                            source = DEAD
                        else:
                            source = int(token_map[entry])
                    blocked = blocked or q < 0 or source is DEAD
                    value = pad if blocked else source
                    rolling ^= (value * int(layout.multipliers[layer, s])) & MASK64
                    for h in range((s - 1) * k, s * k) if s >= 1 else ():
                        size = int(layout.head_sizes[layer, h])
                        offset = int(layout.head_offsets[layer, h])
                        out[t, layer, h] = _signed(rolling) % size + offset
    return out


def advance_engram_lookback(layout: EngramLayout, values, query_start_loc,
                            lookback=None) -> np.ndarray:
    """Each request's next ``[R, n-1]`` lookback: the newest n-1 of its lookback (newest first)
    and its ``values`` (token ids, or dead flags), newest first; -1 (False) where unknown."""
    values = np.asarray(values)
    starts = np.asarray(query_start_loc)
    width = layout.ngram_size - 1
    fill = False if values.dtype == bool else -1
    rows = []
    for r in range(starts.size - 1):
        old = [fill] * width if lookback is None else list(np.asarray(lookback)[r])
        newest_first = list(values[starts[r] : starts[r + 1]][::-1]) + old
        rows.append(newest_first[:width])
    return np.array(rows, dtype=values.dtype).reshape(-1, width)
