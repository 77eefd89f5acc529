// Just enough CUDA C++ for kernels/*.cu to build and run on the host: the launch grid is walked
// block by block, thread by thread, each thread running the kernel body to its end. (Kernels with
// __syncthreads or shared memory would need real threads; gather.cu has neither.)
//
// Alignment: built with -fsanitize=alignment, every load and store of a typed value (the 16-byte
// vector pieces included) reports a misaligned address to the handler below before it happens;
// the handler records it and ends the launch (as the fault would on a GPU), returning -3.
#pragma once
#define NGRAM_HOST_TEST

#include <csetjmp>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline

struct HostDim3 {
    unsigned int x = 0, y = 1, z = 1;
};
inline HostDim3 threadIdx, blockIdx, blockDim, gridDim;

namespace host {

inline long long misaligned_count = 0;
inline std::uintptr_t misaligned_address = 0;
inline unsigned misaligned_alignment = 0;
inline std::jmp_buf* fault = nullptr;  // where a misaligned access ends the launch

// Call kernel(params...) once per thread of blocks [first, last), reading each parameter from
// params[i] as cuLaunchKernel does. sizes[i] is the byte size the launcher packed: a mismatch
// with the kernel's own parameter type is refused (returns the parameter's index + 1).
template <typename... P, std::size_t... I>
int launch(void (*kernel)(P...), unsigned grid, unsigned block, unsigned first, unsigned last,
           void** params, const int* sizes, int count, std::index_sequence<I...>) {
    constexpr int expected[] = {static_cast<int>(sizeof(std::remove_cv_t<P>))..., 0};
    if (count != static_cast<int>(sizeof...(P))) return -2;
    for (int i = 0; i < count; ++i) {
        if (sizes[i] != expected[i]) return i + 1;
    }
    gridDim.x = grid;
    blockDim.x = block;
    std::jmp_buf jump;
    if (setjmp(jump)) {
        fault = nullptr;
        return -3;
    }
    fault = &jump;
    for (unsigned b = first; b < last; ++b) {
        blockIdx.x = b;
        for (unsigned t = 0; t < block; ++t) {
            threadIdx.x = t;
            kernel(*static_cast<std::remove_cv_t<P>*>(params[I])...);
        }
    }
    fault = nullptr;
    return 0;
}

template <typename... P>
int launch(void (*kernel)(P...), unsigned grid, unsigned block, unsigned first, unsigned last,
           void** params, const int* sizes, int count) {
    return launch(kernel, grid, block, first, last, params, sizes, count,
                  std::index_sequence_for<P...>{});
}

}  // namespace host

// GCC's -fsanitize=alignment reports here (the layout of its TypeMismatchData, version 1).
struct HostSourceLocation {
    const char* file;
    unsigned line, column;
};
struct HostTypeMismatch {
    HostSourceLocation location;
    const void* type;
    unsigned char log_alignment;
    unsigned char kind;
};

extern "C" void __ubsan_handle_type_mismatch_v1(HostTypeMismatch* data, std::uintptr_t pointer) {
    if (host::misaligned_count++ == 0) {
        host::misaligned_address = pointer;
        host::misaligned_alignment = 1u << data->log_alignment;
    }
    if (host::fault != nullptr) std::longjmp(*host::fault, 1);  // skip the faulting access
}

extern "C" void __ubsan_handle_type_mismatch_v1_abort(HostTypeMismatch* data,
                                                      std::uintptr_t pointer) {
    __ubsan_handle_type_mismatch_v1(data, pointer);
}

// Misaligned accesses since the last call (at most one per launch) (the first one's address and required alignment).
extern "C" long long host_misaligned(std::uintptr_t* address, unsigned* alignment) {
    const long long count = host::misaligned_count;
    *address = host::misaligned_address;
    *alignment = host::misaligned_alignment;
    host::misaligned_count = 0;
    return count;
}
