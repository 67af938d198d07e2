/*
 * A stub of the NVIDIA driver library (libcuda.so.1) for mucudnn's host test tier
 * (tests/cudnn_host.rs, tests/current_context.rs, scripts/cudnn_host_env.sh). Test-only:
 * never shipped, never installed.
 *
 * cuDNN's engine sub-libraries need a libcuda to load at all, but on a machine without a GPU
 * only its version query has to succeed: with this stub, descriptors, operation graphs,
 * heuristics on a device description and execution plans finalize, and every call that would
 * need a device answers CUDA_ERROR_NO_DEVICE (100).
 *
 * It keeps the driver's state machine, so that code calling the driver in the wrong order
 * fails here as it would on a GPU: before cuInit, every call but cuInit, cuDriverGetVersion,
 * cuGetProcAddress and the error-name functions answers CUDA_ERROR_NOT_INITIALIZED (3), as
 * the real driver does (cudarc does not call cuInit for its raw `result` layer). cuInit answers
 * CUDA_ERROR_NO_DEVICE, as a driver with no GPU does; after it, the calling thread's current
 * context is readable and can be set to none (no context can exist, so any other context is
 * CUDA_ERROR_INVALID_CONTEXT), and device calls answer CUDA_ERROR_NO_DEVICE.
 *
 * Built by scripts/cudnn_host_env.sh:  cc -shared -fPIC -O2 -o libcuda.so.1 stub_libcuda.c
 * With -DMUCUDNN_STUB_BARE, cuGetErrorName and cuGetErrorString are left out: a libcuda that
 * lacks them must give mucudnn an error value, not a panic.
 */
#include <stddef.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long cuuint64_t;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_NOT_FOUND 500

/* Whether cuInit has been called (by any thread): the driver's one process-wide state. */
static int initialized = 0;

/* What a call that needs a device answers: not initialised before cuInit, no device after. */
static CUresult no_device(void) {
    return __atomic_load_n(&initialized, __ATOMIC_ACQUIRE) ? CUDA_ERROR_NO_DEVICE
                                                             : CUDA_ERROR_NOT_INITIALIZED;
}

/* The CUDA version the stub claims (13.0, what mucudnn's cudarc bindings need). */
#define STUB_DRIVER_VERSION 13000

CUresult cuDriverGetVersion(int *version) {
    if (version == NULL) return CUDA_ERROR_INVALID_VALUE;
    *version = STUB_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult cuInit(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    __atomic_store_n(&initialized, 1, __ATOMIC_RELEASE);
    return CUDA_ERROR_NO_DEVICE;
}

CUresult cuDeviceGetCount(int *count) {
    if (count != NULL) *count = 0;
    return no_device();
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    (void)device; (void)ordinal;
    return no_device();
}

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
    (void)value; (void)attribute; (void)device;
    return no_device();
}

/* No context can exist without a device: none is ever current, and none can be made so. */
CUresult cuCtxGetCurrent(void **ctx) {
    if (!__atomic_load_n(&initialized, __ATOMIC_ACQUIRE)) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx == NULL) return CUDA_ERROR_INVALID_VALUE;
    *ctx = NULL;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(void *ctx) {
    if (!__atomic_load_n(&initialized, __ATOMIC_ACQUIRE)) return CUDA_ERROR_NOT_INITIALIZED;
    return ctx == NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuCtxPushCurrent_v2(void *ctx) {
    if (!__atomic_load_n(&initialized, __ATOMIC_ACQUIRE)) return CUDA_ERROR_NOT_INITIALIZED;
    (void)ctx;
    return CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuCtxPopCurrent_v2(void **ctx) {
    if (!__atomic_load_n(&initialized, __ATOMIC_ACQUIRE)) return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx != NULL) *ctx = NULL;
    return CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice device) {
    (void)device;
    if (ctx != NULL) *ctx = NULL;
    return no_device();
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) { (void)device; return no_device(); }

CUresult cuCtxGetDevice(CUdevice *device) { (void)device; return no_device(); }

CUresult cuModuleLoadData(void **module, const void *image) {
    (void)module; (void)image;
    return no_device();
}

CUresult cuModuleLoadDataEx(void **module, const void *image, unsigned int n, void *options,
                            void **values) {
    (void)module; (void)image; (void)n; (void)options; (void)values;
    return no_device();
}

CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
    (void)function; (void)module; (void)name;
    return no_device();
}

