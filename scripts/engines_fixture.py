#!/usr/bin/env python3
"""Converts the raw graph-API engine probe (../shared/data/h100-engines-3layers.json: records of
layer, dtype, op, n, micro, plan, ws, ms) into mucudnn's profile interchange format, with each
configuration's frontend plan name as the record's `engine`.

    python3 scripts/engines_fixture.py RAW.json OUT.json [--pareto]

--pareto keeps, per (layer, dtype, op, micro), only the configurations that no other one at
that size beats on both workspace and time (ties kept): no solver can choose the others, so
every plan and total solved from the trimmed file equals the one solved from the full file
(tests/engines.rs checks this when the full file is present). The trimmed file is the test
fixture tests/fixtures/h100-engines-3layers-pareto.json.
"""
import json
import sys

# The full shapes (as in src/models.rs and the legacy fixture): c, h, w, k, r, s, pad, stride.
SHAPES = {
    "alexnet.conv2": (96, 27, 27, 256, 5, 5, 2, 1),
    "alexnet.conv3": (256, 13, 13, 384, 3, 3, 1, 1),
    "resnet50.res3_3x3": (128, 28, 28, 128, 3, 3, 1, 1),
}
LAYOUT = {"fp32": "nchw", "fp16": "nhwc"}


def main():
    raw_path, out_path = sys.argv[1], sys.argv[2]
    pareto = "--pareto" in sys.argv[3:]
    raw = json.load(open(raw_path))
    groups = {}
    for r in raw:
        key = (r["layer"], r["dtype"], r["op"], r["n"], r["micro"])
        best = groups.setdefault(key, {})
        # A configuration found by two heuristics modes appears twice: keep its faster time.
        prev = best.get(r["plan"])
        if prev is None or r["ms"] < prev["ms"]:
            best[r["plan"]] = r
    records = []
    for key in sorted(groups, key=lambda k: (k[0], k[1] != "fp32", ["fwd", "bwd_data", "bwd_filter"].index(k[2]), k[4])):
        layer, dtype, op, n, micro = key
        rows = sorted(groups[key].values(), key=lambda r: (r["ws"], r["ms"], r["plan"]))
        if pareto:
            kept, best = [], float("inf")
            for r in rows:
                if r["ms"] <= best:
                    kept.append(r)
                    best = r["ms"]
            rows = kept
        c, h, w, k, rr, s, pad, stride = SHAPES[layer]
        for r in rows:
            records.append({
                "layer": layer, "dtype": dtype, "layout": LAYOUT[dtype],
                "n": n, "c": c, "h": h, "w": w, "k": k, "r": rr, "s": s,
                "pad_h": pad, "pad_w": pad, "stride_h": stride, "stride_w": stride,
                "dilation_h": 1, "dilation_w": 1, "groups": 1,
                "op": op, "engine": r["plan"], "micro": micro,
                "workspace_bytes": r["ws"], "time_ms": r["ms"],
            })
    header = {
        "format": "mucudnn-profile-v1",
        "device": "NVIDIA H100 80GB HBM3",
        "cudnn_version": 91900,
        "math": "default (TF32 allowed for fp32; tensor ops for fp16)",
        "timing": "cuDNN frontend probe: heuristics modes A, B and fallback, every plan built and "
                  "timed, median of one call, CUDA events"
                  + ("; Pareto-trimmed per size (scripts/engines_fixture.py --pareto)" if pareto else ""),
    }
    with open(out_path, "w") as f:
        f.write("{\n")
        for key, value in header.items():
            f.write(f"{json.dumps(key)}: {json.dumps(value)},\n")
        f.write('"records": [\n')
        f.write(",\n".join(json.dumps(r, separators=(",", ":")) for r in records))
        f.write("\n]\n}\n")
    print(f"{len(records)} records written to {out_path}", file=sys.stderr)


if __name__ == "__main__":
    main()
