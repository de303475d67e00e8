/* A library with NVML's ABI for the calls torchpool/broker/nvml.py makes, for
 * tests on hosts without an NVIDIA driver (the real library is read by
 * scripts/gpu-check on a GPU machine). Two GPUs:
 *   GPU 1: the calling process holds 300 MiB; a second process's figure
 *          NVML cannot give (NVML_VALUE_NOT_AVAILABLE);
 *   GPU 2: the calling process holds 200 MiB, and 300 other processes
 *          (pids 100000..100299) 1 MiB each: more than nvml.py asks for at
 *          first, so it must ask again; its utilisation is not reported. */
#include <stdio.h>
#include <unistd.h>

typedef struct { unsigned int pid; unsigned long long used; unsigned int gi, ci; } info_t;
typedef struct { unsigned long long total, free, used; } memory_t;
typedef struct { unsigned int gpu, memory; } utilization_t;

#define MIB (1ULL << 20)
static int initialised;

int nvmlInit_v2(void) { initialised = 1; return 0; }

int nvmlDeviceGetCount_v2(unsigned int *n) {
    if (!initialised) return 1;                      /* NVML_ERROR_UNINITIALIZED */
    *n = 2;
    return 0;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **handle) {
    if (index >= 2) return 2;                        /* NVML_ERROR_INVALID_ARGUMENT */
    *handle = (void *)(long)(index + 1);
    return 0;
}

int nvmlDeviceGetUUID(void *handle, char *uuid, unsigned int length) {
    snprintf(uuid, length, "GPU-fake-%ld", (long)handle);
    return 0;
}

int nvmlDeviceGetMemoryInfo(void *handle, memory_t *m) {
    m->total = 80ULL << 30;
    m->used = (unsigned long long)(long)handle << 30;
    m->free = m->total - m->used;
    return 0;
}

int nvmlDeviceGetUtilizationRates(void *handle, utilization_t *u) {
    if ((long)handle == 2) return 3;                 /* NVML_ERROR_NOT_SUPPORTED */
    u->gpu = 42;
    u->memory = 7;
    return 0;
}

int nvmlDeviceGetComputeRunningProcesses_v3(void *handle, unsigned int *count, info_t *infos) {
    unsigned int n = (long)handle == 1 ? 2 : 301;
    if (*count < n) {
        *count = n;
        return 7;                                    /* NVML_ERROR_INSUFFICIENT_SIZE */
    }
    infos[0].pid = (unsigned int)getpid();
    infos[0].used = ((long)handle == 1 ? 300 : 200) * MIB;
    for (unsigned int i = 1; i < n; i++) {
        infos[i].pid = (long)handle == 1 ? 1 : 100000 + i - 1;
        infos[i].used = (long)handle == 1 ? ~0ULL : MIB;
    }
    *count = n;
    return 0;
}
