/*
 * The C ABI from C, without a GPU: version and build info, mucudnnSolveProfile on a recorded
 * profile, the error paths (NULL and stale handles, NULL pointers, garbage descriptors behind
 * a bad handle, bad JSON, bad options, invalid UTF-8), mucudnnCreate without CUDA/cuDNN
 * (MUCUDNN_STATUS_NOT_AVAILABLE), thread-local last errors, and mucudnnFreeString.
 *
 * Built and run by tests/c_abi.rs:  abi_test PROFILE.json
 * Exit status 0 when every check passes; the first failed check is printed and exits 1.
 */
#include "mucudnn.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int checks = 0;

#define CHECK(cond)                                                                         \
    do {                                                                                    \
        checks++;                                                                           \
        if (!(cond)) {                                                                      \
            fprintf(stderr, "%s:%d: check failed: %s\n  last error: %s\n", __FILE__,         \
                    __LINE__, #cond, mucudnnGetLastError());                                \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

#define CHECK_STATUS(call, expected)                                                        \
    do {                                                                                    \
        mucudnnStatus_t status_ = (call);                                                   \
        checks++;                                                                           \
        if (status_ != (expected)) {                                                        \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s\n  last error: %s\n",       \
                    __FILE__, __LINE__, #call, mucudnnGetStatusString(status_),             \
                    mucudnnGetStatusString(expected), mucudnnGetLastError());               \
            exit(1);                                                                        \
        }                                                                                   \
    } while (0)

static char *read_file(const char *path) {
    FILE *file = fopen(path, "rb");
    if (!file) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(1);
    }
    fseek(file, 0, SEEK_END);
    long size = ftell(file);
    fseek(file, 0, SEEK_SET);
    char *text = malloc((size_t)size + 1);
    if (!text || fread(text, 1, (size_t)size, file) != (size_t)size) {
        fprintf(stderr, "cannot read %s\n", path);
        exit(1);
    }
    text[size] = '\0';
    fclose(file);
    return text;
}

static int count(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = strstr(text, needle); p; p = strstr(p + 1, needle)) {
        n++;
    }
    return n;
}

static int contains(const char *text, const char *needle) {
    return strstr(text, needle) != NULL;
}

static void test_info(void) {
    CHECK(mucudnnGetVersion() == MUCUDNN_VERSION);
    const char *info = mucudnnGetBuildInfo();
    CHECK(info != NULL && strncmp(info, "mucudnn ", 8) == 0);
    CHECK(contains(info, "cudarc 0.19"));
    printf("version %u: %s\n", mucudnnGetVersion(), info);
    CHECK(strcmp(mucudnnGetStatusString(MUCUDNN_STATUS_SUCCESS), "MUCUDNN_STATUS_SUCCESS") == 0);
    CHECK(strcmp(mucudnnGetStatusString(MUCUDNN_STATUS_BAD_PROFILE),
                 "MUCUDNN_STATUS_BAD_PROFILE") == 0);
    CHECK(strcmp(mucudnnGetStatusString(42), "MUCUDNN_STATUS_UNKNOWN") == 0);
}

static void test_solve(const char *profile) {
    char *plans = NULL;
    CHECK_STATUS(mucudnnSolveProfile(profile, "{\"workspace_limit\": \"64MiB\"}", &plans),
                 MUCUDNN_STATUS_SUCCESS);
    CHECK(plans != NULL);
    CHECK(strcmp(mucudnnGetLastError(), "") == 0);
    CHECK(contains(plans, "\"mode\": \"wr\""));
    CHECK(contains(plans, "\"policy\": \"power-of-two\""));
    CHECK(count(plans, "\"layer\":") == 30);
    CHECK(contains(plans, "\"total_workspace_bytes\""));
    printf("mucudnnSolveProfile: %d plans, %zu bytes of JSON\n", count(plans, "\"layer\":"),
           strlen(plans));
    mucudnnFreeString(plans);

    /* NULL options: the defaults (power-of-two, 64 MiB per layer). */
    plans = NULL;
    CHECK_STATUS(mucudnnSolveProfile(profile, NULL, &plans), MUCUDNN_STATUS_SUCCESS);
    CHECK(count(plans, "\"layer\":") == 30);
    mucudnnFreeString(plans);

    /* Workspace division, sizes as numbers. */
    plans = NULL;
    CHECK_STATUS(mucudnnSolveProfile(profile,
                                     "{\"policy\": \"all\", \"total_workspace\": 1073741824}",
                                     &plans),
                 MUCUDNN_STATUS_SUCCESS);
    CHECK(contains(plans, "\"mode\": \"wd\""));
    mucudnnFreeString(plans);
    mucudnnFreeString(NULL);
}

static void test_solve_errors(const char *profile) {
    char *plans = (char *)1;
    /* Bad JSON and bad profiles. */
    CHECK_STATUS(mucudnnSolveProfile("{\"format\": ", NULL, &plans), MUCUDNN_STATUS_BAD_PROFILE);
    CHECK(plans == NULL);
    CHECK(contains(mucudnnGetLastError(), "mucudnnSolveProfile: bad profile"));
    CHECK_STATUS(mucudnnSolveProfile("{\"format\": \"mucudnn-profile-v1\", \"records\": []}",
                                     NULL, &plans),
                 MUCUDNN_STATUS_BAD_PROFILE);
    CHECK(contains(mucudnnGetLastError(), "no measurements"));
    /* Bad options. */
    CHECK_STATUS(mucudnnSolveProfile(profile, "{\"workspace_limit\": \"64MB\"}", &plans),
                 MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK(contains(mucudnnGetLastError(), "ambiguous"));
    CHECK_STATUS(mucudnnSolveProfile(profile, "{\"workspace\": 1}", &plans),
                 MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK(contains(mucudnnGetLastError(), "unknown key `workspace`"));
    CHECK_STATUS(mucudnnSolveProfile(profile, "[]", &plans), MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(mucudnnSolveProfile(profile, "{\"policy\": \"pow2\"}", &plans),
                 MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(
        mucudnnSolveProfile(profile, "{\"workspace_limit\": 1, \"total_workspace\": 1}", &plans),
        MUCUDNN_STATUS_INVALID_ARGUMENT);
    /* No plan fits: a solver error naming the smallest limit that works. */
    const char *needs_1000 =
        "{\"format\": \"mucudnn-profile-v1\", \"records\": [{\"layer\": \"l\", \"dtype\": "
        "\"fp32\", \"layout\": \"nchw\", \"n\": 4, \"c\": 2, \"h\": 5, \"w\": 5, \"k\": 2, "
        "\"r\": 3, \"s\": 3, \"pad_h\": 0, \"pad_w\": 0, \"stride_h\": 1, \"stride_w\": 1, "
        "\"dilation_h\": 1, \"dilation_w\": 1, \"groups\": 1, \"op\": \"fwd\", \"algo\": 1, "
        "\"micro\": 4, \"workspace_bytes\": 1000, \"time_ms\": 0.5}]}";
    CHECK_STATUS(mucudnnSolveProfile(needs_1000, "{\"workspace_limit\": 10}", &plans),
                 MUCUDNN_STATUS_SOLVER_ERROR);
    CHECK(contains(mucudnnGetLastError(), "smallest limit that works is 1000 B"));
    /* NULL pointers and invalid UTF-8. */
    CHECK_STATUS(mucudnnSolveProfile(NULL, NULL, &plans), MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK(strcmp(mucudnnGetLastError(), "mucudnnSolveProfile: profile_json is NULL") == 0);
    CHECK_STATUS(mucudnnSolveProfile(profile, NULL, NULL), MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(mucudnnSolveProfile("\xff\xfe", NULL, &plans), MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK(contains(mucudnnGetLastError(), "not valid UTF-8"));
    CHECK_STATUS(mucudnnSolveProfile(profile, "{\"policy\": \"\xc3\"}", &plans),
                 MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK(plans == NULL);
}

static void test_options(void) {
    mucudnnOptions_t options;
    memset(&options, 0xab, sizeof options);
    CHECK_STATUS(mucudnnOptionsInit(&options), MUCUDNN_STATUS_SUCCESS);
    CHECK(options.size == sizeof(mucudnnOptions_t));
    CHECK(options.version == MUCUDNN_OPTIONS_VERSION);
    CHECK(options.cache_path == NULL);
    CHECK(options.policy == MUCUDNN_POLICY_POWER_OF_TWO);
    CHECK(options.verbose == 0);
    CHECK(options.workspace_limit_bytes == MUCUDNN_DEFAULT_WORKSPACE_LIMIT);
    CHECK(options.workspace_limit_bytes == 64u << 20);
    CHECK(options.total_workspace_bytes == MUCUDNN_NO_LIMIT);
    CHECK_STATUS(mucudnnOptionsInit(NULL), MUCUDNN_STATUS_INVALID_ARGUMENT);
}

/* Handles without a GPU: every handle call refuses NULL and stale handles before touching the
 * (garbage) descriptors and pointers it was given. */
static void test_handles(int gpu_present) {
    mucudnnCudnnHandle_t fake_cudnn = (mucudnnCudnnHandle_t)(uintptr_t)0x10;
    mucudnnHandle_t handle = (mucudnnHandle_t)(uintptr_t)1;
    mucudnnOptions_t options;
    mucudnnOptionsInit(&options);

    CHECK_STATUS(mucudnnCreate(NULL, fake_cudnn, NULL, NULL), MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK_STATUS(mucudnnCreate(&handle, NULL, NULL, NULL), MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK(handle == NULL);
    CHECK(contains(mucudnnGetLastError(), "cuDNN handle is NULL"));
    options.policy = 9;
    CHECK_STATUS(mucudnnCreate(&handle, fake_cudnn, NULL, &options),
                 MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK(contains(mucudnnGetLastError(), "options->policy is 9"));
    mucudnnOptionsInit(&options);
    options.size = 4;
    CHECK_STATUS(mucudnnCreate(&handle, fake_cudnn, NULL, &options),
                 MUCUDNN_STATUS_INVALID_ARGUMENT);
    mucudnnOptionsInit(&options);
    options.version = MUCUDNN_OPTIONS_VERSION + 1;
    CHECK_STATUS(mucudnnCreate(&handle, fake_cudnn, NULL, &options),
                 MUCUDNN_STATUS_INVALID_ARGUMENT);
    mucudnnOptionsInit(&options);
    options.cache_path = "\xff";
    CHECK_STATUS(mucudnnCreate(&handle, fake_cudnn, NULL, &options),
                 MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK(contains(mucudnnGetLastError(), "cache_path is not valid UTF-8"));

    if (!gpu_present) {
        /* Without CUDA or cuDNN the fake cuDNN handle is never touched. */
        mucudnnOptionsInit(&options);
        options.cache_path = "/tmp/mucudnn-c-abi-test.sqlite";
        handle = (mucudnnHandle_t)(uintptr_t)1;
        CHECK_STATUS(mucudnnCreate(&handle, fake_cudnn, NULL, &options),
                     MUCUDNN_STATUS_NOT_AVAILABLE);
        CHECK(handle == NULL);
        CHECK(strncmp(mucudnnGetLastError(), "mucudnnCreate: ", 15) == 0);
        CHECK(strlen(mucudnnGetLastError()) > 40); /* says what is missing */
        printf("mucudnnCreate without a GPU: %s\n", mucudnnGetLastError());
    } else {
        printf("a GPU is present: the real handle is exercised by examples/c_client.c\n");
    }

    /* NULL, and never-created, handles with garbage descriptors and pointers. */
    void *garbage = (void *)(uintptr_t)0x1234;
    mucudnnTensorDescriptor_t bad_tensor = (mucudnnTensorDescriptor_t)garbage;
    mucudnnFilterDescriptor_t bad_filter = (mucudnnFilterDescriptor_t)garbage;
    mucudnnConvolutionDescriptor_t bad_conv = (mucudnnConvolutionDescriptor_t)garbage;
    float one = 1.0f, zero = 0.0f;
    mucudnnHandle_t bad_handles[2] = {NULL, (mucudnnHandle_t)(uintptr_t)0x40};
    for (int i = 0; i < 2; i++) {
        mucudnnHandle_t h = bad_handles[i];
        CHECK_STATUS(mucudnnConvolutionForward(h, &one, bad_tensor, garbage, bad_filter, garbage,
                                               bad_conv, &zero, bad_tensor, garbage, -1),
                     MUCUDNN_STATUS_INVALID_ARGUMENT);
        CHECK(contains(mucudnnGetLastError(), i == 0 ? "handle is NULL"
                                                     : "is not a live mucudnn handle"));
        CHECK_STATUS(mucudnnConvolutionForward(h, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                               NULL, 0),
                     MUCUDNN_STATUS_INVALID_ARGUMENT);
        CHECK_STATUS(mucudnnConvolutionBackwardData(h, &one, bad_filter, garbage, bad_tensor,
                                                    garbage, bad_conv, &zero, bad_tensor,
                                                    garbage, 3),
                     MUCUDNN_STATUS_INVALID_ARGUMENT);
        CHECK_STATUS(mucudnnConvolutionBackwardFilter(h, &one, bad_tensor, garbage, bad_tensor,
                                                      garbage, bad_conv, &zero, bad_filter,
                                                      garbage, 3),
                     MUCUDNN_STATUS_INVALID_ARGUMENT);
        size_t size = 99;
        CHECK_STATUS(mucudnnGetWorkspaceSize(h, MUCUDNN_OP_FORWARD, bad_tensor, bad_filter,
                                             bad_conv, bad_tensor, &size),
                     MUCUDNN_STATUS_INVALID_ARGUMENT);
        CHECK(size == 0);
        char *json = (char *)1;
        CHECK_STATUS(mucudnnGetPlansJson(h, &json), MUCUDNN_STATUS_INVALID_ARGUMENT);
        CHECK(json == NULL);
        CHECK_STATUS(mucudnnSetStream(h, NULL), MUCUDNN_STATUS_INVALID_ARGUMENT);
        CHECK_STATUS(mucudnnDestroy(h), MUCUDNN_STATUS_INVALID_ARGUMENT);
    }
}

static void *other_thread(void *unused) {
    (void)unused;
    /* A fresh thread has no message; its failures do not touch the main thread's. */
    int ok = strcmp(mucudnnGetLastError(), "") == 0;
    char *out = NULL;
    ok = ok && mucudnnSolveProfile(NULL, NULL, &out) == MUCUDNN_STATUS_INVALID_ARGUMENT;
    ok = ok && contains(mucudnnGetLastError(), "profile_json is NULL");
    return ok ? (void *)1 : NULL;
}

static void test_threads(void) {
    char *out = NULL;
    CHECK_STATUS(mucudnnSolveProfile("{", NULL, &out), MUCUDNN_STATUS_BAD_PROFILE);
    char before[256];
    snprintf(before, sizeof before, "%s", mucudnnGetLastError());
    pthread_t thread;
    void *result = NULL;
    CHECK(pthread_create(&thread, NULL, other_thread, NULL) == 0);
    CHECK(pthread_join(thread, &result) == 0);
    CHECK(result == (void *)1);
    CHECK(strcmp(mucudnnGetLastError(), before) == 0);
}

/* A CPU tuner from C: tune a tiny 1x1 problem, prepare its plans, run the forward over host
 * arrays with the operands' dims and extents, and see operands of another shape refused before
 * anything is read or written. */
static void test_tuner_execute(void) {
    mucudnnTuner_t tuner = NULL;
    CHECK_STATUS(mucudnnTunerCreate(&tuner, MUCUDNN_DEVICE_CPU, "{\"no_cache\": true}"),
                 MUCUDNN_STATUS_SUCCESS);
    const char *problem = "{\"n\": 2, \"c\": 2, \"h\": 3, \"w\": 3, \"k\": 2, \"r\": 1, "
                          "\"s\": 1, \"pad_h\": 0, \"pad_w\": 0, \"stride_h\": 1, "
                          "\"stride_w\": 1, \"dilation_h\": 1, \"dilation_w\": 1, "
                          "\"groups\": 1, \"dtype\": \"fp32\", \"layout\": \"nchw\", "
                          "\"math\": \"default\"}";
    char *result = NULL;
    CHECK_STATUS(mucudnnTunerTune(tuner, "c.tiny", problem, "{\"deterministic\": true}", &result),
                 MUCUDNN_STATUS_SUCCESS);
    /* {"plans": [...], "splits": ...}: the plans array is what prepare takes. */
    const char *start = strstr(result, "[");
    const char *end = strstr(result, ",\"splits\"");
    CHECK(start != NULL && end != NULL && end > start);
    size_t length = (size_t)(end - start);
    char *plans = malloc(length + 1);
    memcpy(plans, start, length);
    plans[length] = '\0';
    uint64_t set = 0, workspace_bytes[3] = {0, 0, 0};
    CHECK_STATUS(mucudnnTunerPrepare(tuner, plans, &set, workspace_bytes), MUCUDNN_STATUS_SUCCESS);
    float *workspace = calloc(workspace_bytes[0] / 4 + 1, 4);
    float x[36], w[4] = {1.0f, 0.0f, 0.5f, 2.0f}, y[36];
    for (int i = 0; i < 36; i++) {
        x[i] = (float)i;
        y[i] = -1.0f;
    }
    /* N, C, D, H, W per operand (a filter K, C/groups, T, R, S); D = T = 1 in 2-D. */
    int64_t dims[15] = {2, 2, 1, 3, 3, 2, 2, 1, 1, 1, 2, 2, 1, 3, 3};
    uint64_t bytes[3] = {sizeof x, sizeof w, sizeof y};
    CHECK_STATUS(mucudnnTunerExecute(tuner, set, MUCUDNN_OP_FORWARD, 1.0f, x, w, 0.0f, y, dims,
                                     bytes, workspace, workspace_bytes[0], NULL),
                 MUCUDNN_STATUS_SUCCESS);
    CHECK(y[0] == 0.0f && y[9] == 0.5f * 0.0f + 2.0f * 9.0f && y[18 + 4] == 22.0f);
    /* A pruned weight (one filter) against the plan for two; a buffer too small for x. */
    int64_t pruned[15] = {2, 2, 1, 3, 3, 1, 2, 1, 1, 1, 2, 2, 1, 3, 3};
    y[0] = -7.0f;
    CHECK_STATUS(mucudnnTunerExecute(tuner, set, MUCUDNN_OP_FORWARD, 1.0f, x, w, 0.0f, y, pruned,
                                     bytes, workspace, workspace_bytes[0], NULL),
                 MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK(contains(mucudnnGetLastError(), "c.tiny fwd: w is [1, 2, 1, 1, 1]"));
    uint64_t small[3] = {sizeof x / 2, sizeof w, sizeof y};
    CHECK_STATUS(mucudnnTunerExecute(tuner, set, MUCUDNN_OP_FORWARD, 1.0f, x, w, 0.0f, y, dims,
                                     small, workspace, workspace_bytes[0], NULL),
                 MUCUDNN_STATUS_INVALID_ARGUMENT);
    CHECK(contains(mucudnnGetLastError(), "x holds 72 bytes"));
    CHECK(y[0] == -7.0f);
    free(workspace);
    free(plans);
    mucudnnFreeString(result);
    CHECK_STATUS(mucudnnTunerDestroy(tuner), MUCUDNN_STATUS_SUCCESS);
}

/* Tuners are tokens, not addresses: a destroyed tuner stays refused after another is made
 * (which may well get the old one's memory), and made-up values never reach a live tuner. */
static void test_stale_tuners(void) {
    for (int round = 0; round < 20; round++) {
        mucudnnTuner_t first = NULL, second = NULL;
        CHECK_STATUS(mucudnnTunerCreate(&first, MUCUDNN_DEVICE_CPU, "{\"no_cache\": true}"),
                     MUCUDNN_STATUS_SUCCESS);
        CHECK_STATUS(mucudnnTunerDestroy(first), MUCUDNN_STATUS_SUCCESS);
        CHECK_STATUS(mucudnnTunerCreate(&second, MUCUDNN_DEVICE_CPU, "{\"no_cache\": true}"),
                     MUCUDNN_STATUS_SUCCESS);
        CHECK(first != second);
        char *json = NULL;
        CHECK_STATUS(mucudnnTunerGetFingerprint(first, &json), MUCUDNN_STATUS_INVALID_ARGUMENT);
        CHECK(json == NULL);
        CHECK(contains(mucudnnGetLastError(), "is not a live mucudnn tuner"));
        CHECK_STATUS(mucudnnTunerDestroy(first), MUCUDNN_STATUS_INVALID_ARGUMENT);
        CHECK_STATUS(mucudnnTunerGetFingerprint(second, &json), MUCUDNN_STATUS_SUCCESS);
        mucudnnFreeString(json);
        /* Made-up values near and far from the live one. */
        uint64_t seed = 0x9e3779b97f4a7c15ull * (uint64_t)(round + 1);
        for (int i = 0; i < 200; i++) {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            uintptr_t made_up = i < 100 ? (uintptr_t)seed : (uintptr_t)second + (uintptr_t)(i - 99);
            if (made_up == (uintptr_t)second) continue;
            CHECK_STATUS(mucudnnTunerRelease((mucudnnTuner_t)made_up, 0),
                         MUCUDNN_STATUS_INVALID_ARGUMENT);
        }
        CHECK_STATUS(mucudnnTunerDestroy(second), MUCUDNN_STATUS_SUCCESS);
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s PROFILE.json\n", argv[0]);
        return 2;
    }
    char *profile = read_file(argv[1]);

    test_info();

    char *probe = NULL;
    mucudnnStatus_t probed = mucudnnProbe(&probe);
    int gpu_present = probed == MUCUDNN_STATUS_SUCCESS;
    if (gpu_present) {
        printf("mucudnnProbe: %s\n", probe);
        mucudnnFreeString(probe);
    } else {
        CHECK(probed == MUCUDNN_STATUS_NOT_AVAILABLE);
        CHECK(probe == NULL);
        printf("mucudnnProbe: %s: %s\n", mucudnnGetStatusString(probed), mucudnnGetLastError());
    }

    test_solve(profile);
    test_solve_errors(profile);
    test_options();
    test_handles(gpu_present);
    test_threads();
    test_tuner_execute();
    test_stale_tuners();

    free(profile);
    printf("c abi test: %d checks passed\n", checks);
    return 0;
}
