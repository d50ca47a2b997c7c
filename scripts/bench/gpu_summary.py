"""Merge ``scripts/gpu_check.sh``'s results into one JSON document and one markdown table.

    python -m scripts.bench.gpu_summary OUTDIR tests b16 b8 ...

reads ``OUTDIR/cuda-tests.xml`` (pytest's JUnit report) and ``OUTDIR/<run>.json`` (benchmark documents, possibly
incomplete when a step hit its time limit) and writes ``OUTDIR/gpu_check.json`` and ``OUTDIR/gpu_check.md``.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any


def test_summary(report: Path) -> dict[str, Any]:
    """Counts and the names of failed tests from a JUnit XML report, or ``{"missing": true}``."""
    if not report.exists():
        return {"missing": True}
    root = ElementTree.parse(report).getroot()
    cases = list(root.iter("testcase"))
    failed = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c.get("name") for c in cases if c.find("skipped") is not None]
    passed = len(cases) - len(failed) - len(skipped)
    return {"total": len(cases), "failed": failed, "skipped": skipped, "passed": passed}


def load_run(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"missing": True}
    return json.loads(path.read_text())


def markdown(tests: dict[str, Any], runs: dict[str, dict[str, Any]]) -> str:
    lines = ["# GPU check", ""]
    if tests.get("missing"):
        lines.append("CUDA tests: no report (the step did not finish)")
    else:
        lines.append(
            f"CUDA tests: {tests['passed']} passed, {len(tests['failed'])} failed, {len(tests['skipped'])} skipped"
            + (f" (failed: {', '.join(tests['failed'])})" if tests["failed"] else "")
        )
    first = next((run for run in runs.values() if not run.get("missing")), None)
    if first is not None:
        machine = first["machine"]
        lines.append(f"Machine: {machine.get('gpu', machine['device'])}, {machine['cpu']}, torch {machine['torch']}")
    lines += ["", "| run | section | measurement | value | note |", "| --- | --- | --- | --- | --- |"]
    for name, run in runs.items():
        if run.get("missing"):
            lines.append(f"| {name} | - | not run or no result | - | - |")
            continue
        suffix = "" if run.get("complete") else " (cut short)"
        for section, measurement, value, note in run.get("rows", []):
            cells = [f"{name}{suffix}", section, measurement, value, note]
            lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print("usage: python -m scripts.bench.gpu_summary OUTDIR [tests] RUN...", file=sys.stderr)
        return 2
    out = Path(argv[0])
    names = [name for name in argv[1:] if name != "tests"]
    tests = test_summary(out / "cuda-tests.xml")
    runs = {name: load_run(out / f"{name}.json") for name in names}
    (out / "gpu_check.json").write_text(json.dumps({"tests": tests, "runs": runs}, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(tests, runs))
    print((out / "gpu_check.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
