"""What computing a graph in ranges of nodes costs against the whole graph (apir.host.graph.chunks,
the compute bound on backends without an abort callback: apir.host.backend.compute_abort).

Theory of operation: a one-token decode graph of SmolLM2-135M's shape (tests/host/decodekit.py:
30 layers, 576 wide, F16 weights, a 128-position KV cache, 8192 logits; ~935 nodes, SmolLM2's
decode graph size) is computed directly on one ggml backend (no transport), in rounds: each
round computes it whole and in ranges of each --chunks size, back to back in a shuffled order,
so each ratio (ranges / whole) is taken within a round, free of the machine's drift between
rounds. Prints per size the median time, and the median of the per-round ratios with its
95% interval (benchmarks/paired_stats.py).

Run: PYTHONPATH=. python benchmarks/bench_compute_chunks.py [--backend cpu|vulkan:0] [--rounds N]
(for vulkan:0 on lavapipe, the environment of tests/backends: APIR_GGML_LIB_DIR ... and the
ICD; tests/ggml_backends.py and tests/backends/conftest.py's base_env say which).

Measured on the 2-core machine shared with other work (load average 4-12 while it ran: the
intervals are wide), 963 nodes, 30 rounds, median ratio ranges / whole [95% interval]:
    ggml CPU, 1 thread (whole 35 ms):   64 nodes 1.013 [0.968, 1.057]; 256: 0.994 [0.972, 1.048]
    lavapipe, LP_NUM_THREADS=1 (620 ms): 64 nodes 1.187 [1.100, 1.306]; 256: 1.030 [0.986, 1.070]
    lavapipe, its default threads (520 ms): 64 nodes 1.071 [0.758, 1.419]; 256: 1.017 [0.786, 1.193]
On ggml CPU a range costs nothing measurable; on lavapipe each range is a graph_compute of
its own (command buffers, a submit, a fence wait): ~9 ms a range at 1 thread, so 16 ranges
cost ~19% and 4 ranges ~3%. Hence apir.host.graph_chunk_nodes = 256: a decode graph of
SmolLM2 pays a few percent, and a graph over its limit is stopped within 256 nodes. A real
GPU's submit costs far less than lavapipe's (measure there with --backend vulkan:0).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import apir.ggml  # noqa: E402
from apir.ggml.backend_spec import resolve  # noqa: E402
from apir.host.graph.chunks import GraphChunks  # noqa: E402
from benchmarks.paired_stats import median_interval  # noqa: E402
from tests.host.decodekit import SMOLLM2, decode_graph, fill  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cpu")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--chunks", default="64,128,256")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=SMOLLM2["layers"])
    args = p.parse_args(argv)
    g = apir.ggml.load()
    dev = resolve(g, args.backend).devices[0]
    shape = dict(SMOLLM2, layers=args.layers)
    d = decode_graph(g, **shape)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(d.ctx, g.ggml_backend_dev_buffer_type(dev))
    backend = g.ggml_backend_dev_init(dev, None)
    if g.ggml_backend_dev_type(dev) == g.header.dev_types["CPU"]:
        g.ggml_backend_cpu_set_n_threads(backend, args.threads)
    fill(g, d)
    sizes = [int(s) for s in args.chunks.split(",")]
    ways = {"whole": [d.graph]}
    made = []
    for n in sizes:
        c = GraphChunks(g, d.graph, n)
        made.append(c)
        ways[str(n)] = c.graphs
    n_nodes = g.ggml_graph_n_nodes(d.graph)
    print(f"{args.backend}: decode graph of {n_nodes} nodes, {args.layers} layers; {args.rounds} rounds")

    def run(graphs) -> float:
        t0 = time.perf_counter()
        for graph in graphs:
            assert g.ggml_backend_graph_compute(backend, graph) == 0
        return time.perf_counter() - t0

    for graphs in ways.values():  # warm-up (pipelines, caches)
        run(graphs)
    times = {k: [] for k in ways}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(ways)
        rng.shuffle(order)
        for k in order:
            times[k].append(run(ways[k]))
    whole = times["whole"]
    print(f"  whole: median {statistics.median(whole) * 1e3:.1f} ms")
    for n in sizes:
        ratios = [t / w for t, w in zip(times[str(n)], whole)]
        med, lo, hi = median_interval(ratios)
        print(
            f"  ranges of {n:4d} ({-(-n_nodes // n)} cgraphs): median {statistics.median(times[str(n)]) * 1e3:.1f} ms,"
            f" ratio {med:.3f} [{lo:.3f}, {hi:.3f}]"
        )
    for c in made:
        c.close()
    g.ggml_backend_free(backend)
    g.ggml_backend_buffer_free(buf)
    g.ggml_free(d.ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
