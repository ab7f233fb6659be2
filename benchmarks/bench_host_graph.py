"""The host's per-graph work for one all-MiniLM-L6-v2 batch: parse_graph, build_graph and
check_work_size (ggml_graph_plan's work-size bound).

Theory of operation: runs batches through APIR over the embedded host (as bench_minilm.py)
with `apir.host.dispatch_backend`'s parse_graph and build_graph wrapped in timers, and prints
the median wall and thread-CPU time of each per batch (the first batch left out). Thread CPU
time is the steadier number on a loaded machine: it leaves out time the host thread waited
for a core. Compare two trees by running this with each on PYTHONPATH, alternately.

Run: PYTHONPATH=. python benchmarks/bench_host_graph.py [--batches N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from apir.host import dispatch_backend
from apir.models.assets import load_assets
from apir.models.backends import open_backend
from apir.models.minilm import MiniLM

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_minilm import make_sentences  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    times = {"parse_graph": ([], []), "build_graph": ([], []), "check_work_size": ([], [])}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                times[name][0].append(time.perf_counter() - t0)
                times[name][1].append(time.thread_time() - c0)
        return wrapper

    for name in times:
        setattr(dispatch_backend, name, timed(name, getattr(dispatch_backend, name)))
    assets = load_assets()
    batch = assets.tokenizer.encode(make_sentences(args.batch_size, 40))
    ob = open_backend(n_threads=2)
    try:
        if not ob.through_apir or ob.fallback:
            print(f"not through APIR: {ob.description}", file=sys.stderr)
            return 1
        model = MiniLM(ob.backend, ob.buft, assets=assets)
        for _ in range(args.batches + 1):
            model.embed_tokens(batch)
        model.close()
    finally:
        ob.close()
    res = {name: {"wall_ms": statistics.median(w[1:]) * 1e3, "thread_cpu_ms": statistics.median(c[1:]) * 1e3}
           for name, (w, c) in times.items()}
    if args.json:
        json.dump(res, sys.stdout, indent=1)
        print()
        return 0
    print(f"host per-graph work, MiniLM batch of {args.batch_size}, median of {args.batches}:")
    for name, r in res.items():
        print(f"  {name:15} wall {r['wall_ms']:7.2f} ms   thread CPU {r['thread_cpu_ms']:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