CUresult cuModuleUnload(void *module) { (void)module; return no_device(); }

CUresult cuLibraryLoadData(void **library, const void *code, void *jit_options,
                           void **jit_values, unsigned int jit_count, void *library_options,
                           void **library_values, unsigned int library_count) {
    (void)library; (void)code; (void)jit_options; (void)jit_values; (void)jit_count;
    (void)library_options; (void)library_values; (void)library_count;
    return no_device();
}

/* Linked directly (not looked up) by cuDNN's runtime-compiled engines: needed to load them. */
CUresult cuTensorMapEncodeTiled(void *map, int dtype, unsigned int rank, void *address,
                                const cuuint64_t *dims, const cuuint64_t *strides,
                                const unsigned int *box, const unsigned int *element_strides,
                                int interleave, int swizzle, int l2_promotion, int oob_fill) {
    (void)map; (void)dtype; (void)rank; (void)address; (void)dims; (void)strides; (void)box;
    (void)element_strides; (void)interleave; (void)swizzle; (void)l2_promotion; (void)oob_fill;
    return no_device();
}

CUresult cuTensorMapEncodeIm2col(void *map, int dtype, unsigned int rank, void *address,
                                 const cuuint64_t *dims, const cuuint64_t *strides,
                                 const int *lower, const int *upper, unsigned int channels,
                                 unsigned int pixels, const unsigned int *element_strides,
                                 int interleave, int swizzle, int l2_promotion, int oob_fill) {
    (void)map; (void)dtype; (void)rank; (void)address; (void)dims; (void)strides; (void)lower;
    (void)upper; (void)channels; (void)pixels; (void)element_strides; (void)interleave;
    (void)swizzle; (void)l2_promotion; (void)oob_fill;
    return no_device();
}

/* cuDNN's engines also look up cuLaunchKernel, cuLinkCreate, cuLibraryGetKernel, ... with
 * dlsym when a plan is finalized, and print "Could not load symbol" for each one missing.
 * They are left out on purpose: with them present, plan finalization goes on to prepare
 * kernels and the host tier becomes many times slower. */

/* The runtime that cuDNN links statically asks for driver entry points by name: none is
 * offered, so it reports that no usable driver exists (rather than calling into the stub). */
CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, cuuint64_t flags) {
    (void)symbol; (void)version; (void)flags;
    if (pfn != NULL) *pfn = NULL;
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             int *status) {
    (void)symbol; (void)version; (void)flags;
    if (pfn != NULL) *pfn = NULL;
    if (status != NULL) *status = 1; /* CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND */
    return CUDA_ERROR_NOT_FOUND;
}

#ifndef MUCUDNN_STUB_BARE
CUresult cuGetErrorName(CUresult error, const char **name) {
    if (name == NULL) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; return CUDA_SUCCESS;
    case CUDA_ERROR_NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; return CUDA_SUCCESS;
    default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult cuGetErrorString(CUresult error, const char **text) {
    if (text == NULL) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *text = "no error"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *text = "invalid argument"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_INITIALIZED: *text = "initialization error"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_CONTEXT: *text = "invalid device context"; return CUDA_SUCCESS;
    case CUDA_ERROR_NO_DEVICE:
        *text = "no CUDA-capable device is detected (mucudnn's stub libcuda)";
        return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_FOUND: *text = "named symbol not found"; return CUDA_SUCCESS;
    default: *text = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
}
#endif
