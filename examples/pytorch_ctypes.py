#!/usr/bin/env python3
"""mucudnn's C ABI from PyTorch, through ctypes: forward and backward of a few convolutions on
torch CUDA tensors, run by mucudnn on PyTorch's current stream, checked against
torch.nn.functional.conv2d and its gradients computed in float64.

    python3 examples/pytorch_ctypes.py [path/to/libmucudnn.so]

The library is the argument, else $MUCUDNN_LIB, else .gpu/c_abi/libmucudnn.so, else
target/release/libmucudnn.so. cuDNN descriptors are made with ctypes calls into the libcudnn
that PyTorch loaded, and passed to mucudnn as they are (the C ABI takes cuDNN's own types).

mucudnn loads libcudnn by the name libcudnn.so, and the handle it is given must come from that
same library. PyTorch's wheel ships only libcudnn.so.9, so a system libcudnn.so would be found
instead (mucudnn refuses two libcudnn in one process). This script therefore restarts itself
once with a directory holding a libcudnn.so link to PyTorch's libcudnn.so.9 first on
LD_LIBRARY_PATH (scripts/gpu/c_abi_check.sh sets that up too).

Exit status 0 when every result is within tolerance of the float64 reference (relative to the
reference's largest magnitude: 1e-4 for fp32 FMA math, 5e-3 with TF32, 2e-2 for fp16, 3e-2 for
bf16).
"""

import ctypes
import json
import os
import sys
import tempfile

RESTARTED = "MUCUDNN_PYTORCH_EXAMPLE_RESTARTED"


def torch_cudnn_dir():
    """The directory of PyTorch's libcudnn.so.9 (the nvidia-cudnn wheel), or None."""
    try:
        import nvidia.cudnn  # noqa: PLC0415 (only its path, before torch is imported)
    except ImportError:
        return os.environ.get("MUCUDNN_CUDNN_DIR")
    for base in list(nvidia.cudnn.__path__):
        lib = os.path.join(base, "lib")
        if os.path.exists(os.path.join(lib, "libcudnn.so.9")):
            return lib
    return os.environ.get("MUCUDNN_CUDNN_DIR")


def ensure_one_libcudnn():
    """Restart with a libcudnn.so link to PyTorch's libcudnn first on LD_LIBRARY_PATH."""
    if os.environ.get(RESTARTED):
        return
    lib = torch_cudnn_dir()
    if lib is None:
        print("note: PyTorch's libcudnn directory not found; using the library path as it is")
        return
    link_dir = os.path.join(tempfile.gettempdir(), "mucudnn-cudnn-link")
    os.makedirs(link_dir, exist_ok=True)
    link = os.path.join(link_dir, "libcudnn.so")
    target = os.path.join(lib, "libcudnn.so.9")
    if not (os.path.islink(link) and os.readlink(link) == target):
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(target, link)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(
        [link_dir, lib] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    )
    env[RESTARTED] = "1"
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


ensure_one_libcudnn()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# ---- the two libraries

c_int, c_int32, c_int64, c_uint32, c_uint64 = (
    ctypes.c_int,
    ctypes.c_int32,
    ctypes.c_int64,
    ctypes.c_uint32,
    ctypes.c_uint64,
)
c_void_p, c_char_p, c_float, c_size_t = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_float, ctypes.c_size_t
byref = ctypes.byref

# cuDNN enums (cudnn_graph.h)
CUDNN_DATA = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 9}
CUDNN_TENSOR_NCHW, CUDNN_TENSOR_NHWC = 0, 1
CUDNN_CROSS_CORRELATION = 1
CUDNN_DEFAULT_MATH, CUDNN_FMA_MATH = 0, 3

# mucudnn (include/mucudnn.h)
MUCUDNN_STATUS_SUCCESS = 0
MUCUDNN_POLICY_POWER_OF_TWO = 1
MUCUDNN_OP_FORWARD, MUCUDNN_OP_BACKWARD_DATA, MUCUDNN_OP_BACKWARD_FILTER = 0, 1, 2


class MucudnnOptions(ctypes.Structure):
    """mucudnnOptions_t, version 1."""

    _fields_ = [
        ("size", c_uint32),
        ("version", c_uint32),
        ("cache_path", c_char_p),
        ("policy", c_int32),
        ("verbose", c_int32),
        ("workspace_limit_bytes", c_uint64),
        ("total_workspace_bytes", c_uint64),
    ]


def find_libmucudnn():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    candidates = sys.argv[1:2] + [
        os.environ.get("MUCUDNN_LIB", ""),
        os.path.join(root, ".gpu", "c_abi", "libmucudnn.so"),
        os.path.join(root, "target", "release", "libmucudnn.so"),
    ]
    for path in candidates:
        if path and os.path.exists(path):
            return os.path.abspath(path)
    sys.exit(f"libmucudnn.so not found (tried {candidates}); build it with cargo build --release")


