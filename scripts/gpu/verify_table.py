"""Verified tuning's report: from `mucudnn tune --json` documents, a table per layer of each
candidate's error against the reference candidate (max |out - ref| / max |ref|), its tolerance
and whether it was rejected, largest errors first; then the rejected candidates of every file.

    python3 verify_table.py OUT.txt TUNE.json [TUNE.json ...]

Rejected candidates are findings (which cuDNN candidates compute wrong numbers on this GPU and
cuDNN), not failures. The script fails when a document is missing or unreadable, or when fewer
than MIN_COMPARED of a document's timings were compared (verification did not run)."""

from __future__ import annotations

import json
import sys

MIN_COMPARED = 0.9


def fmt(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def table(path: str, doc: dict) -> tuple[list[str], list[str], float]:
    lines = [f"== {path}: {doc.get('tuning', {}).get('candidates', '?')} candidates"]
    rejected = []
    compared = total = 0
    for entry in doc["verification"]:
        head = f"{entry['layer']} {entry['dtype']} {entry['layout']} {entry['op']}"
        if entry.get("split", "batch") != "batch":
            head += f" {entry['split']}"
        rows = sorted(
            entry["candidates"],
            key=lambda c: (-(c["max_rel_error"] if c["max_rel_error"] is not None else
                             (float("inf") if c["rejected"] else -1.0))),
        )
        lines.append(f"\n{head}")
        lines.append(f"  {'size':>5}  {'candidate':<48} {'error':>8} {'tolerance':>9}  status")
        for c in rows:
            total += 1
            if c["tolerance"] is not None:
                compared += 1
            if c["rejected"]:
                status = "REJECTED"
                error = "not finite" if c["max_rel_error"] is None else fmt(c["max_rel_error"])
                rejected.append(f"{head} at {c['size']}: {c['name']} error {error} "
                                f"(tolerance {fmt(c['tolerance'])}), {c['time_ms']:.3f} ms")
            elif c["tolerance"] is None:
                status = "not compared"
                error = "-"
            else:
                status = "ok"
                error = fmt(c["max_rel_error"])
            lines.append(f"  {c['size']:>5}  {c['name'][:48]:<48} {error:>8} "
                         f"{fmt(c['tolerance']):>9}  {status}")
    share = compared / total if total else 0.0
    lines.append(f"\n{path}: {compared} of {total} timings compared ({share:.0%}), "
                 f"{len(rejected)} rejected")
    return lines, rejected, share


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    out, paths = sys.argv[1], sys.argv[2:]
    report, problems, all_rejected = [], [], []
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
            lines, rejected, share = table(path, doc)
        except (OSError, ValueError, KeyError) as e:
            problems.append(f"{path}: {e}")
            continue
        report += lines + [""]
        all_rejected += rejected
        if share < MIN_COMPARED:
            problems.append(f"{path}: only {share:.0%} of the timings were compared")
    report.append(f"rejected candidates ({len(all_rejected)}): which candidates compute wrong "
                  "numbers here")
    report += [f"  {r}" for r in all_rejected] or ["  none"]
    report += [f"PROBLEM: {p}" for p in problems]
    text = "\n".join(report) + "\n"
    with open(out, "w") as f:
        f.write(text)
    print(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
