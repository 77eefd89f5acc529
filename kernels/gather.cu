// Row gather with fused dequantisation: out[t, h*D:(h+1)*D] = convert(table[ids[t, h] - row_start]).
//
// One source for every case, instantiated per (storage format, output format, load width, id
// type). Each thread moves one VEC-byte piece of a row: consecutive threads read consecutive
// pieces of a row and then of the next row, so loads and stores coalesce; VEC is 16 bytes when the
// row size and the pointers allow (the released fp8 rows: 160 bytes, 10 threads per row). The
// table pointer may be device memory or page-locked host memory mapped into the GPU (UVA): the
// same loads then cross PCIe. Ids outside [row_start, row_start + local_rows) write zero rows and
// read nothing. With `expected`, heads whose id equals expected[t, h] are skipped (their rows are
// already in `out`, written by a prefetch of those ids).
//
// Row r starts `stride` bytes after row r - 1 (the row's bytes for rows side by side; more for
// packed records, where a row's block scales follow its values in the same record).
//
// Block-scaled formats (NVFP4, MXFP8) pack one or more values per byte: a thread's VEC bytes give
// VEC * PACK values, each multiplied by the block scale byte its block has in `scales` (row r's
// scales start at scales + r * scale_stride; a hot tier has its own in `hot_scales`, with the
// same strides). Packed records (codecs/records.py) pass `scales` pointing into the first record,
// just past its values, and scale_stride = stride: consecutive threads read a record's values in
// VEC-byte pieces, whole 32-byte sectors, and its scale bytes follow them in the same record (in
// the sector of its last values, or the next one), so a row costs its record's sectors and no
// read in a second array.
//
// Ids outside the whole table, [0, total_rows), are noted in `bad` (row_ids.cuh): the minimum of
// their item positions, which the host reads after the launch and raises on; they read nothing.
//
// gather_tiered_rows is the same gather over a hot-row tier (hot_rows.cuh): a row whose bit is set
// in the slot map is read from `hot` (GPU memory) at its slot instead of from `table`, and each
// row read is counted, per tier, in `counts`.
#include "dequant.cuh"
#include "hot_rows.cuh"
#include "row_ids.cuh"

namespace ngram {

// One load or store of exactly BYTES bytes (a single vector instruction).
template <int BYTES> struct Piece;
template <> struct Piece<1> { unsigned char v; };
template <> struct Piece<2> { unsigned short v; };
template <> struct Piece<4> { unsigned int v; };
template <> struct alignas(8) Piece<8> { unsigned long long v; };
template <> struct alignas(16) Piece<16> { unsigned int x, y, z, w; };

}  // namespace ngram

namespace ngram {

// One thread's piece of the gather (see the kernels below); TIERED reads hot rows from `hot`.
template <int CODE, int OUT_CODE, int VEC, typename Id, bool TIERED>
__device__ __forceinline__ void gather_piece(
        const unsigned char* __restrict__ table, long long local_rows, long long row_start,
        const Id* __restrict__ ids, const long long* __restrict__ expected, long long num_items,
        int chunks, long long stride, long long scale_stride, float scale,
        unsigned char* __restrict__ out,
        const unsigned long long* __restrict__ hot_words, const unsigned int* __restrict__ hot_ranks,
        const unsigned char* __restrict__ hot, unsigned long long* __restrict__ counts,
        const unsigned char* __restrict__ scales, const unsigned char* __restrict__ hot_scales,
        long long total_rows, unsigned long long* __restrict__ bad) {
    using In = typename Raw<CODE>::type;
    using Out = typename Raw<OUT_CODE>::type;
    constexpr int PACK = Blocks<CODE>::PACK, BLOCK = Blocks<CODE>::BLOCK;
    constexpr int UNITS = VEC / static_cast<int>(sizeof(In));  // stored elements per thread
    constexpr int N = UNITS * PACK;  // values per thread
    constexpr int OUT_BYTES = N * static_cast<int>(sizeof(Out));
    constexpr int STORE = OUT_BYTES < 16 ? OUT_BYTES : 16;
    static_assert(UNITS >= 1 && VEC % sizeof(In) == 0, "VEC must hold whole values");

    const long long total = num_items * chunks;
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= total) return;
    long long item;
    int chunk;
    if (total <= 0x7FFFFFFFLL) {  // 32-bit division when it suffices (the common case)
        const unsigned int u = static_cast<unsigned int>(i);
        item = u / static_cast<unsigned int>(chunks);
        chunk = static_cast<int>(u - static_cast<unsigned int>(item) * chunks);
    } else {
        item = i / chunks;
        chunk = static_cast<int>(i - item * chunks);
    }

