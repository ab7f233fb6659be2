"""all-MiniLM-L6-v2 through a target backend against ggml CPU in this process, in one run.

Theory of operation: opens the target with `apir.models.backends.open_backend` (APIR over the
embedded host by default, `--socket` / `--drm` for the others) and a baseline with
`open_local_cpu` (same thread count), puts the model on both, and measures:

  weight upload MB/s   model bytes / time inside ggml_backend_tensor_set (both backends)
  batch time           one `MiniLM.embed_tokens` of a fixed padded batch: build the graph,
                       allocate, set inputs, compute, read the output (median of --repeats)
  compute time         ggml_backend_graph_compute alone (median)
  ratio                target / local for each; the APIR target is <= 1.05 for batch time
  sentences/s          batch size / median batch time

Target and baseline runs alternate so drift on a shared machine hits both alike. Until the APIR
guest backend exists, the target is local ggml CPU too (flagged FALLBACK) and the ratios only
show the measurement's noise. Also reports whether both outputs are byte-identical.

Run: PYTHONPATH=. python benchmarks/bench_minilm.py [--socket PATH | --drm NODE] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from apir.models.assets import load_assets
from apir.devices import device_spec
from apir.models.backends import open_backend, open_local_cpu, open_local_device
from apir.models.minilm import MiniLM

_TEXT = ("the quick brown fox jumps over the lazy dog while a committee of engineers argues about "
         "where the new bridge should stand and how much the river will rise in spring").split()


def make_sentences(n: int, max_words: int) -> list:
    """`n` deterministic sentences of 3 .. max_words words (varied lengths, so the batch is padded)."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        k = 3 + (i * 7919) % max(1, max_words - 2)
        out.append(" ".join(_TEXT[j % len(_TEXT)] for j in rng.integers(0, len(_TEXT), k)) + ".")
    return out


def _time_batch(model: MiniLM, batch):
    t0 = time.perf_counter()
    out = model.embed_tokens(batch)
    return time.perf_counter() - t0, model.last_timing["compute"], out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH")
    where.add_argument("--drm", metavar="NODE")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-words", type=int, default=40, help="longest sentence in words (default 40)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2, help="threads of the local CPU backend(s)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--backend", metavar="SPEC", default=None,
                   help="ggml backend (apir.ggml.backend_spec: cpu, vulkan:0, rpc:HOST:PORT) of the embedded "
                        "host and of the local baseline (default: ggml CPU)")
    p.add_argument("--host-config", metavar="KEY=VALUE", action="append", default=[],
                   help="configuration of the embedded host (repeatable), e.g. apir.host.import_host_memory=1")
    args = p.parse_args(argv)

    assets = load_assets()
    sentences = make_sentences(args.batch_size, args.max_words)
    config = dict(item.split("=", 1) for item in args.host_config)
    if args.backend:
        config["apir.host.backend"] = args.backend
    target_ob = open_backend(device_spec(args.socket, args.drm), n_threads=args.threads, config=config or None)
    local_ob = open_local_device(args.backend, args.threads) if args.backend else open_local_cpu(args.threads)
    try:
        target = MiniLM(target_ob.backend, target_ob.buft, assets=assets)
        local = MiniLM(local_ob.backend, local_ob.buft, assets=assets)
        batch = assets.tokenizer.encode(sentences)
        # Warm-up: first allocation of each compute buffer, thread pools, caches.
        _, _, out_t = _time_batch(target, batch)
        _, _, out_l = _time_batch(local, batch)
        times = {"target": ([], []), "local": ([], [])}
        for _ in range(args.repeats):
            for name, model in (("target", target), ("local", local)):
                total, compute, out = _time_batch(model, batch)
                times[name][0].append(total)
                times[name][1].append(compute)
                if name == "target":
                    out_t = out
                else:
                    out_l = out
        upload = {name: m.upload_bytes / m.upload_seconds / 1e6 for name, m in (("target", target), ("local", local))}
        target.close()
        local.close()
    finally:
        target_ob.close()
        local_ob.close()

    med = {name: (statistics.median(t[0]), statistics.median(t[1])) for name, t in times.items()}
    res = {
        "target": target_ob.description, "local": local_ob.description,
        "target_through_apir": target_ob.through_apir, "target_is_fallback": target_ob.fallback,
        "batch_size": args.batch_size, "padded_tokens": int(batch.ids.shape[1]), "repeats": args.repeats,
        "upload_MBps": upload, "upload_ratio": upload["target"] / upload["local"],
        "batch_s": {k: v[0] for k, v in med.items()}, "compute_s": {k: v[1] for k, v in med.items()},
        "batch_ratio": med["target"][0] / med["local"][0], "compute_ratio": med["target"][1] / med["local"][1],
        "sentences_per_s": {k: args.batch_size / v[0] for k, v in med.items()},
        "byte_identical": bool(np.array_equal(out_t.view(np.uint32), out_l.view(np.uint32))),
        "max_abs_diff": float(np.abs(out_t - out_l).max()),
    }
    if args.json:
        json.dump(res, sys.stdout, indent=1)
        print()
        return 0
    print(f"all-MiniLM-L6-v2 benchmark: {args.batch_size} sentences padded to {res['padded_tokens']} tokens, "
          f"median of {args.repeats}")
    print(f"target: {res['target']}")
    print(f"local:  {res['local']}")
    if not target_ob.through_apir:
        print("NOTE: the target is local ggml CPU, not APIR: this run compares local with local, "
              "so the ratios show only measurement noise.")
    print(f"{'':22}{'target':>10}{'local':>10}{'ratio':>8}")
    print(f"{'weight upload MB/s':22}{upload['target']:10.0f}{upload['local']:10.0f}{res['upload_ratio']:8.2f}")
    print(f"{'batch time ms':22}{med['target'][0] * 1e3:10.1f}{med['local'][0] * 1e3:10.1f}"
          f"{res['batch_ratio']:8.3f}   (target <= 1.05)")
    print(f"{'  of which compute ms':22}{med['target'][1] * 1e3:10.1f}{med['local'][1] * 1e3:10.1f}"
          f"{res['compute_ratio']:8.3f}")
    sps = res["sentences_per_s"]
    print(f"{'sentences/s':22}{sps['target']:10.1f}{sps['local']:10.1f}{sps['target'] / sps['local']:8.2f}")
    print(f"outputs byte-identical: {'yes' if res['byte_identical'] else 'NO'} "
          f"(max abs diff {res['max_abs_diff']:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
