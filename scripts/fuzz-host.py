#!/usr/bin/env python3
"""Fuzz apir's host: a seeded campaign of mutated graphs and commands in fenced memory, or of
the socket host's framing, the vhost-user device's messages and virtqueues, or several
guests racing on one host (`--fuzzer socket | vhost | guests`).

    scripts/fuzz-host.py run --seed 1 --inputs 100000 --workers 16 --out fuzz-out
    scripts/fuzz-host.py run --fuzzer socket --seed 1 --inputs 100000 --out fuzz-socket
    scripts/fuzz-host.py replay fuzz-out/reproducers/crash-SIGSEGV-...json

`run` prints progress, writes OUT/summary.json (inputs, computed graphs, crashes, hangs,
signatures, reproducers) and OUT/worker-K.stderr, and exits 1 when any input crashed or
hung the host, left a command unanswered, stopped it serving, or raised inside it.
`replay` runs each reproducer in a fresh child process (fenced, for the graph fuzzer's; the
protocol fuzzers' name their fuzzer) and reports how it ended.
See docs/security.md ("Fuzzing") and tests/fuzz/ for the design.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fuzz.driver import REPO, _child_env, run_campaign  # noqa: E402

PROTOCOL_FUZZERS = ("socket", "vhost", "guests")


def _replay_cmd(path: Path) -> list:
    """The child that replays `path`: the graph fuzzer's, or the protocol fuzzer it names."""
    meta = json.loads(path.read_text())
    if meta.get("format") == "apir-protocol-fuzz/1":
        return [sys.executable, "-m", "tests.fuzz.wire_child", "--fuzzer", meta["fuzzer"], "--replay", str(path)]
    return [sys.executable, "-m", "tests.fuzz.child", "--replay", str(path)]


def _progress_printer(every: float):
    last = [0.0]

    def show(res, elapsed):
        if elapsed - last[0] >= every:
            last[0] = elapsed
            rate = res.inputs / elapsed if elapsed else 0
            print(
                f"[{elapsed:7.1f} s] inputs {res.inputs} ({rate:.0f}/s), computed {res.computed}, "
                f"crashes {len(res.crashes)}, hangs {len(res.hangs)}, memory {len(res.memory)}, "
                f"oracle {len(res.oracle)}, "
                f"no reply {res.no_reply}, "
                f"not serving {res.not_serving}, host exceptions {res.host_exceptions}, "
                f"harness errors {len(res.harness_errors)}",
                flush=True,
            )

    return show


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run a campaign")
    r.add_argument("--fuzzer", default="graph", choices=["graph", *PROTOCOL_FUZZERS])
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--inputs", type=int, default=10000)
    r.add_argument("--start", type=int, default=0, help="first input index (resume or split a campaign)")
    r.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    r.add_argument("--out", default="fuzz-out")
    r.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="seconds one input may take before it is a hang (20; 60 for protocols)",
    )
    r.add_argument("--chunk", type=int, default=250)
    r.add_argument("--config", default="{}", help="JSON: host configuration keys (added to the child's defaults)")
    r.add_argument("--rlimit-as", type=int, default=8 << 30, help="each child's address-space limit (0: none)")
    r.add_argument(
        "--rss-limit",
        type=int,
        default=2 << 30,
        help="peak-RSS growth (bytes) that makes one input a memory fault (0: none)",
    )
    r.add_argument("--progress", type=float, default=10.0, help="seconds between progress lines")
    r.add_argument("--max-seconds", type=float, default=0.0, help="stop handing out inputs after this long (0: never)")
    p = sub.add_parser("replay", help="replay reproducer files")
    p.add_argument("files", nargs="+")
    p.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()

    if args.what == "replay":
        worst = 0
        for f in args.files:
            t = time.monotonic()
            cmd = _replay_cmd(Path(f).resolve())
            try:
                proc = subprocess.run(
                    cmd, env=_child_env(None), cwd=REPO, capture_output=True, text=True, timeout=args.timeout
                )
            except subprocess.TimeoutExpired:
                print(f"{f}: still running after {args.timeout:.0f} s (a hang)")
                worst = 1
                continue
            how = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            print(f"{f}: {how} after {time.monotonic() - t:.1f} s: {proc.stdout.strip()}")
            if proc.returncode:
                print(proc.stderr[-3000:])
                worst = 1
        return worst

    protocol = args.fuzzer in PROTOCOL_FUZZERS
    res = run_campaign(
        args.seed,
        args.inputs,
        args.workers,
        args.out,
        start=args.start,
        deadline=args.deadline or (60.0 if protocol else 20.0),
        chunk=args.chunk,
        config=json.loads(args.config),
        rlimit_as=args.rlimit_as,
        max_seconds=args.max_seconds,
        rss_limit=args.rss_limit,
        progress=_progress_printer(args.progress),
        child=["tests.fuzz.wire_child", "--fuzzer", args.fuzzer] if protocol else None,
    )
    print(
        f"seed {res.seed}: {res.inputs} inputs ({res.computed} graphs computed) in {res.seconds:.0f} s on "
        f"{res.workers} workers; {len(res.crashes)} crashes, {len(res.hangs)} hangs, "
        f"{len(res.memory)} memory faults, {len(res.oracle)} oracle failures, "
        f"{len(res.signatures)} signatures; no reply {res.no_reply}, not serving {res.not_serving}, "
        f"host exceptions {res.host_exceptions}, harness errors {len(res.harness_errors)}; "
        f"{res.use_counts} inputs with USE_COUNTS agreed; {res.seeds} seed graphs ({res.seeds_skipped} skipped)"
    )
    for sig, n in sorted(res.signatures.items(), key=lambda x: -x[1]):
        first = next(f for f in res.crashes + res.hangs + res.memory + res.oracle if f.signature == sig)
        print(
            f"  {n:6d}  {sig}   first: input {first.index}, reproducer OUT/{first.reproducer} "
            f"(replays alone: {first.reproduced})"
        )
    for e in res.harness_errors[:10]:
        print("  harness error:", e)
    return 0 if res.clean() else 1


if __name__ == "__main__":
    sys.exit(main())
