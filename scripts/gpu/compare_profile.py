#!/usr/bin/env python3
"""Compares the best time per (layer, dtype, op, micro-batch) of two mucudnn-profile-v1 files.

usage: compare_profile.py NEW.json REFERENCE.json [TOLERANCE]   (default 0.15)
Prints one row per (layer, op) with the worst ratio over micro-batch sizes, then how many
(layer, op, micro) best times agree within the tolerance. A report, never a failure: the
reference was measured by other code at another offset, maybe on another card (an H200), so
a difference is a number to look at, not a defect. Exit status 0 whenever both files read.
"""
import json
import sys
from collections import defaultdict


def best_times(path):
    best = {}
    for r in json.load(open(path))["records"]:
        key = (r["layer"], r["dtype"], r["layout"], r["op"], r["micro"])
        best[key] = min(best.get(key, float("inf")), r["time_ms"])
    return best


def main():
    new, ref = best_times(sys.argv[1]), best_times(sys.argv[2])
    tol = float(sys.argv[3]) if len(sys.argv) > 3 else 0.15
    common = sorted(set(new) & set(ref))
    if not common:
        print("no (layer, dtype, layout, op, micro) in common: nothing to compare")
        return 0
    worst = defaultdict(lambda: (1.0, None))
    within = 0
    for key in common:
        ratio = new[key] / ref[key]
        within += abs(ratio - 1) <= tol
        group = key[:4]
        if abs(ratio - 1) > abs(worst[group][0] - 1):
            worst[group] = (ratio, key[4])
    print(f"{'layer':<14} {'dtype':<5} {'op':<10} {'worst new/ref':>13} {'at micro':>8}")
    for group in sorted(worst):
        ratio, micro = worst[group]
        print(f"{group[0]:<14} {group[1]:<5} {group[3]:<10} {ratio:>13.3f} {micro if micro else '-':>8}")
    print(f"{within}/{len(common)} best times within {tol:.0%} of the reference (a report)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
