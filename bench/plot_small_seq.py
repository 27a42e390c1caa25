"""Plot the small_seq suite: achieved GB/s of ours and of the best peer per row, against the copy bandwidth.

Reads bench/results/small_seq.json (written by bench_small_seq.py on the GPU machine) and writes
bench/results/small_seq_bandwidth.png: one panel per mode (fwd, fwd+bwd), a pair of bars per workload
(ours, and the fastest peer that ran, named above its bar), and a horizontal line at the
device-to-device copy bandwidth measured in the same run (params.copy_GBps). Needs matplotlib, which
the GPU machine may lack: it reads only the JSON, so run it anywhere.

    python bench/plot_small_seq.py
    python bench/plot_small_seq.py bench/results/small_seq.json --out /tmp/small_seq.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

try:  # python -m bench.plot_small_seq
    from . import make_tables
except ImportError:  # python bench/plot_small_seq.py
    import make_tables

RESULTS = make_tables.RESULTS
MODES = ("fwd", "fwd+bwd")


def best_peer(row: dict) -> tuple[str | None, float | None]:
    """(name, GB/s) of the peer with the highest value in the row; (None, None) when none ran."""
    ran = [(entry["value"], name) for name, entry in row.get("peers", {}).items() if "value" in entry]
    if not ran:
        return None, None
    value, name = max(ran)
    return name, value


def panel(axes, rows: list[dict], mode: str) -> None:
    """One mode's bars: ours and the best peer per workload, and the copy bandwidth."""
    labels = [make_tables._workload_and_mode(row)[0].removeprefix("sq1-") for row in rows]
    ours = [row.get("ours", {}).get("value", 0.0) for row in rows]
    peers = [best_peer(row) for row in rows]
    positions = range(len(rows))
    width = 0.4
    axes.bar([p - width / 2 for p in positions], ours, width, label="ours (fusedattn small_seq)", color="tab:blue")
    axes.bar([p + width / 2 for p in positions], [value or 0.0 for _, value in peers], width, label="best peer",
             color="tab:orange")
    for position, (name, value) in zip(positions, peers):
        axes.annotate(name or "no peer ran", (position + width / 2, value or 0.0), rotation=90, fontsize=6,
                      ha="center", va="bottom", xytext=(0, 2), textcoords="offset points")
    copies = [row["params"]["copy_GBps"] for row in rows if isinstance(row["params"].get("copy_GBps"), (int, float))]
    if copies:  # merged runs may differ a little: their median, with the range in the legend
        label = f"copy bandwidth {statistics.median(copies):.0f} GB/s"
        if max(copies) - min(copies) > 1:
            label += f" (runs: {min(copies):.0f}-{max(copies):.0f})"
        axes.axhline(statistics.median(copies), color="black", linestyle="--", linewidth=1, label=label)
    axes.set_xticks(list(positions), labels, rotation=60, ha="right", fontsize=7)
    axes.set_ylabel("GB/s (minimum bytes moved)")
    axes.set_title(f"{mode}: ours vs the best peer, per workload", fontsize=9, loc="left")
    axes.legend(fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=3, frameon=False)  # above the bars


def plot(document: dict, out: Path) -> int:
    """Write the figure; returns the number of rows drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on the benchmark machines
    import matplotlib.pyplot as plt

    by_mode = {mode: [row for row in document.get("rows", [])
                      if row.get("params", {}).get("mode") == mode and row.get("metric") == "gbps"] for mode in MODES}
    by_mode = {mode: rows for mode, rows in by_mode.items() if rows}
    if not by_mode:
        return 0
    widest = max(len(rows) for rows in by_mode.values())
    figure, panels = plt.subplots(len(by_mode), 1, figsize=(max(8.0, 0.32 * widest + 2), 5.0 * len(by_mode)),
                                  squeeze=False)
    for axes, (mode, rows) in zip(panels[:, 0], by_mode.items()):
        panel(axes, rows, mode)
    figure.suptitle(f"small_seq: {document.get('device', '?')}, {document.get('date', '?')}", fontsize=10)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=150)
    plt.close(figure)
    return sum(len(rows) for rows in by_mode.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="plot_small_seq.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS / "small_seq.json",
                        help="results file (default: bench/results/small_seq.json)")
    parser.add_argument("--out", type=Path, default=RESULTS / "small_seq_bandwidth.png",
                        help="the PNG to write (default: bench/results/small_seq_bandwidth.png)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_small_seq: matplotlib is not installed in this Python (pip install matplotlib); no plot written",
              file=sys.stderr)
        return 1
    try:
        document = json.loads(args.results.read_text())
    except (OSError, ValueError) as error:
        print(f"plot_small_seq: cannot read {args.results}: {error}", file=sys.stderr)
        return 1
    drawn = plot(document, args.out)
    if not drawn:
        print(f"plot_small_seq: no GB/s rows in {args.results}; no plot written", file=sys.stderr)
        return 1
    print(f"wrote {args.out} ({drawn} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
