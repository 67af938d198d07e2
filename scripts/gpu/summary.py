#!/usr/bin/env python3
"""The GPU acceptance's summaries (accept.sh, build.sh): a part's JSON and table, the window's
files, and which parts already passed on a kind of GPU.

    summary.py part PART WORK LOG OFFSET SECONDS JSON
        a part's summary from WORK/steps.tsv (name, cap, status, seconds, kind per step),
        WORK/gpu.txt, WORK/libraries.txt and its output in LOG from byte OFFSET: JSON written,
        its table printed; exit status 0 only when every required step passed
    summary.py window-start WINDOW_JSON BUDGET_S
    summary.py window-note WINDOW_JSON PART STATUS         (running, not run: ..., skipped: ...)
    summary.py window-add WINDOW_JSON PART_JSON CAPS_S     (a part that ran)
    summary.py window-files WINDOW_JSON TAR WORK PART [TAR_EXCLUDES...]
    summary.py window-log LOG                              (keeps it under the size limit)
    summary.py window-end WINDOW_JSON SECONDS
        the window's files under $OUT: WINDOW_JSON and window.txt beside it (the table) are
        rewritten at every call, so a window killed at its limit returns what it had; the end
        prints the table and exits 0 only when every part that ran passed
    summary.py passed PASSED_JSON GPU_NAME PART
        exit 0 (printing where) when PART passed on a GPU of that name
    summary.py check-passed PASSED_JSON
        the file (if any) is a list of {part, gpu_name, where}
    summary.py collect BENCHES_DIR PASSED_JSON
        build.sh: the parts that passed, by GPU name, from BENCHES_DIR/*/window.json (a
        window's) and BENCHES_DIR/*/PART.json (a single part's)

The device tool brings back at most 8 files from $OUT, 16 MiB each: the window writes four
(window.json, window.txt, window.log, window-files.tar) and keeps each under 15 MiB.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

#: What the window keeps each of its files under (the tool's limit is 16 MiB a file).
FILE_LIMIT = 15 * 1024 * 1024
#: Lines of a failed step's output the summary keeps.
TAIL_LINES = 8


def read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text(errors="replace").strip() or None
    except OSError:
        return None


def write_json(path: str | Path, doc) -> None:
    """Writes atomically: a reader (or a kill) never sees half a file."""
    path = Path(path)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)


def step_rows(steps_tsv: Path) -> list[dict]:
    rows = []
    for line in steps_tsv.read_text().splitlines():
        if not line.strip():
            continue
        fields = line.split("\t")
        name, cap, status, seconds = fields[:4]
        kind = fields[4] if len(fields) > 4 else "required"
        rows.append({"name": name, "cap_s": int(cap), "status": status,
                     "seconds": int(seconds), "kind": kind})
    return rows


def step_tail(log_text: str, name: str) -> list[str]:
    """The last lines of step `name`'s output: between its `== NAME (cap ...)` line and its
    `== NAME: status` line in the log (to the end when the step never finished)."""
    start = log_text.rfind(f"== {name} (cap ")
    if start < 0:
        return []
    body = log_text[start:].split("\n", 1)[1] if "\n" in log_text[start:] else ""
    end = body.find(f"== {name}: ")
    lines = (body[:end] if end >= 0 else body).rstrip("\n").splitlines()
    return [line[:300] for line in lines[-TAIL_LINES:]]


def cmd_part(part, work, log, offset, seconds, out) -> int:
    work = Path(work)
    rows = step_rows(work / "steps.tsv") if (work / "steps.tsv").is_file() else []
    with open(log, "rb") as f:
        f.seek(int(offset))
        log_text = f.read().decode(errors="replace")
    required = [r for r in rows if r["kind"] != "info"]
    failed = next((r for r in required if r["status"] != "ok"), None)
    doc = {
        "part": part,
        "passed": bool(required) and failed is None,
        "seconds": int(seconds),
        "gpu": read(work / "gpu.txt"),
        "libraries": read(work / "libraries.txt"),
        "steps": rows,
        "warnings": [f"{r['name']}: {r['status']}" for r in rows
                     if r["kind"] == "info" and r["status"] != "ok"],
        "failed": None if failed is None else {
            "step": failed["name"], "status": failed["status"],
            "last_lines": step_tail(log_text, failed["name"]),
        },
    }
    write_json(out, doc)
    print()
    print(f"{'step':<70} {'status':<34} {'s':>4} {'cap':>4}")
    for r in rows:
        status = r["status"] if r["kind"] != "info" or r["status"] == "ok" else \
            f"warning: {r['status']}"
        print(f"{r['name'][:70]:<70} {status[:34]:<34} {r['seconds']:>4} {r['cap_s']:>4}")
    print(f"part {part}: {'PASSED' if doc['passed'] else 'FAILED'} in {seconds} s "
          f"({doc['gpu']}); log {log}")
    return 0 if doc["passed"] else 1


# --------------------------------------------------------------------------------------------
# The window

def load(window_json) -> dict:
    return json.loads(Path(window_json).read_text())


def gpu_slug(gpu_name: str | None) -> str:
    """`NVIDIA H200` -> `h200`; `NVIDIA H100 80GB HBM3` -> `h100-80gb-hbm3`."""
    if not gpu_name:
        return "unknown-gpu"
    name = re.sub(r"^nvidia\s+", "", gpu_name.strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "unknown-gpu"


def table(doc: dict) -> str:
    lines = [f"{'part':<26} {'status':<10} {'s':>4} {'caps':>5}  failed step / note"]
    for p in doc["parts"]:
        status = p["status"]
        word = status.split(":")[0] if ":" in status else status
        note = "" if ":" not in status else status.split(":", 1)[1].strip()
        failed = p.get("failed")
        if failed:
            note = f"{failed['step']}: {failed['status']}"
        seconds = p.get("seconds", "")
        caps = p.get("caps_s", "")
        lines.append(f"{p['part']:<26} {word:<10} {seconds!s:>4} {caps!s:>5}  {note}")
        for tail in (failed or {}).get("last_lines", []):
            lines.append(f"{'':<26} | {tail}")
        for warning in p.get("warnings", []):
            lines.append(f"{'':<26} warning: {warning}")
    ran = [p for p in doc["parts"] if p["status"] in ("passed", "FAILED", "running")]
    verdict = "PASSED" if ran and all(p["status"] == "passed" for p in ran) else "FAILED"
    lines.append(
        f"window: {verdict}; {len(ran)} parts ran in {doc.get('seconds', '?')} s of "
        f"{doc['budget_s']} s on {doc.get('gpu') or 'an unknown GPU'}; commit these files to "
        f"{doc.get('suggested_dir') or suggested_dir(doc)}/"
    )
    return "\n".join(lines) + "\n"


def suggested_dir(doc: dict) -> str:
    date = doc["started"][:10]
    name = doc.get("gpu", "").split(",")[0] if doc.get("gpu") else None
    return f"benches/gpu/{date}-{gpu_slug(name)}"


def save(window_json, doc) -> None:
    doc["suggested_dir"] = suggested_dir(doc)
    write_json(window_json, doc)
    Path(window_json).with_name("window.txt").write_text(table(doc))


def set_part(doc: dict, entry: dict) -> None:
    for i, p in enumerate(doc["parts"]):
        if p["part"] == entry["part"]:
            doc["parts"][i] = entry
            return
    doc["parts"].append(entry)


def cmd_window_start(window_json, budget) -> int:
    commit = read(Path(".gpu") / "commit.txt")
    doc = {
        "budget_s": int(budget),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seconds": 0,
        "commit": commit,
        "gpu": None,
        "parts": [],
    }
    save(window_json, doc)
    return 0


def cmd_window_note(window_json, part, status) -> int:
    doc = load(window_json)
    set_part(doc, {"part": part, "status": status})
    save(window_json, doc)
    return 0


def cmd_window_add(window_json, part_json, caps) -> int:
    doc = load(window_json)
    try:
        summary = json.loads(Path(part_json).read_text())
    except (OSError, ValueError) as e:
        part = Path(part_json).parent.name
        summary = {"part": part, "passed": False, "steps": [],
                   "failed": {"step": "the part's summary", "status": f"unreadable: {e}",
                              "last_lines": []}}
    summary["status"] = "passed" if summary.get("passed") else "FAILED"
    summary["caps_s"] = int(caps)
    set_part(doc, summary)
    if not doc.get("gpu") and summary.get("gpu"):
        doc["gpu"] = summary["gpu"]
    save(window_json, doc)
    return 0


def cmd_window_files(window_json, tar, work, part, *excludes) -> int:
    """Appends WORK's files (as PART/...) to TAR unless that would pass the size limit."""
    work = Path(work)
    listing = subprocess.run(["tar", "-cf", "-", "-C", str(work.parent), *excludes, part],
                             capture_output=True)
    size = Path(tar).stat().st_size if Path(tar).exists() else 0
    doc = load(window_json)
    entry = next((p for p in doc["parts"] if p["part"] == part), None)
    if listing.returncode != 0:
        note = f"not packed: tar failed: {listing.stderr.decode(errors='replace')[-300:]}"
    elif size + len(listing.stdout) > FILE_LIMIT:
        note = (f"left out: {len(listing.stdout)} bytes would take window-files.tar past "
                f"{FILE_LIMIT} bytes")
    else:
        done = subprocess.run(["tar", "-rf", tar, "-C", str(work.parent), *excludes, part],
                              capture_output=True)
        note = f"window-files.tar: {part}/" if done.returncode == 0 else \
            f"not packed: {done.stderr.decode(errors='replace')[-300:]}"
    if entry is not None:
        entry["files"] = note
        save(window_json, doc)
    return 0


