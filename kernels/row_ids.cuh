// Ids outside the whole table: the first one's position, for the host to raise after the launch.
//
// A thread whose id lies outside [0, total_rows) takes the minimum of its flat position and the
// word `bad` (all bits set before the launch; ngram_cupy/tables/row_ids.py reads it). Ids of
// other shards lie inside and pass. `bad` null: unchecked.
#pragma once

#ifdef NGRAM_HOST_TEST
static inline unsigned long long atomicMin(unsigned long long* address, unsigned long long v) {
    const unsigned long long old = *address;  // the host build runs one thread at a time
    if (v < old) *address = v;
    return old;
}
#endif

namespace ngram {

// Note `item` in `bad` when `id` is outside [0, total_rows).
NGRAM_DEVICE void note_bad_id(unsigned long long* bad, long long total_rows, long long id,
                              long long item) {
    if (bad != nullptr && (id < 0 || id >= total_rows)) {
        atomicMin(bad, static_cast<unsigned long long>(item));
    }
}

}  // namespace ngram