    const long long id = static_cast<long long>(ids[item]);
    if (expected != nullptr && expected[item] == id) return;
    long long local = id - row_start;

    union alignas(16) {
        Piece<STORE> pieces[OUT_BYTES / STORE];
        Out values[N];
    } result;
    if (local >= 0 && local < local_rows) {
        const unsigned char* rows = table;
        const unsigned char* block_scales = scales;
        if constexpr (TIERED) {
            const long long slot = hot_slot(hot_words, hot_ranks, local);
            if (slot >= 0) {
                rows = hot;
                block_scales = hot_scales;
                local = slot;
            }
            if (chunk == 0) count_read(counts, blockIdx.x, slot >= 0);
        }
        union {
            Piece<VEC> piece;
            In values[UNITS];
        } source;
        source.piece = reinterpret_cast<const Piece<VEC>*>(rows + local * stride)[chunk];
        if constexpr (BLOCK > 0) {
            constexpr int BITS = 8 * static_cast<int>(sizeof(In)) / PACK;
            const unsigned char* row_scales = block_scales + local * scale_stride;
            float block = 0.0f;
#pragma unroll
            for (int k = 0; k < N; ++k) {
                if (k % BLOCK == 0) {  // a thread's values lie in one block, or span whole ones
                    block = block_value<CODE>(row_scales[(chunk * N + k) / BLOCK]);
                }
                const unsigned int bits = (static_cast<unsigned int>(source.values[k / PACK]) >>
                                           (BITS * (k % PACK))) & ((1u << BITS) - 1u);
                result.values[k] = static_cast<Out>(convert_blocked<CODE, OUT_CODE>(bits, block,
                                                                                     scale));
            }
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) {
                result.values[k] = static_cast<Out>(convert<CODE, OUT_CODE>(source.values[k],
                                                                            scale));
            }
        }
    } else {
        if (chunk == 0) note_bad_id(bad, total_rows, id, item);
#pragma unroll
        for (int k = 0; k < N; ++k) result.values[k] = 0;
    }

    auto* target = reinterpret_cast<Piece<STORE>*>(out + (item * chunks + chunk) * OUT_BYTES);
#pragma unroll
    for (int s = 0; s < OUT_BYTES / STORE; ++s) target[s] = result.pieces[s];
}

}  // namespace ngram

template <int CODE, int OUT_CODE, int VEC, typename Id>
__global__ void gather_rows(const unsigned char* __restrict__ table, long long local_rows,
                            long long row_start, const Id* __restrict__ ids,
                            const long long* __restrict__ expected, long long num_items,
                            int chunks, long long stride, long long scale_stride, float scale,
                            unsigned char* __restrict__ out,
                            const unsigned char* __restrict__ scales, long long total_rows,
                            unsigned long long* __restrict__ bad) {
    ngram::gather_piece<CODE, OUT_CODE, VEC, Id, false>(table, local_rows, row_start, ids,
                                                        expected, num_items, chunks, stride,
                                                        scale_stride, scale, out, nullptr,
                                                        nullptr, nullptr, nullptr, scales,
                                                        nullptr, total_rows, bad);
}

template <int CODE, int OUT_CODE, int VEC, typename Id>
__global__ void gather_tiered_rows(const unsigned char* __restrict__ table, long long local_rows,
                                   long long row_start, const Id* __restrict__ ids,
                                   const long long* __restrict__ expected, long long num_items,
                                   int chunks, long long stride, long long scale_stride,
                                   float scale, unsigned char* __restrict__ out,
                                   const unsigned long long* __restrict__ hot_words,
                                   const unsigned int* __restrict__ hot_ranks,
                                   const unsigned char* __restrict__ hot,
                                   unsigned long long* __restrict__ counts,
                                   const unsigned char* __restrict__ scales,
                                   const unsigned char* __restrict__ hot_scales,
                                   long long total_rows, unsigned long long* __restrict__ bad) {
    ngram::gather_piece<CODE, OUT_CODE, VEC, Id, true>(table, local_rows, row_start, ids,
                                                       expected, num_items, chunks, stride,
                                                       scale_stride, scale, out, hot_words,
                                                       hot_ranks, hot, counts, scales,
                                                       hot_scales, total_rows, bad);
}