def load_mucudnn(path):
    lib = ctypes.CDLL(path)
    status = c_int  # mucudnnStatus_t
    signatures = {
        "mucudnnGetVersion": (c_uint32, []),
        "mucudnnGetBuildInfo": (c_char_p, []),
        "mucudnnGetLastError": (c_char_p, []),
        "mucudnnGetStatusString": (c_char_p, [c_int32]),
        "mucudnnFreeString": (None, [c_void_p]),
        "mucudnnProbe": (status, [ctypes.POINTER(c_void_p)]),
        "mucudnnOptionsInit": (status, [ctypes.POINTER(MucudnnOptions)]),
        "mucudnnCreate": (
            status,
            [ctypes.POINTER(c_void_p), c_void_p, c_void_p, ctypes.POINTER(MucudnnOptions)],
        ),
        "mucudnnDestroy": (status, [c_void_p]),
        "mucudnnGetPlansJson": (status, [c_void_p, ctypes.POINTER(c_void_p)]),
        "mucudnnGetWorkspaceSize": (
            status,
            [c_void_p, c_int32, c_void_p, c_void_p, c_void_p, c_void_p, ctypes.POINTER(c_size_t)],
        ),
    }
    conv = [c_void_p] * 10 + [c_int64]  # handle, alpha, desc, a, desc, b, conv, beta, desc, out, layer
    for name in ("mucudnnConvolutionForward", "mucudnnConvolutionBackwardData",
                 "mucudnnConvolutionBackwardFilter"):
        signatures[name] = (status, conv)
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
    return lib


def loaded_libcudnn():
    """The libcudnn.so* file mapped into this process (PyTorch's), from /proc/self/maps."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if os.path.basename(path).startswith("libcudnn.so"):
                found.add(path)
    if len(found) != 1:
        sys.exit(f"expected one libcudnn in this process, found {sorted(found) or 'none'}")
    return found.pop()


class Mucudnn:
    def __init__(self, lib):
        self.lib = lib

    def check(self, status, what):
        if status != MUCUDNN_STATUS_SUCCESS:
            name = self.lib.mucudnnGetStatusString(status).decode()
            message = self.lib.mucudnnGetLastError().decode()
            raise RuntimeError(f"{what}: {name}: {message}")

    def take_string(self, pointer):
        text = ctypes.string_at(pointer.value).decode()
        self.lib.mucudnnFreeString(pointer)
        return text


def cudnn_check(status, what):
    if status != 0:
        raise RuntimeError(f"{what} failed with cuDNN status {status}")


class Descriptors:
    """cuDNN descriptors of one convolution, made through PyTorch's libcudnn."""

    def __init__(self, cudnn, case, x, w, y):
        self.cudnn = cudnn
        self.x, self.w, self.y, self.conv = c_void_p(), c_void_p(), c_void_p(), c_void_p()
        data = CUDNN_DATA[x.dtype]
        fmt = CUDNN_TENSOR_NHWC if case["channels_last"] else CUDNN_TENSOR_NCHW
        cudnn_check(cudnn.cudnnCreateTensorDescriptor(byref(self.x)), "cudnnCreateTensorDescriptor")
        cudnn_check(cudnn.cudnnCreateTensorDescriptor(byref(self.y)), "cudnnCreateTensorDescriptor")
        cudnn_check(cudnn.cudnnCreateFilterDescriptor(byref(self.w)), "cudnnCreateFilterDescriptor")
        cudnn_check(cudnn.cudnnCreateConvolutionDescriptor(byref(self.conv)),
                    "cudnnCreateConvolutionDescriptor")
        cudnn_check(cudnn.cudnnSetTensor4dDescriptor(self.x, fmt, data, *x.shape),
                    "cudnnSetTensor4dDescriptor")
        cudnn_check(cudnn.cudnnSetTensor4dDescriptor(self.y, fmt, data, *y.shape),
                    "cudnnSetTensor4dDescriptor")
        cudnn_check(cudnn.cudnnSetFilter4dDescriptor(self.w, data, fmt, *w.shape),
                    "cudnnSetFilter4dDescriptor")
        p, s, d = case["pad"], case["stride"], case["dilation"]
        cudnn_check(cudnn.cudnnSetConvolution2dDescriptor(self.conv, p, p, s, s, d, d,
                                                          CUDNN_CROSS_CORRELATION, 0),
                    "cudnnSetConvolution2dDescriptor")
        cudnn_check(cudnn.cudnnSetConvolutionGroupCount(self.conv, case["groups"]),
                    "cudnnSetConvolutionGroupCount")
        cudnn_check(cudnn.cudnnSetConvolutionMathType(self.conv, case["math"]),
                    "cudnnSetConvolutionMathType")

    def destroy(self):
        self.cudnn.cudnnDestroyTensorDescriptor(self.x)
        self.cudnn.cudnnDestroyTensorDescriptor(self.y)
        self.cudnn.cudnnDestroyFilterDescriptor(self.w)
        self.cudnn.cudnnDestroyConvolutionDescriptor(self.conv)


