/*
 * tools/steptrace.c - a kernel timeline of any CUDA program, for scripts/trace_step.sh.
 *
 * Built as libsteptrace.so (make libsteptrace.so) and loaded into a program through the CUDA
 * driver's injection hook: CUDA_INJECTION64_PATH=$PWD/libsteptrace.so ./train_gpt --bench. The
 * driver calls InitializeInjection when the program creates its CUDA context; from then on CUPTI's
 * activity API records every kernel's start and end as the GPU timestamps them. At exit the records
 * are written, one line a kernel, to $TRACE_OUT (default trace.csv): start and end (ns), stream,
 * the shared memory the driver configured, the dynamic shared memory asked for, the grid's blocks,
 * and the (mangled) name.
 *
 * Why not Nsight Compute: ncu replays kernels one at a time, with its own clocks and (by default)
 * cold caches, so its durations summed over a step are not the step, and it cannot see what lies
 * between kernels. This records the run as it runs: concurrent kernels overlap, caches are warm,
 * clocks are whatever the card's power limit lets them be, and the gaps between kernels are there
 * to measure. (Nsight Systems would do the same; it is not installed on the device machines.)
 */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "../lib/util.h"  // xaligned_alloc, xrealloc

#define CUPTI_CHECK(call)                                                                       \
    do {                                                                                        \
        CUptiResult result_ = (call);                                                           \
        if (result_ != CUPTI_SUCCESS) {                                                         \
            const char* text_ = NULL;                                                           \
            cuptiGetResultString(result_, &text_);                                              \
            fprintf(stderr, "steptrace: %s:%d: %s: %s\n", __FILE__, __LINE__, #call, text_ ? text_ : "?"); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

#define BUFFER_BYTES (8 << 20)  // CUPTI fills these with records and hands them back full

typedef struct {
    unsigned long long start, end;
    unsigned stream, smem_executed, smem_dynamic, blocks;
    const char* name;  // CUPTI keeps kernel names for the life of the process
} KernelRecord;

static KernelRecord* records;
static size_t n_records, records_cap;

static void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = (uint8_t*)xaligned_alloc(8, BUFFER_BYTES);
    *size = BUFFER_BYTES;
    *max_records = 0;  // as many as fit
}

static void CUPTIAPI buffer_completed(CUcontext context, uint32_t stream, uint8_t* buffer, size_t size,
                                      size_t valid) {
    (void)context, (void)stream, (void)size;
    CUpti_Activity* record = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
        const CUpti_ActivityKernel10* k = (const CUpti_ActivityKernel10*)record;
        if (n_records == records_cap) {
            records_cap = records_cap ? 2 * records_cap : 65536;
            records = (KernelRecord*)xrealloc(records, records_cap * sizeof(KernelRecord));
        }
        records[n_records++] = (KernelRecord){k->start, k->end, k->streamId, k->sharedMemoryExecuted,
                                              (unsigned)k->dynamicSharedMemory,
                                              (unsigned)(k->gridX * k->gridY * k->gridZ), k->name};
    }
    free(buffer);
}

static void write_records(void) {
    CUPTI_CHECK(cuptiActivityFlushAll(1));
    const char* path = getenv("TRACE_OUT") ? getenv("TRACE_OUT") : "trace.csv";
    FILE* f = fopen(path, "w");
    if (!f) {  // the run fails, so that the trace's absence is not taken for an empty one
        fprintf(stderr, "steptrace: cannot write %s\n", path);
        _exit(1);  // (exit() may not be called again from an atexit handler)
    }
    fprintf(f, "start,end,stream,smem_executed,smem_dynamic,blocks,name\n");
    for (size_t i = 0; i < n_records; i++) {
        const KernelRecord* r = &records[i];
        fprintf(f, "%llu,%llu,%u,%u,%u,%u,%s\n", r->start, r->end, r->stream, r->smem_executed, r->smem_dynamic,
                r->blocks, r->name ? r->name : "?");
    }
    fclose(f);
    fprintf(stderr, "steptrace: %zu kernels written to %s\n", n_records, path);
}

int InitializeInjection(void) {
    CUPTI_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    CUPTI_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    atexit(write_records);
    return 1;
}
