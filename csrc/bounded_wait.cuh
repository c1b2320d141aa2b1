// The kernels' bounded waits and the error record a wait that gives up fills (device code only:
// include from .cu files). The record's words and the wait kinds are comet.h's constants.
#pragma once

#include <cstdint>
#include <cstdio>

#include "comet.h"

namespace ds_comet {

__device__ __forceinline__ int32_t load_acquire_sys(const int32_t* ptr) {
    int32_t value;
    asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// Writes the error record the host turns into an exception, prints it, and stops the kernel:
// a wait that never completes must not leave wrong numbers behind or hang the job. When a peer
// stops, every waiting block gives up at about the same time; the claim in device memory lets
// exactly one of them (in these kernels or the Triton GEMM) fill the record, so that its fields
// describe one wait. The others wait (boundedly) until it is filled: a trap ends every block of the
// context, the filling one included.
__device__ inline void fail(const GroupShape& shape, int32_t* layout, int64_t* error_record, int64_t kind,
                            int64_t index, int64_t target, int64_t observed, uint64_t waited_ns) {
    volatile int64_t* record = error_record;
    if (atomicCAS(layout + shape.layout.totals + kTotalErrorClaim, 0, 1) == 0) {
        record[kErrorRank] = shape.rank;
        record[kErrorKind] = kind;
        record[kErrorIndex] = index;
        record[kErrorTarget] = target;
        record[kErrorObserved] = observed;
        record[kErrorWaitedNs] = static_cast<int64_t>(waited_ns);
        __threadfence_system();
        record[kErrorFilled] = 1;
        __threadfence_system();
    } else {
        const uint64_t start = global_timer_ns();
        const uint64_t limit = static_cast<uint64_t>(kErrorRecordWaitNs);
        while (record[kErrorFilled] == 0 && global_timer_ns() - start < limit) __nanosleep(1000);
    }
    // The Python exception (ds_comet/kernels/ops.py) names what the wait was for; this line is for
    // a process that dies before it can raise it.
    printf("ds_comet: rank %d gave up after %.1f s on wait kind %lld, index %lld: target %lld, saw %lld\n", shape.rank,
           waited_ns * 1e-9, static_cast<long long>(kind), static_cast<long long>(index),
           static_cast<long long>(target), static_cast<long long>(observed));
    __trap();
}

// Spins until *ptr >= target (acquire, system scope), bounded by shape.timeout_ns.
__device__ inline void wait_at_least(const int32_t* ptr, int32_t target, const GroupShape& shape, int64_t kind,
                                     int64_t index, int32_t* layout, int64_t* error_record) {
    int32_t seen = load_acquire_sys(ptr);
    if (seen >= target) return;
    const uint64_t start = global_timer_ns();
    while (seen < target) {
        __nanosleep(100);
        seen = load_acquire_sys(ptr);
        const uint64_t waited = global_timer_ns() - start;
        if (seen < target && waited > static_cast<uint64_t>(shape.timeout_ns)) {
            fail(shape, layout, error_record, kind, index, target, seen, waited);
        }
    }
}

}  // namespace ds_comet