def cmd_window_log(log) -> int:
    """Keeps the log under the size limit: its last part, with a note of what was cut."""
    path = Path(log)
    size = path.stat().st_size
    if size <= FILE_LIMIT:
        return 0
    keep = FILE_LIMIT - 1024 * 1024
    with open(path, "rb") as f:
        f.seek(size - keep)
        tail = f.read()
    note = f"[window.log: the first {size - keep} bytes were cut to stay under {FILE_LIMIT}]\n"
    path.write_bytes(note.encode() + tail)
    return 0


def cmd_window_end(window_json, seconds) -> int:
    doc = load(window_json)
    doc["seconds"] = int(seconds)
    for p in doc["parts"]:
        if p["status"] == "running":  # its summary never came (the part's own failure)
            p["status"] = "FAILED"
            p.setdefault("failed", {"step": "the part", "status": "no summary",
                                    "last_lines": []})
    save(window_json, doc)
    text = table(doc)
    print()
    print(text, end="")
    ran = [p for p in doc["parts"] if p["status"] in ("passed", "FAILED")]
    return 0 if ran and all(p["status"] == "passed" for p in ran) else 1


# --------------------------------------------------------------------------------------------
# What passed where

def records(passed_json) -> list[dict]:
    path = Path(passed_json)
    if not path.is_file():
        return []
    doc = json.loads(path.read_text())
    if not isinstance(doc, list) or not all(
        isinstance(r, dict) and {"part", "gpu_name", "where"} <= r.keys() for r in doc
    ):
        raise ValueError(f"{passed_json}: not a list of {{part, gpu_name, where}}")
    return doc