CASES = [
    dict(name="fp32 nchw fma 5x5", n=64, c=96, hw=27, k=256, r=5, pad=2, stride=1, dilation=1,
         groups=1, dtype=torch.float32, channels_last=False, math=CUDNN_FMA_MATH, tol=1e-4),
    dict(name="fp32 nchw tf32 grouped strided dilated", n=32, c=32, hw=20, k=64, r=3, pad=2,
         stride=2, dilation=2, groups=4, dtype=torch.float32, channels_last=False,
         math=CUDNN_DEFAULT_MATH, tol=5e-3),
    dict(name="fp16 nhwc 3x3", n=32, c=64, hw=28, k=64, r=3, pad=1, stride=1, dilation=1,
         groups=1, dtype=torch.float16, channels_last=True, math=CUDNN_DEFAULT_MATH, tol=2e-2),
    dict(name="bf16 nchw 1x1 stride 2", n=32, c=64, hw=28, k=128, r=1, pad=0, stride=2,
         dilation=1, groups=1, dtype=torch.bfloat16, channels_last=False,
         math=CUDNN_DEFAULT_MATH, tol=3e-2),
]


def relative_error(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def time_ms(function, iterations=10):
    function()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iterations):
        function()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iterations


def run_case(mu, cudnn, handle, case, layer):
    device = torch.device("cuda")
    memory_format = torch.channels_last if case["channels_last"] else torch.contiguous_format
    generator = torch.Generator(device=device).manual_seed(layer)

    def tensor(*shape):
        t = torch.randn(*shape, device=device, generator=generator).to(case["dtype"])
        return t.contiguous(memory_format=memory_format)

    n, c, hw, k, r, g = case["n"], case["c"], case["hw"], case["k"], case["r"], case["groups"]
    conv_args = dict(stride=case["stride"], padding=case["pad"], dilation=case["dilation"],
                     groups=g)
    x, w = tensor(n, c, hw, hw), tensor(k, c // g, r, r)
    # The float64 reference, on the same (rounded) inputs.
    xr = x.double().requires_grad_()
    wr = w.double().requires_grad_()
    yr = F.conv2d(xr, wr, **conv_args)
    dy = tensor(*yr.shape)
    dxr, dwr = torch.autograd.grad(yr, (xr, wr), dy.double())

    y = torch.full_like(yr, float("nan"), dtype=case["dtype"]).contiguous(memory_format=memory_format)
    dx = torch.full_like(x, float("nan"))
    dw = torch.full_like(w, float("nan"))
    d = Descriptors(cudnn, case, x, w, y)
    one, zero = c_float(1.0), c_float(0.0)

    def forward():
        mu.check(mu.lib.mucudnnConvolutionForward(handle, byref(one), d.x, x.data_ptr(), d.w,
                                                  w.data_ptr(), d.conv, byref(zero), d.y,
                                                  y.data_ptr(), layer),
                 f"{case['name']} forward")

    def backward_data():
        mu.check(mu.lib.mucudnnConvolutionBackwardData(handle, byref(one), d.w, w.data_ptr(),
                                                       d.y, dy.data_ptr(), d.conv, byref(zero),
                                                       d.x, dx.data_ptr(), layer),
                 f"{case['name']} backward data")

    def backward_filter():
        mu.check(mu.lib.mucudnnConvolutionBackwardFilter(handle, byref(one), d.x, x.data_ptr(),
                                                         d.y, dy.data_ptr(), d.conv,
                                                         byref(zero), d.w, dw.data_ptr(), layer),
                 f"{case['name']} backward filter")

    rows = []
    previous_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = case["math"] != CUDNN_FMA_MATH
    try:
        for op, run, got, want, torch_run in [
            ("fwd", forward, y, yr, lambda: F.conv2d(x, w, **conv_args)),
            ("bwd_data", backward_data, dx, dxr,
             lambda: torch.ops.aten.convolution_backward(
                 dy, x, w, None, [case["stride"]] * 2, [case["pad"]] * 2,
                 [case["dilation"]] * 2, False, [0, 0], g, [True, False, False])),
            ("bwd_filter", backward_filter, dw, dwr,
             lambda: torch.ops.aten.convolution_backward(
                 dy, x, w, None, [case["stride"]] * 2, [case["pad"]] * 2,
                 [case["dilation"]] * 2, False, [0, 0], g, [False, True, False])),
        ]:
            run()  # tunes on first sight, then runs
            torch.cuda.synchronize()
            error = relative_error(got, want)
            workspace = c_size_t(0)
            op_code = {"fwd": 0, "bwd_data": 1, "bwd_filter": 2}[op]
            mu.check(mu.lib.mucudnnGetWorkspaceSize(handle, op_code, d.x, d.w, d.conv, d.y,
                                                    byref(workspace)), "workspace size")
            rows.append((case["name"], op, error, error <= case["tol"], time_ms(torch_run),
                         time_ms(run), workspace.value))
    finally:
        torch.backends.cudnn.allow_tf32 = previous_tf32
        d.destroy()
    return rows


def main():
    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to PyTorch")
    torch.backends.cuda.matmul.allow_tf32 = False
    # Load PyTorch's cuDNN (a tiny convolution), then open that same library with ctypes.
    F.conv2d(torch.ones(1, 1, 3, 3, device="cuda"), torch.ones(1, 1, 1, 1, device="cuda"))
    cudnn_path = loaded_libcudnn()
    cudnn = ctypes.CDLL(cudnn_path)
    cudnn.cudnnGetVersion.restype = c_size_t

    mu = Mucudnn(load_mucudnn(find_libmucudnn()))
    print(mu.lib.mucudnnGetBuildInfo().decode())
    print(f"PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()} "
          f"({cudnn_path}, cudnnGetVersion {cudnn.cudnnGetVersion()})")
    probe = c_void_p()
    mu.check(mu.lib.mucudnnProbe(byref(probe)), "mucudnnProbe")
    info = json.loads(mu.take_string(probe))
    print(f"mucudnn sees cuDNN {info['cudnn_version']}, "
          f"{[dev['name'] for dev in info['devices']]}")
    if info["cudnn_version"] != cudnn.cudnnGetVersion():
        sys.exit("mucudnn loaded another libcudnn than PyTorch's: see this file's docstring")

    cudnn_handle = c_void_p()
    cudnn_check(cudnn.cudnnCreate(byref(cudnn_handle)), "cudnnCreate")
    stream = c_void_p(torch.cuda.current_stream().cuda_stream)
    options = MucudnnOptions()
    mu.check(mu.lib.mucudnnOptionsInit(byref(options)), "mucudnnOptionsInit")
    options.workspace_limit_bytes = 8 << 20  # small enough that plans split the batch
    options.policy = MUCUDNN_POLICY_POWER_OF_TWO
    options.verbose = int(bool(os.environ.get("MUCUDNN_VERBOSE")))
    handle = c_void_p()
    mu.check(mu.lib.mucudnnCreate(byref(handle), cudnn_handle, stream, byref(options)),
             "mucudnnCreate")

    rows = []
    try:
        for layer, case in enumerate(CASES):
            rows += run_case(mu, cudnn, handle, case, layer)
        plans = c_void_p()
        mu.check(mu.lib.mucudnnGetPlansJson(handle, byref(plans)), "mucudnnGetPlansJson")
        document = json.loads(mu.take_string(plans))
    finally:
        mu.check(mu.lib.mucudnnDestroy(handle), "mucudnnDestroy")
        cudnn.cudnnDestroy(cudnn_handle)

    print(f"\n{'case':<40} {'op':<11} {'max rel err':>11} {'':4} {'torch ms':>9} "
          f"{'mucudnn ms':>10} {'workspace':>10}")
    for name, op, error, ok, torch_ms, mucudnn_ms, workspace in rows:
        print(f"{name:<40} {op:<11} {error:11.2e} {'ok' if ok else 'FAIL':4} {torch_ms:9.3f} "
              f"{mucudnn_ms:10.3f} {workspace:10d}")
    print("\nplans (mucudnnGetPlansJson):")
    for plan in document["plans"]:
        split = "+".join(f"{m['size']}@algo{m['algo']}" for m in plan["micro_batches"])
        undivided = plan["undivided_ms"]
        print(f"  {plan['layer']:<8} {plan['dtype']} {plan['layout']} {plan['op']:<10} "
              f"{plan['time_ms']:8.3f} ms predicted (undivided "
              f"{'-' if undivided is None else f'{undivided:.3f}'} ms)  {split}")
    failed = [row for row in rows if not row[3]]
    print(f"\npytorch_ctypes: {'FAILED' if failed else 'all results within tolerance'} "
          f"({len(rows) - len(failed)}/{len(rows)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
