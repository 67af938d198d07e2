/*
 * examples/c_client.c: mucudnn's C ABI on a GPU, checked against cuDNN called directly.
 *
 * For each case it makes the cuDNN and CUDA objects a framework would have (a cuDNN handle, a
 * stream, tensor/filter/convolution descriptors, device buffers), runs forward, backward-data
 * and backward-filter once through mucudnn and once through cuDNN directly (the first legacy
 * algorithm that runs), and compares: max |mucudnn - cuDNN| / max |cuDNN| must be within the
 * case's tolerance (1e-4 for fp32 FMA math, 5e-3 where TF32 is allowed: the same
 * algorithm-independent tolerances as the Rust GPU tests). It also checks alpha/beta blending
 * (beta = 1 accumulates over every micro-batch of backward-filter), a second stream
 * (mucudnnSetStream), the memory checks (a host pointer, an output overlapping an input) and a
 * non-packed descriptor, then prints a table with times (CUDA events, 10 calls after a warm-up)
 * and the plans mucudnn made.
 *
 * Build and run on the GPU machine (scripts/gpu/c_abi_check.sh does this, finding the paths):
 *   cc -std=c11 -O2 examples/c_client.c -I include -I $CUDA/include -I $CUDNN/include \
 *      -L .gpu/c_abi -lmucudnn -Wl,-rpath,$PWD/.gpu/c_abi \
 *      -L $CUDNN/lib -l:libcudnn.so.9 -L $CUDA/lib64 -lcudart -lm -o c_client
 *   LD_LIBRARY_PATH=<a directory with a libcudnn.so link to that same libcudnn.so.9> ./c_client
 * (mucudnn loads libcudnn.so at run time; it must be the libcudnn this program links.)
 *
 * Exit status 0 when every check passes.
 */
#include <cuda_runtime.h>
#include <cudnn.h>

#include "mucudnn.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;

#define CUDA_OK(call)                                                                       \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) {                                                            \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                   \
                    cudaGetErrorString(e_));                                                \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

