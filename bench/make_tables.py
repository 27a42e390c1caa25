"""Print Markdown tables of benchmark results (bench/results/*.json) for pasting into the README.

One table per suite: workload, mode, ours, each peer (in the suite's metric), and the ratio
best peer time / our time (> 1: ours is faster). Errors become numbered notes under the table.

    python bench/make_tables.py                      # every bench/results/*.json
    python bench/make_tables.py bench/results/cudnn.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
UNITS = {"tflops": "TFLOP/s", "gbps": "GB/s"}


def _workload_and_mode(row: dict) -> tuple[str, str]:
    """The workload name without its mode suffix, and the mode ('' when the row has none)."""
    name = str(row.get("workload", "?"))
    mode = str(row.get("params", {}).get("mode", ""))
    if mode and name.endswith("-" + mode):
        name = name[: -len(mode) - 1]
    return name, mode


def _cell(entry: dict | None, notes: dict[str, int]) -> str:
    if entry is None:
        return ""
    if "value" in entry:
        return f"{entry['value']:.1f}"
    error = " ".join(str(entry.get("error", "no value")).split())
    if len(error) > 300:
        error = error[:297] + "..."
    number = notes.setdefault(error, len(notes) + 1)
    return f"n/a [{number}]"


def _versions(versions: dict) -> str:
    return ", ".join(f"{name} {value}" for name, value in versions.items() if value is not None)


def _ratio_peers(rows: list[dict]) -> str:
    """What the ratio compares with: the best peer, or the peers a suite names in params.ratio_peers."""
    named = sorted({str(p) for row in rows for p in row.get("params", {}).get("ratio_peers", ())})
    if not named:
        return "best peer"
    return named[0] if len(named) == 1 else f"best of {', '.join(named)}"


def _copy_bandwidth(rows: list[dict]) -> str:
    """The device-to-device copy bandwidth a memory-bound suite measured (params.copy_GBps), '' when none."""
    values = sorted({round(row["params"]["copy_GBps"]) for row in rows
                     if isinstance(row.get("params", {}).get("copy_GBps"), (int, float))})
    if not values:
        return ""
    measured = f"{values[0]}" if len(values) == 1 else f"{values[0]}-{values[-1]}"
    return f" Measured copy bandwidth (dst.copy_(src)): {measured} GB/s."


def table(document: dict) -> str:
    """One suite's Markdown: a heading, the versions, the table, then notes for errors."""
    rows = document.get("rows", [])
    suite = document.get("suite", "?")
    metrics = sorted({str(row.get("metric", "")) for row in rows}) or ["tflops"]
    unit = " / ".join(UNITS.get(m, m) for m in metrics)
    peers: list[str] = []
    for row in rows:
        for name in row.get("peers", {}):
            if name not in peers:
                peers.append(name)
    backends = sorted({str(row.get("ours", {}).get("backend", "?")) for row in rows})
    lines = [f"### {suite}: {document.get('device', '?')}, {document.get('date', '?')}", ""]
    if document.get("versions"):
        lines += [_versions(document["versions"]), ""]
    lines += [f"{unit}; ours = fusedattn ({', '.join(backends)}); ratio = {_ratio_peers(rows)} time / ours "
              f"(> 1: ours faster).{_copy_bandwidth(rows)}", ""]
    header = ["workload", "mode", "ours", *peers, "ratio"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---", "---"] + ["--:"] * (len(header) - 2)) + "|")
    notes: dict[str, int] = {}
    for row in rows:
        name, mode = _workload_and_mode(row)
        ratio = row.get("ratio_vs_best_peer")
        cells = [f"`{name}`", mode, _cell(row.get("ours"), notes)]
        cells += [_cell(row.get("peers", {}).get(peer), notes) for peer in peers]
        cells.append(f"{ratio:.2f}x" if isinstance(ratio, (int, float)) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines.append("")
        lines += [f"[{number}] {error}  " for error, number in notes.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="make_tables.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="results files (default: bench/results/*.json)")
    args = parser.parse_args(argv)
    files = args.files or sorted(RESULTS.glob("*.json"))
    if not files:
        print(f"make_tables: no results files in {RESULTS}", file=sys.stderr)
        return 1
    status = 0
    for path in files:
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            print(f"make_tables: skipping {path}: {error}", file=sys.stderr)
            status = 1
            continue
        print(table(document))
    return status


if __name__ == "__main__":
    sys.exit(main())
