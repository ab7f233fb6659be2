"""The second `apir embed` of a fresh process: the whole command's wall time.

Theory of operation: runs `python -m apir embed` on the README's three sentences in a new
process, once untimed (it fills Python's bytecode cache and Numba's on-disk kernel cache, and
the page cache holds the model), then `--runs` times, each timed from start to exit. With
`--baseline DIR` (another checkout, e.g. `git worktree add --detach /tmp/base main`), the same
command runs from DIR too, alternating with this checkout run by run, so that a shared machine's
drift hits both alike. Each run's time is printed with the embed step the command reports
("embedded in X s": graph build and compute, the part a busy machine's load moves most), then
the min and median of each next to the target (<= 1.5 s, 2 cores) and, with a baseline, the
ratio of the medians.

The commands run with this Python (`sys.executable`, a venv with apir's dependencies and the
model package), in the checkout's root, so `python -m apir` imports that checkout's apir, and
without PYTHONDONTWRITEBYTECODE: a second run finds its modules compiled (recompiling apir's
took ~125 ms a run).

Run: python benchmarks/bench_cold_start.py [--runs 5] [--baseline DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 1.5  # the second `apir embed` of the README's sentences, 2 cores
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue today."]
REPO = Path(__file__).resolve().parent.parent


def run_once(checkout: Path) -> tuple[float, float]:
    """(wall seconds of the whole command, the embed step it reports)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "apir", "embed", *SENTENCES], cwd=checkout, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    found = re.search(r"embedded in ([0-9.]+) s", done.stdout)
    if done.returncode or not found:
        raise SystemExit(f"apir embed in {checkout} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return wall, float(found.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs of each checkout (default 5)")
    ap.add_argument("--baseline", type=Path, help="another checkout to alternate with (its root)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    checkouts = {"this": REPO}
    if args.baseline:
        checkouts["baseline"] = args.baseline.resolve()
    for checkout in checkouts.values():
        run_once(checkout)  # fills the caches: the runs below are each a second run
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in checkouts}
    for i in range(args.runs):
        for name, checkout in checkouts.items():
            times[name].append(run_once(checkout))
            if not args.json:
                wall, embed = times[name][-1]
                print(f"run {i + 1} {name:8} {wall:6.3f} s (embed step {embed:.3f} s)", flush=True)
    summary = {
        name: {
            "runs_s": [round(w, 3) for w, _ in rows],
            "embed_step_s": [round(e, 3) for _, e in rows],
            "min_s": min(w for w, _ in rows),
            "median_s": statistics.median(w for w, _ in rows),
        }
        for name, rows in times.items()
    }
    ratio = summary["this"]["median_s"] / summary["baseline"]["median_s"] if args.baseline else None
    if args.json:
        print(json.dumps({"target_s": TARGET_S, "cores": os.cpu_count(), "ratio_to_baseline": ratio, **summary}))
        return 0
    print(f"\n{'second apir embed':18} {'min s':>7} {'median s':>9} {'target':>8} {'median/target':>14}")
    for name, row in summary.items():
        print(
            f"{name:18} {row['min_s']:7.3f} {row['median_s']:9.3f} {'<= ' + str(TARGET_S):>8} "
            f"{row['median_s'] / TARGET_S:14.2f}"
        )
    if ratio is not None:
        print(f"median this / baseline: {ratio:.2f}")
    print(f"({os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
