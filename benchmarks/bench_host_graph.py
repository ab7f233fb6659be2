"""The host's per-graph work for one all-MiniLM-L6-v2 batch: the graph cache's in-place match
(_same_graph_again: a graph served before, its very bytes or under other tensor ids,
re-checked), parse_graph,
prepare_graph (checks and build, or the graph cache's re-check by key) and check_work_size
(ggml_graph_plan's bound).

Theory of operation: runs batches through APIR over the embedded host (as bench_minilm.py)
with those functions of `apir.host.backend.dispatch_backend` wrapped in timers, twice: with the
context's graph cache off (every batch checked and built in full: the "first build") and on
(the same graph again: a "rebuild" from the cache, apir.host.graph.cache), and prints the
median wall and thread-CPU time of each per batch (the first batch left out; 0 for a step no
later batch reached), then rebuild / first build: the median over batches of each batch's
match + parse + prepare (target <= 0.2; a batch the match serves runs no parse or prepare, so
per-step medians, each over the batches that ran the step, would not add up to a batch).
Thread CPU time is the steadier number on a loaded machine: it leaves out time the host
thread waited for a core. Compare two trees by running this with each on PYTHONPATH,
alternately.

Run: PYTHONPATH=. python benchmarks/bench_host_graph.py [--batches N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from apir.host.backend import dispatch_backend
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
    assets = load_assets()
    batch = assets.tokenizer.encode(make_sentences(args.batch_size, 40))
    res = {}
    for mode in ("first build", "rebuild"):
        times = _run(assets, batch, args.batches, cache=mode == "rebuild")
        if times is None:
            return 1
        res[mode] = {name: {"wall_ms": _median_after_first(w) * 1e3, "thread_cpu_ms": _median_after_first(c) * 1e3}
                     for name, (w, c) in times.items()}
    batch = {m: res[m].pop("per batch")["thread_cpu_ms"] for m in ("first build", "rebuild")}
    res["per_batch_thread_cpu_ms"] = batch
    res["rebuild_over_first_build"] = batch["rebuild"] / batch["first build"]
    if args.json:
        json.dump(res, sys.stdout, indent=1)
        print()
        return 0
    print(f"host per-graph work, MiniLM batch of {args.batch_size}, median of {args.batches}:")
    for mode in ("first build", "rebuild"):
        print(f" {mode} (graph cache {'on' if mode == 'rebuild' else 'off'}):")
        for name, r in res[mode].items():
            print(f"  {name:17} wall {r['wall_ms']:7.2f} ms   thread CPU {r['thread_cpu_ms']:7.2f} ms")
    print(f" per batch (match + parse + prepare, thread CPU): first build {batch['first build']:.2f} ms, "
          f"rebuild {batch['rebuild']:.2f} ms")
    print(f" rebuild / first build (match + parse + prepare, thread CPU) {res['rebuild_over_first_build']:6.3f}x"
          f"   (target <= 0.2x)")
    return 0


def _median_after_first(xs) -> float:
    """The median of `xs` without its first (the first batch's), 0.0 when no later batch ran it."""
    return statistics.median(xs[1:]) if len(xs) > 1 else 0.0


def _run(assets, batch, batches: int, cache: bool):
    """{name: (wall s list, thread CPU s list)} over `batches` + 1 batches, or None."""
    times: dict = {name: ([], []) for name in ("_same_graph_again", "parse_graph", "prepare_graph", "check_work_size")}
    times["per batch"] = ([], [])  # match + parse + prepare of each batch (each compute starts with the match)

    def timed(name, fn):
        def wrapper(*a, **k):
            if name == "prepare_graph" and not cache:
                a = a[:2] + (None,)  # no cache: every graph checked and built in full
            if name == "_same_graph_again" and not cache:
                a = a[:1] + (None,) + a[2:]
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
                times[name][0].append(wall)
                times[name][1].append(cpu)
                if name == "_same_graph_again":
                    times["per batch"][0].append(0.0)
                    times["per batch"][1].append(0.0)
                if name != "check_work_size":
                    times["per batch"][0][-1] += wall
                    times["per batch"][1][-1] += cpu
        return wrapper

    saved = {name: getattr(dispatch_backend, name) for name in times if name != "per batch"}
    for name in saved:
        setattr(dispatch_backend, name, timed(name, saved[name]))
    ob = open_backend(n_threads=2)
    try:
        if not ob.through_apir or ob.fallback:
            print(f"not through APIR: {ob.description}", file=sys.stderr)
            return None
        model = MiniLM(ob.backend, ob.buft, assets=assets)
        for _ in range(batches + 1):
            model.embed_tokens(batch)
        model.close()
    finally:
        ob.close()
        for name, fn in saved.items():
            setattr(dispatch_backend, name, fn)
    return times


if __name__ == "__main__":
    sys.exit(main())
