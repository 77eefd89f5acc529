// The hot-row tier's slot map: the CUDA C twin of ngram_cupy/hot_rows.py, bit for bit.
//
// One bit per local table row (words) and the count of hot rows before each 64-row word (ranks):
// a hot row's slot in the hot tier is its word's rank plus the set bits below it; a clear bit
// means the row is cold. Reads are counted per tier into COUNTER_LANES pairs of counters (the
// lane picked by block), so the atomics of a launch spread over many addresses.
#pragma once

#ifdef NGRAM_HOST_TEST
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long v) {
    const unsigned long long old = *address;  // the host build runs one thread at a time
    *address = old + v;
    return old;
}
#endif

namespace ngram {

// Counter pairs (hot, cold) a tiered gather adds to: the same number as hot_rows.py.
constexpr int COUNTER_LANES = 64;

// The hot slot of local row 0 <= local < rows, or -1 when the row is cold.
NGRAM_DEVICE long long hot_slot(const unsigned long long* words, const unsigned int* ranks,
                                long long local) {
    const long long index = local >> 6;
    const unsigned long long word = words[index];
    const unsigned long long bit = 1ULL << (local & 63);
    if ((word & bit) == 0) return -1;
    return static_cast<long long>(ranks[index]) + __popcll(word & (bit - 1ULL));
}

// Count one row read from the hot (slot >= 0) or the cold tier.
NGRAM_DEVICE void count_read(unsigned long long* counts, unsigned int lane, bool hot) {
    atomicAdd(&counts[2 * (lane % COUNTER_LANES) + (hot ? 0 : 1)], 1ULL);
}

}  // namespace ngram
