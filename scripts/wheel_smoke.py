#!/usr/bin/env python3
"""The installed wheel, with nothing else: imports ``mucudnn`` (no torch, no NumPy), checks
that its library is the package's own build (same version), tunes one small convolution on the
CPU backend, executes the forward plan and compares it with a float64 reference written here.
Run by scripts/test.sh in a fresh virtualenv with no cargo on PATH, from outside the repository
(so that the installed package is the one imported). Exit status 0 when all of that holds."""

import array
import sys

import mucudnn
from mucudnn import Settings, Tuner, operand_extents, problem

N, C, H, W, K, R, S = 3, 2, 6, 5, 4, 3, 3
PAD = 1


def reference(x, w):
    """Cross-correlation, NCHW, stride 1, padding PAD, in float64."""
    p, q = H + 2 * PAD - R + 1, W + 2 * PAD - S + 1
    y = [0.0] * (N * K * p * q)
    for n in range(N):
        for k in range(K):
            for i in range(p):
                for j in range(q):
                    total = 0.0
                    for c in range(C):
                        for r in range(R):
                            for s in range(S):
                                hh, ww = i + r - PAD, j + s - PAD
                                if 0 <= hh < H and 0 <= ww < W:
                                    total += (x[((n * C + c) * H + hh) * W + ww]
                                              * w[((k * C + c) * R + r) * S + s])
                    y[((n * K + k) * p + i) * q + j] = total
    return y


def main():
    location = mucudnn.__file__
    if "/python/mucudnn/" in location:
        sys.exit(f"imported the repository's python/mucudnn ({location}), not the wheel")
    library = mucudnn.library_path()
    print(f"mucudnn {mucudnn.__version__} from {location}; library {library}, "
          f"version {mucudnn.version()}, ABI {mucudnn.abi_version()}")
    if mucudnn.version() != mucudnn.__version__:
        sys.exit(f"the library says {mucudnn.version()}, the package {mucudnn.__version__}")
    if mucudnn.abi_version() != mucudnn.__abi_version__:
        sys.exit(f"the library's C ABI is {mucudnn.abi_version()}, the package calls "
                 f"{mucudnn.__abi_version__}")

    tuner = Tuner(cache=False)
    spec = problem(n=N, c=C, h=H, w=W, k=K, r=R, s=S, padding=(PAD, PAD))
    result = tuner.tune("wheel.conv", spec, Settings(workspace_limit=1 << 20))
    plans = result["plans"]
    assert [p["op"] for p in plans] == ["fwd", "bwd_data", "bwd_filter"], plans
    assert all(sum(m["size"] for m in p["micro_batches"]) == N for p in plans), plans
    prepared = tuner.prepare(plans)

    x = array.array("f", [((i * 37) % 19 - 9) / 9 for i in range(N * C * H * W)])
    w = array.array("f", [((i * 11) % 13 - 6) / 6 for i in range(K * C * R * S)])
    expected = reference(x, w)
    out = array.array("f", [float("nan")] * len(expected))
    workspace = array.array("B", bytes(max(prepared.workspace) + 16))
    address = lambda a: a.buffer_info()[0]  # noqa: E731
    p, q = H + 2 * PAD - R + 1, W + 2 * PAD - S + 1
    extents = operand_extents(0, (N, C, H, W), (K, C, R, S), (N, K, p, q), x.itemsize)
    tuner.execute(prepared.id, 0, address(x), address(w), address(out), extents,
                  workspace=address(workspace), workspace_bytes=prepared.workspace[0])
    scale = max(abs(v) for v in expected)
    error = max(abs(a - b) for a, b in zip(out, expected)) / scale
    forward = plans[0]["micro_batches"]
    print(f"tuned {N}x{C}x{H}x{W} * {K}x{C}x{R}x{S}: forward plan "
          f"{[(m['size'], m.get('algo')) for m in forward]}, relative error {error:.2e}")
    if not error <= 1e-5:
        sys.exit(f"the forward result is off by {error:.2e} (relative)")
    prepared.release()
    tuner.close()
    print("the wheel works")


if __name__ == "__main__":
    main()