def cmd_passed(passed_json, gpu_name, part) -> int:
    try:
        found = [r for r in records(passed_json)
                 if r["part"] == part and r["gpu_name"] == gpu_name]
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    if not found:
        return 1
    print(", ".join(sorted({r["where"] for r in found})))
    return 0


def cmd_check_passed(passed_json) -> int:
    try:
        count = len(records(passed_json))
    except ValueError as e:
        print(f"  window: {e}")
        return 1
    print(f"window: {count} passed parts on record ({passed_json})")
    return 0


def cmd_collect(benches, out) -> int:
    found = []
    for path in sorted(glob.glob(os.path.join(benches, "*", "*.json"))):
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict):
            continue
        where = os.path.normpath(path)
        if isinstance(doc.get("parts"), list):  # a window
            gpu = (doc.get("gpu") or "").split(",")[0].strip()
            for p in doc["parts"]:
                if p.get("status") == "passed" and gpu:
                    found.append({"part": p["part"], "gpu_name": gpu, "where": where})
        elif doc.get("passed") is True and doc.get("part") and doc.get("gpu"):
            found.append({"part": doc["part"], "gpu_name": doc["gpu"].split(",")[0].strip(),
                          "where": where})
    write_json(out, found)
    print(f"{len(found)} passed parts on record in {benches}")
    return 0


COMMANDS = {
    "part": (cmd_part, 6), "window-start": (cmd_window_start, 2),
    "window-note": (cmd_window_note, 3), "window-add": (cmd_window_add, 3),
    "window-files": (cmd_window_files, 4), "window-log": (cmd_window_log, 1),
    "window-end": (cmd_window_end, 2), "passed": (cmd_passed, 3),
    "check-passed": (cmd_check_passed, 1), "collect": (cmd_collect, 2),
}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 2
    command, count = COMMANDS[sys.argv[1]]
    args = sys.argv[2:]
    if len(args) < count or (len(args) > count and sys.argv[1] != "window-files"):
        print(f"summary.py {sys.argv[1]}: {count} arguments, got {len(args)}", file=sys.stderr)
        return 2
    return command(*args)


if __name__ == "__main__":
    sys.exit(main())