#define CUDNN_OK(call)                                                                      \
    do {                                                                                    \
        cudnnStatus_t s_ = (call);                                                          \
        if (s_ != CUDNN_STATUS_SUCCESS) {                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call,                   \
                    cudnnGetErrorString(s_));                                               \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

#define MUCUDNN_OK(call)                                                                    \
    do {                                                                                    \
        mucudnnStatus_t m_ = (call);                                                        \
        if (m_ != MUCUDNN_STATUS_SUCCESS) {                                                 \
            fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call,               \
                    mucudnnGetStatusString(m_), mucudnnGetLastError());                     \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

/* An expected failure: the status and a piece of the message. */
static void expect_error(const char *what, mucudnnStatus_t got, mucudnnStatus_t expected,
                         const char *message_part) {
    const char *message = mucudnnGetLastError();
    int ok = got == expected && strstr(message, message_part) != NULL;
    printf("  %-44s %s (%s)\n", what, ok ? "refused as expected" : "WRONG",
           mucudnnGetStatusString(got));
    if (!ok) {
        fprintf(stderr, "    expected %s with \"%s\", got: %s\n", mucudnnGetStatusString(expected),
                message_part, message);
        failures++;
    }
}

typedef struct {
    const char *name;
    int n, c, h, w, k, r, s, pad, stride, dilation, groups;
    cudnnTensorFormat_t format;
    cudnnMathType_t math;
    double tolerance;
} Case;

static const Case CASES[] = {
    {"alexnet conv2 fp32 nchw fma", 64, 96, 27, 27, 256, 5, 5, 2, 1, 1, 1, CUDNN_TENSOR_NCHW,
     CUDNN_FMA_MATH, 1e-4},
    {"grouped strided dilated fp32 nchw fma", 32, 32, 20, 20, 64, 3, 3, 2, 2, 2, 4,
     CUDNN_TENSOR_NCHW, CUDNN_FMA_MATH, 1e-4},
    {"3x3 fp32 nhwc fma", 32, 64, 28, 28, 64, 3, 3, 1, 1, 1, 1, CUDNN_TENSOR_NHWC,
     CUDNN_FMA_MATH, 1e-4},
    {"resnet 3x3 fp32 nchw default (tf32)", 32, 64, 56, 56, 64, 3, 3, 1, 1, 1, 1,
     CUDNN_TENSOR_NCHW, CUDNN_DEFAULT_MATH, 5e-3},
};

typedef struct {
    cudnnTensorDescriptor_t x, y;
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv;
    size_t x_len, w_len, y_len;
} Descriptors;

static Descriptors make_descriptors(const Case *c) {
    Descriptors d;
    CUDNN_OK(cudnnCreateTensorDescriptor(&d.x));
    CUDNN_OK(cudnnCreateTensorDescriptor(&d.y));
    CUDNN_OK(cudnnCreateFilterDescriptor(&d.w));
    CUDNN_OK(cudnnCreateConvolutionDescriptor(&d.conv));
    CUDNN_OK(cudnnSetTensor4dDescriptor(d.x, c->format, CUDNN_DATA_FLOAT, c->n, c->c, c->h, c->w));
    CUDNN_OK(cudnnSetFilter4dDescriptor(d.w, CUDNN_DATA_FLOAT, c->format, c->k, c->c / c->groups,
                                        c->r, c->s));
    CUDNN_OK(cudnnSetConvolution2dDescriptor(d.conv, c->pad, c->pad, c->stride, c->stride,
                                             c->dilation, c->dilation, CUDNN_CROSS_CORRELATION,
                                             CUDNN_DATA_FLOAT));
    CUDNN_OK(cudnnSetConvolutionGroupCount(d.conv, c->groups));
    CUDNN_OK(cudnnSetConvolutionMathType(d.conv, c->math));
    int n, k, p, q;
    CUDNN_OK(cudnnGetConvolution2dForwardOutputDim(d.conv, d.x, d.w, &n, &k, &p, &q));
    CUDNN_OK(cudnnSetTensor4dDescriptor(d.y, c->format, CUDNN_DATA_FLOAT, n, k, p, q));
    d.x_len = (size_t)c->n * c->c * c->h * c->w;
    d.w_len = (size_t)c->k * (c->c / c->groups) * c->r * c->s;
    d.y_len = (size_t)n * k * p * q;
    return d;
}

static void destroy_descriptors(Descriptors *d) {
    cudnnDestroyTensorDescriptor(d->x);
    cudnnDestroyTensorDescriptor(d->y);
    cudnnDestroyFilterDescriptor(d->w);
    cudnnDestroyConvolutionDescriptor(d->conv);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static float random_value(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) & 0xffffff) / (float)0x800000 - 1.0f; /* [-1, 1) */
}

static float *device_random(size_t len) {
    float *host = malloc(len * sizeof(float));
    for (size_t i = 0; i < len; i++) host[i] = random_value();
    float *device;
    CUDA_OK(cudaMalloc((void **)&device, len * sizeof(float)));
    CUDA_OK(cudaMemcpy(device, host, len * sizeof(float), cudaMemcpyHostToDevice));
    free(host);
    return device;
}

static float *device_copy(const float *source, size_t len) {
    float *device;
    CUDA_OK(cudaMalloc((void **)&device, len * sizeof(float)));
    CUDA_OK(cudaMemcpy(device, source, len * sizeof(float), cudaMemcpyDeviceToDevice));
    return device;
}

/* max |got - want| / max |want| over two device arrays. */
static double relative_error(const float *got_d, const float *want_d, size_t len) {
    float *got = malloc(len * sizeof(float)), *want = malloc(len * sizeof(float));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(got, got_d, len * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(want, want_d, len * sizeof(float), cudaMemcpyDeviceToHost));
    double max_diff = 0, max_ref = 0;
    for (size_t i = 0; i < len; i++) {
        double diff = fabs((double)got[i] - (double)want[i]);
        if (!(diff <= max_diff)) max_diff = diff; /* NaN propagates */
        if (fabs(want[i]) > max_ref) max_ref = fabs(want[i]);
    }
    free(got);
    free(want);
    return max_diff / (max_ref > 0 ? max_ref : 1);
}

enum { FWD, BWD_DATA, BWD_FILTER };
static const char *OP_NAMES[] = {"fwd", "bwd_data", "bwd_filter"};

/* Direct cuDNN: the first legacy algorithm of `op` that cuDNN runs here (algo -1: none). */
typedef struct {
    int algo;
    void *workspace;
    size_t workspace_bytes;
} Direct;

static cudnnStatus_t direct_call(cudnnHandle_t h, const Descriptors *d, int op, int algo,
                                 const float *alpha, const float *a, const float *b,
                                 const float *beta, float *out, void *ws, size_t ws_bytes) {
    switch (op) {
    case FWD:
        return cudnnConvolutionForward(h, alpha, d->x, a, d->w, b, d->conv,
                                       (cudnnConvolutionFwdAlgo_t)algo, ws, ws_bytes, beta, d->y,
                                       out);
    case BWD_DATA:
        return cudnnConvolutionBackwardData(h, alpha, d->w, a, d->y, b, d->conv,
                                            (cudnnConvolutionBwdDataAlgo_t)algo, ws, ws_bytes,
                                            beta, d->x, out);
    default:
        return cudnnConvolutionBackwardFilter(h, alpha, d->x, a, d->y, b, d->conv,
                                              (cudnnConvolutionBwdFilterAlgo_t)algo, ws, ws_bytes,
                                              beta, d->w, out);
    }
}

static Direct choose_direct(cudnnHandle_t h, const Descriptors *d, int op, const float *a,
                            const float *b, float *out) {
    int count = op == FWD ? CUDNN_CONVOLUTION_FWD_ALGO_COUNT
                : op == BWD_DATA ? CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT
                                 : CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT;
    const float one = 1.0f, zero = 0.0f;
    for (int algo = 0; algo < count; algo++) {
        size_t bytes = 0;
        cudnnStatus_t s =
            op == FWD ? cudnnGetConvolutionForwardWorkspaceSize(
                            h, d->x, d->w, d->conv, d->y, (cudnnConvolutionFwdAlgo_t)algo, &bytes)
            : op == BWD_DATA
                ? cudnnGetConvolutionBackwardDataWorkspaceSize(
                      h, d->w, d->y, d->conv, d->x, (cudnnConvolutionBwdDataAlgo_t)algo, &bytes)
                : cudnnGetConvolutionBackwardFilterWorkspaceSize(
                      h, d->x, d->y, d->conv, d->w, (cudnnConvolutionBwdFilterAlgo_t)algo,
                      &bytes);
        if (s != CUDNN_STATUS_SUCCESS) continue;
        void *ws = NULL;
        if (bytes > 0 && cudaMalloc(&ws, bytes) != cudaSuccess) {
            cudaGetLastError();
            continue;
        }
        s = direct_call(h, d, op, algo, &one, a, b, &zero, out, ws, bytes);
        if (s == CUDNN_STATUS_SUCCESS) {
            Direct direct = {algo, ws, bytes};
            return direct;
        }
        cudaFree(ws);
    }
    Direct none = {-1, NULL, 0}; /* cuDNN runs no legacy algorithm of `op` here */
    return none;
}

/* Milliseconds per call of `run` (10 calls after one warm-up), on `stream`. */
typedef int (*Run)(void *context);

static float time_calls(cudaStream_t stream, Run run, void *context) {
    cudaEvent_t start, stop;
    CUDA_OK(cudaEventCreate(&start));
    CUDA_OK(cudaEventCreate(&stop));
    run(context);
    CUDA_OK(cudaEventRecord(start, stream));
    for (int i = 0; i < 10; i++) run(context);
    CUDA_OK(cudaEventRecord(stop, stream));
    CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return ms / 10;
}

typedef struct {
    cudnnHandle_t cudnn;
    mucudnnHandle_t mu;
    const Descriptors *d;
    int op;
    const float *a, *b;
    float *out;
    Direct direct;
    int64_t layer;
} Call;

static int run_direct(void *context) {
    Call *c = context;
    const float one = 1.0f, zero = 0.0f;
    return direct_call(c->cudnn, c->d, c->op, c->direct.algo, &one, c->a, c->b, &zero, c->out,
                       c->direct.workspace, c->direct.workspace_bytes) != CUDNN_STATUS_SUCCESS;
}

static mucudnnStatus_t mucudnn_call(mucudnnHandle_t mu, const Descriptors *d, int op,
                                    const float *alpha, const float *a, const float *b,
                                    const float *beta, float *out, int64_t layer) {
    switch (op) {
    case FWD:
        return mucudnnConvolutionForward(mu, alpha, d->x, a, d->w, b, d->conv, beta, d->y, out,
                                         layer);
    case BWD_DATA:
        return mucudnnConvolutionBackwardData(mu, alpha, d->w, a, d->y, b, d->conv, beta, d->x,
                                              out, layer);
    default:
        return mucudnnConvolutionBackwardFilter(mu, alpha, d->x, a, d->y, b, d->conv, beta, d->w,
                                                out, layer);
    }
}

static int run_mucudnn(void *context) {
    Call *c = context;
    const float one = 1.0f, zero = 0.0f;
    return mucudnn_call(c->mu, c->d, c->op, &one, c->a, c->b, &zero, c->out, c->layer) !=
           MUCUDNN_STATUS_SUCCESS;
}

static void report(const char *case_name, const char *what, double error, double tolerance,
                   float direct_ms, int direct_algo, float mucudnn_ms, size_t workspace) {
    int ok = error <= tolerance;
    if (!ok) failures++;
    if (direct_ms >= 0) {
        printf("%-38s %-16s %9.2e %-4s %7.3f (algo %d) %9.3f %10zu\n", case_name, what, error,
               ok ? "ok" : "FAIL", direct_ms, direct_algo, mucudnn_ms, workspace);
    } else {
        printf("%-38s %-16s %9.2e %-4s\n", case_name, what, error, ok ? "ok" : "FAIL");
    }
}

static void run_case(const Case *c, int64_t layer, cudnnHandle_t cudnn, cudaStream_t stream,
                     mucudnnHandle_t mu) {
    Descriptors d = make_descriptors(c);
    float *x = device_random(d.x_len), *w = device_random(d.w_len), *dy = device_random(d.y_len);
    float *outs_direct[3], *outs_mu[3];
    size_t lens[3] = {d.y_len, d.x_len, d.w_len};
    const float *as[3] = {x, w, x}, *bs[3] = {w, dy, dy};
    for (int op = 0; op < 3; op++) {
        outs_direct[op] = device_random(lens[op]);
        outs_mu[op] = device_random(lens[op]); /* garbage: beta = 0 must ignore it */
    }
    const float one = 1.0f, zero = 0.0f, half = 0.5f;
    for (int op = 0; op < 3; op++) {
        Call call = {cudnn, mu, &d, op, as[op], bs[op], outs_direct[op], {0, NULL, 0}, layer};
        call.direct = choose_direct(cudnn, &d, op, as[op], bs[op], outs_direct[op]);
        if (call.direct.algo < 0) {
            /* Nothing to compare with: mucudnn can only fail too (no algorithm to plan). */
            mucudnnStatus_t status =
                mucudnn_call(mu, &d, op, &one, as[op], bs[op], &zero, outs_mu[op], layer);
            printf("%-38s %-16s cuDNN runs no legacy algorithm here; mucudnn: %s\n", c->name,
                   OP_NAMES[op], mucudnnGetStatusString(status));
            continue;
        }
        MUCUDNN_OK(mucudnn_call(mu, &d, op, &one, as[op], bs[op], &zero, outs_mu[op], layer));
        double error = relative_error(outs_mu[op], outs_direct[op], lens[op]);
        float direct_ms = time_calls(stream, run_direct, &call);
        Call mu_call = call;
        mu_call.out = outs_mu[op];
        float mucudnn_ms = time_calls(stream, run_mucudnn, &mu_call);
        size_t workspace = 0;
        MUCUDNN_OK(mucudnnGetWorkspaceSize(mu, op, d.x, d.w, d.conv, d.y, &workspace));
        report(c->name, OP_NAMES[op], error, c->tolerance, direct_ms, call.direct.algo,
               mucudnn_ms, workspace);

        /* alpha = 0.5, beta = 1 over the same starting output: out = prev + 0.5 * op(a, b).
         * Backward-filter's later micro-batches accumulate with beta = 1 whatever the caller's
         * beta, so this checks that every micro-batch is summed exactly once. */
        float *blend_direct = device_copy(outs_direct[op], lens[op]);
        float *blend_mu = device_copy(outs_direct[op], lens[op]);
        CUDNN_OK(direct_call(cudnn, &d, op, call.direct.algo, &half, as[op], bs[op], &one,
                             blend_direct, call.direct.workspace, call.direct.workspace_bytes));
        MUCUDNN_OK(mucudnn_call(mu, &d, op, &half, as[op], bs[op], &one, blend_mu, layer));
        char what[32];
        snprintf(what, sizeof what, "%s a=.5 b=1", OP_NAMES[op]);
        report(c->name, what, relative_error(blend_mu, blend_direct, lens[op]), c->tolerance, -1,
               0, 0, 0);
        cudaFree(blend_direct);
        cudaFree(blend_mu);
        cudaFree(call.direct.workspace);
    }
    for (int op = 0; op < 3; op++) {
        cudaFree(outs_direct[op]);
        cudaFree(outs_mu[op]);
    }
    cudaFree(x);
    cudaFree(w);
    cudaFree(dy);
    destroy_descriptors(&d);
}

/* What mucudnn refuses on a GPU, before cuDNN sees it. */
static void error_cases(cudnnHandle_t cudnn, mucudnnHandle_t mu) {
    (void)cudnn;
    printf("\nerror paths:\n");
    Descriptors d = make_descriptors(&CASES[0]);
    float *x = device_random(d.x_len), *w = device_random(d.w_len), *y = device_random(d.y_len);
    const float one = 1.0f, zero = 0.0f;
    float *host_x = calloc(d.x_len, sizeof(float));
    expect_error("host memory as x",
                 mucudnnConvolutionForward(mu, &one, d.x, host_x, d.w, w, d.conv, &zero, d.y, y, 0),
                 MUCUDNN_STATUS_INVALID_ARGUMENT, "pass device memory");
    expect_error("y overlapping x",
                 mucudnnConvolutionForward(mu, &one, d.x, x, d.w, w, d.conv, &zero, d.y,
                                           (float *)x + 1, 0),
                 MUCUDNN_STATUS_INVALID_ARGUMENT, "overlaps");
    expect_error("NULL alpha",
                 mucudnnConvolutionForward(mu, NULL, d.x, x, d.w, w, d.conv, &zero, d.y, y, 0),
                 MUCUDNN_STATUS_INVALID_ARGUMENT, "alpha is NULL");
    expect_error("NULL descriptor",
                 mucudnnConvolutionForward(mu, &one, d.x, x, NULL, w, d.conv, &zero, d.y, y, 0),
                 MUCUDNN_STATUS_INVALID_ARGUMENT, "wDesc");
    /* x and y swapped: y's dims are not what the convolution gives. */
    expect_error("descriptors that do not fit",
                 mucudnnConvolutionForward(mu, &one, d.y, x, d.w, w, d.conv, &zero, d.x, y, 0),
                 MUCUDNN_STATUS_INVALID_ARGUMENT, "");
    /* A tensor with padded rows (a view of a larger tensor). */
    cudnnTensorDescriptor_t strided;
    CUDNN_OK(cudnnCreateTensorDescriptor(&strided));
    const Case *c = &CASES[0];
    CUDNN_OK(cudnnSetTensor4dDescriptorEx(strided, CUDNN_DATA_FLOAT, c->n, c->c, c->h, c->w,
                                          c->c * c->h * (c->w + 1), c->h * (c->w + 1), c->w + 1,
                                          1));
    expect_error("non-packed x",
                 mucudnnConvolutionForward(mu, &one, strided, x, d.w, w, d.conv, &zero, d.y, y, 0),
                 MUCUDNN_STATUS_NOT_SUPPORTED, "not a fully packed");
    expect_error("layer_id -5",
                 mucudnnConvolutionForward(mu, &one, d.x, x, d.w, w, d.conv, &zero, d.y, y, -5),
                 MUCUDNN_STATUS_INVALID_ARGUMENT, "layer_id is -5");
    size_t size;
    expect_error("op 7",
                 mucudnnGetWorkspaceSize(mu, 7, d.x, d.w, d.conv, d.y, &size),
                 MUCUDNN_STATUS_INVALID_ARGUMENT, "op is 7");
    cudnnDestroyTensorDescriptor(strided);
    free(host_x);
    cudaFree(x);
    cudaFree(w);
    cudaFree(y);
    destroy_descriptors(&d);
}

/* The same forward on a second stream, after mucudnnSetStream. */
static void second_stream(cudnnHandle_t cudnn, mucudnnHandle_t mu) {
    cudaStream_t other;
    CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
    MUCUDNN_OK(mucudnnSetStream(mu, other));
    const Case *c = &CASES[1];
    Descriptors d = make_descriptors(c);
    float *x = device_random(d.x_len), *w = device_random(d.w_len);
    float *y_mu = device_random(d.y_len), *y_direct = device_random(d.y_len);
    const float one = 1.0f, zero = 0.0f;
    MUCUDNN_OK(mucudnnConvolutionForward(mu, &one, d.x, x, d.w, w, d.conv, &zero, d.y, y_mu, 1));
    CUDA_OK(cudaStreamSynchronize(other));
    Direct direct = choose_direct(cudnn, &d, FWD, x, w, y_direct);
    if (direct.algo < 0) {
        fprintf(stderr, "no forward algorithm for %s\n", c->name);
        exit(1);
    }
    report(c->name, "fwd, 2nd stream", relative_error(y_mu, y_direct, d.y_len), c->tolerance, -1,
           0, 0, 0);
    cudaFree(direct.workspace);
    cudaFree(x);
    cudaFree(w);
    cudaFree(y_mu);
    cudaFree(y_direct);
    destroy_descriptors(&d);
    MUCUDNN_OK(mucudnnSetStream(mu, NULL));
    CUDA_OK(cudaStreamDestroy(other));
}

int main(void) {
    printf("%s\n", mucudnnGetBuildInfo());
    char *probe = NULL;
    MUCUDNN_OK(mucudnnProbe(&probe));
    printf("probe: %s\n", probe);
    mucudnnFreeString(probe);
    printf("cuDNN this program links: %zu\n", cudnnGetVersion());

    CUDA_OK(cudaSetDevice(0));
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudnnHandle_t cudnn;
    CUDNN_OK(cudnnCreate(&cudnn));
    CUDNN_OK(cudnnSetStream(cudnn, stream));

    mucudnnOptions_t options;
    MUCUDNN_OK(mucudnnOptionsInit(&options));
    options.workspace_limit_bytes = 8u << 20; /* small enough that plans split the batch */
    options.policy = MUCUDNN_POLICY_POWER_OF_TWO;
    options.verbose = getenv("MUCUDNN_VERBOSE") != NULL;
    mucudnnHandle_t mu;
    MUCUDNN_OK(mucudnnCreate(&mu, cudnn, stream, &options));

    printf("\n%-38s %-16s %9s %-4s %17s %9s %10s\n", "case", "op", "rel err", "", "cuDNN ms",
           "mucudnn ms", "workspace");
    int cases = (int)(sizeof CASES / sizeof CASES[0]);
    for (int i = 0; i < cases; i++) run_case(&CASES[i], i, cudnn, stream, mu);
    second_stream(cudnn, mu);
    error_cases(cudnn, mu);

    char *plans = NULL;
    MUCUDNN_OK(mucudnnGetPlansJson(mu, &plans));
    printf("\nplans (mucudnnGetPlansJson):\n%s\n", plans);
    mucudnnFreeString(plans);

    MUCUDNN_OK(mucudnnDestroy(mu));
    expect_error("destroyed handle", mucudnnDestroy(mu), MUCUDNN_STATUS_INVALID_ARGUMENT,
                 "not a live mucudnn handle");
    CUDNN_OK(cudnnDestroy(cudnn));
    CUDA_OK(cudaStreamDestroy(stream));

    printf("\nc_client: %s (%d failure%s)\n", failures ? "FAILED" : "all checks passed", failures,
           failures == 1 ? "" : "s");
    return failures ? 1 : 0;
}
