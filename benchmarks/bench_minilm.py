"""all-MiniLM-L6-v2 through a target backend against ggml CPU in this process, in one run.

Theory of operation: opens the target with `apir.models.backends.open_backend` (APIR over the
embedded host by default, `--socket` / `--drm` for the others) and a baseline with
`open_local_cpu` (same thread count), puts the model on both, and measures:

  weight upload MB/s   model bytes / time inside ggml_backend_tensor_set (both backends)
  batch time           one `MiniLM.embed_tokens` of a fixed padded batch: build the graph,
                       allocate, set inputs, compute, read the output (median of --repeats)
  compute time         ggml_backend_graph_compute alone (median)
  ratio                target / local for each; the APIR target for batch time is <= 1.05 on
                       ggml CPU, <= 1.10 on a GPU backend (--backend vulkan:N)
  sentences/s          batch size / median batch time
  host graph cache     hits and misses of the embedded target host's graph cache
                       (apir.host.graph.cache) over the whole run: a repeated batch's graph
                       hits after the first

Target and baseline runs alternate so drift on a shared machine hits both alike, each round
starting with the next of them (the first batch of a round runs faster than the last). Until the APIR
guest backend exists, the target is local ggml CPU too (flagged FALLBACK) and the ratios only
show the measurement's noise. Also reports whether both outputs are byte-identical.

The peer, ggml-rpc: on ggml CPU (no --backend, or cpu), the same run also
starts an rpc-server on loopback (--threads threads, benchmarks/rpc_peer.py) and computes the
same batch with the same model code (apir.models.minilm) in this process on ggml-rpc's backend
from ggml's registry (`open_local_device("rpc:127.0.0.1:PORT")`), next to apir's embedded host
and an `apir host serve` it starts (whichever of the two is not the target already), all in the
same alternation. Each batch time is printed with its ratio to ggml-rpc's (target <= 1.0: apir
no slower than ggml-rpc), and with the median of its per-round ratios (each batch over the
ggml-rpc batch of the same round, so drift between rounds cancels) and that median's 95%
interval (distribution-free: benchmarks/paired_stats.py). Local ggml CPU gets the same paired
figure: the same kernels with no remoting at all, so its interval shows how far from 1.0
parity lands in this run. Only batch times compare: ggml-rpc's graph_compute returns before the
server computes (RPC_CMD_GRAPH_COMPUTE has no answer), so its compute time is the send alone
and its wait falls in the output's read. The whole run then loads the ggml build that has
ggml-rpc's client (apir's hosts, the baseline and rpc-server all on the same ggml CPU kernels);
without that build the peer is skipped with a note on how to build it (--no-rpc-peer: leave it
out).

Run: PYTHONPATH=. python benchmarks/bench_minilm.py [--socket PATH | --drm NODE] [--no-rpc-peer] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from apir.models.assets import load_assets
from apir.devices import device_spec
from apir.models.backends import open_backend, open_local_cpu, open_local_device
from apir.ggml import load as load_ggml
from apir.models.minilm import MiniLM

import rpc_peer
from paired_stats import median_interval
from bench_roundtrip import _wait_for_socket

RPC_TARGET = 1.0  # batch time of each apir mode over ggml-rpc's
# batch time through apir over local: on ggml CPU 1.05; on a GPU backend 1.10 (for a
# batch large enough that the GPU, not the call overhead, dominates)
BATCH_TARGET = {"cpu": 1.05, "gpu": 1.10}

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


def _recording_factory(contexts: list):
    """An embedded host's context factory that also keeps each context in `contexts`."""
    from apir.host.local.kernel import default_context_factory

    def factory(ctx_id, capset_id, config):
        ctx = default_context_factory(ctx_id, capset_id, config)
        contexts.append(ctx)
        return ctx

    return factory


def _cache_counts(contexts: list):
    """{"hits", "misses"} of the graph caches of `contexts` (None: no embedded host's)."""
    caches = [c._library.graph_cache for c in contexts if hasattr(getattr(c, "_library", None), "graph_cache")]
    if not caches:
        return None
    return {"hits": sum(c.hits for c in caches), "misses": sum(c.misses for c in caches)}


def _time_batch(model: MiniLM, batch):
    t0 = time.perf_counter()
    out = model.embed_tokens(batch)
    return time.perf_counter() - t0, model.last_timing["compute"], out


@contextlib.contextmanager
def socket_host(threads: int):
    """An `apir host serve` (ggml CPU, `threads` threads) on a socket in a temporary folder,
    listening; yields its apir.devices spec (``unix:PATH``)."""
    with tempfile.TemporaryDirectory(prefix="apir-bench-") as tmp:
        path = os.path.join(tmp, "apir.sock")
        proc = subprocess.Popen([sys.executable, "-m", "apir.cli", "host", "serve", "--socket", path,
                                 "--config", f"apir.host.n_threads={threads}"], stderr=subprocess.DEVNULL)
        try:
            _wait_for_socket(path, proc)
            yield f"unix:{path}"
        finally:
            proc.terminate()
            proc.wait(10)


def open_peers(stack: contextlib.ExitStack, paths: dict, target_transport: str, threads: int) -> dict:
    """name -> OpenedBackend of the peer run: apir's embedded host and an `apir host serve` (the
    one of them that is not the target) and ggml-rpc's backend on an rpc-server, each closed with
    `stack`."""
    peers = {}
    config = {"apir.host.n_threads": str(threads)}
    if target_transport != "embedded":
        peers["apir embedded"] = stack.enter_context(open_backend(None, allow_fallback=False, config=config))
    if target_transport != "socket":
        spec = stack.enter_context(socket_host(threads))
        peers["apir socket host"] = stack.enter_context(open_backend(spec))
    server = stack.enter_context(rpc_peer.RpcServer(paths, threads))
    peers["ggml-rpc"] = stack.enter_context(open_local_device(server.spec, threads))
    return peers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH")
    where.add_argument("--drm", metavar="NODE")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-words", type=int, default=40, help="longest sentence in words (default 40)")
    p.add_argument("--repeats", type=int, default=20,
                   help="rounds (default 20: a multiple of the up to four backends, so each starts as many)")
    p.add_argument("--threads", type=int, default=2, help="threads of the local CPU backend(s)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-rpc-peer", action="store_true",
                   help="leave the ggml-rpc peer out (and the ggml build it needs)")
    p.add_argument("--backend", metavar="SPEC", default=None,
                   help="ggml backend (apir.ggml.backend_spec: cpu, vulkan:0, rpc:HOST:PORT) of the embedded "
                        "host and of the local baseline (default: ggml CPU)")
    p.add_argument("--host-config", metavar="KEY=VALUE", action="append", default=[],
                   help="configuration of the embedded host (repeatable), e.g. apir.host.import_host_memory=1")
    args = p.parse_args(argv)
    if args.no_rpc_peer:
        paths, peer_skipped = None, "ggml-rpc peer left out (--no-rpc-peer)"
    elif args.backend not in (None, "cpu"):
        paths, peer_skipped = None, f"ggml-rpc peer skipped: its rpc-server runs ggml CPU, not {args.backend}"
    else:
        paths, peer_skipped = rpc_peer.find_build()
        if paths is not None:
            peer_skipped = rpc_peer.use_build(paths) or ""
            if peer_skipped:
                paths = None

    assets = load_assets()
    sentences = make_sentences(args.batch_size, args.max_words)
    config = dict(item.split("=", 1) for item in args.host_config)
    if args.backend:
        config["apir.host.backend"] = args.backend
    # the embedded host computes with --threads threads, as the baseline and the peers do
    config.setdefault("apir.host.n_threads", str(args.threads))
    with contextlib.ExitStack() as stack:
        spec = device_spec(args.socket, args.drm)
        contexts: list = []  # the embedded target host's contexts, for their graph cache counts
        options = None if spec is not None else {"context_factory": _recording_factory(contexts)}
        target_ob = stack.enter_context(
            open_backend(spec, n_threads=args.threads, config=config or None, device_options=options))
        local_ob = stack.enter_context(
            open_local_device(args.backend, args.threads) if args.backend else open_local_cpu(args.threads))
        obs = {"target": target_ob, "local": local_ob}
        if paths is not None:
            obs.update(open_peers(stack, paths, target_ob.transport, args.threads))
        models = {name: stack.enter_context(MiniLM(ob.backend, ob.buft, assets=assets)) for name, ob in obs.items()}
        batch = assets.tokenizer.encode(sentences)
        # Warm-up: first allocation of each compute buffer, thread pools, caches.
        outs = {name: _time_batch(model, batch)[2] for name, model in models.items()}
        times = {name: ([], []) for name in models}
        names = list(models)
        for r in range(args.repeats):
            # each round starts with the next backend: in a round of three identical ggml CPU
            # backends the last batch ran up to 9% slower than the first, so each takes every
            # place in turn
            for name in names[r % len(names) :] + names[: r % len(names)]:
                model = models[name]
                total, compute, outs[name] = _time_batch(model, batch)
                times[name][0].append(total)
                times[name][1].append(compute)
        upload_all = {name: m.upload_bytes / m.upload_seconds / 1e6 for name, m in models.items()}
        graph_cache = _cache_counts(contexts)
    out_t, out_l = outs["target"], outs["local"]
    upload = {k: upload_all[k] for k in ("target", "local")}

    med = {name: (statistics.median(t[0]), statistics.median(t[1])) for name, t in times.items()}
    peer = None
    if paths is not None:
        rpc_s = med["ggml-rpc"][0]
        peer = {"rpc_server_threads": args.threads, "ggml_rpc_batch_s": rpc_s, "target": RPC_TARGET, "rows": []}
        rpc_rounds = times["ggml-rpc"][0]
        for name in [n for n in models if n not in ("local", "ggml-rpc")] + ["local"]:
            if name == "local":
                label = "local ggml (reference)"
            else:
                label = f"apir {target_ob.transport} (target)" if name == "target" else name
            paired = median_interval([t / r for t, r in zip(times[name][0], rpc_rounds)])
            peer["rows"].append({
                "name": label, "batch_s": med[name][0], "ratio": med[name][0] / rpc_s,
                "paired_ratio": paired[0], "paired_interval": paired[1:], "apir": name != "local",
                "upload_MBps": upload_all[name],
                "byte_identical": bool(np.array_equal(outs[name].view(np.uint32), outs["ggml-rpc"].view(np.uint32))),
            })
        peer["ggml_rpc_upload_MBps"] = upload_all["ggml-rpc"]
    res = {
        "target": target_ob.description, "local": local_ob.description,
        "target_through_apir": target_ob.through_apir, "target_is_fallback": target_ob.fallback,
        "batch_size": args.batch_size, "padded_tokens": int(batch.ids.shape[1]), "repeats": args.repeats,
        "upload_MBps": upload, "upload_ratio": upload["target"] / upload["local"],
        "batch_s": {k: v[0] for k, v in med.items()}, "compute_s": {k: v[1] for k, v in med.items()},
        "batch_ratio": med["target"][0] / med["local"][0],
        "batch_target": BATCH_TARGET["cpu" if args.backend in (None, "cpu") else "gpu"],
        "compute_ratio": med["target"][1] / med["local"][1],
        "sentences_per_s": {k: args.batch_size / v[0] for k, v in med.items()},
        "byte_identical": bool(np.array_equal(out_t.view(np.uint32), out_l.view(np.uint32))),
        "max_abs_diff": float(np.abs(out_t - out_l).max()),
        "ggml_lib_dir": str(load_ggml().lib_dir),
        "ggml_rpc_peer": peer, "ggml_rpc_peer_skipped": peer_skipped or None,
        "graph_cache": graph_cache,
    }
    if args.json:
        json.dump(res, sys.stdout, indent=1)
        print()
        return 0
    print(f"all-MiniLM-L6-v2 benchmark: {args.batch_size} sentences padded to {res['padded_tokens']} tokens, "
          f"median of {args.repeats}")
    print(f"target: {res['target']}")
    print(f"local:  {res['local']}")
    print(f"ggml:   {res['ggml_lib_dir']}")
    if not target_ob.through_apir:
        print("NOTE: the target is local ggml CPU, not APIR: this run compares local with local, "
              "so the ratios show only measurement noise.")
    print(f"{'':22}{'target':>10}{'local':>10}{'ratio':>8}")
    print(f"{'weight upload MB/s':22}{upload['target']:10.0f}{upload['local']:10.0f}{res['upload_ratio']:8.2f}")
    print(f"{'batch time ms':22}{med['target'][0] * 1e3:10.1f}{med['local'][0] * 1e3:10.1f}"
          f"{res['batch_ratio']:8.3f}   (target <= {res['batch_target']:.2f})")
    print(f"{'  of which compute ms':22}{med['target'][1] * 1e3:10.1f}{med['local'][1] * 1e3:10.1f}"
          f"{res['compute_ratio']:8.3f}")
    sps = res["sentences_per_s"]
    print(f"{'sentences/s':22}{sps['target']:10.1f}{sps['local']:10.1f}{sps['target'] / sps['local']:8.2f}")
    print(f"outputs byte-identical: {'yes' if res['byte_identical'] else 'NO'} "
          f"(max abs diff {res['max_abs_diff']:.3g})")
    if graph_cache is not None:
        print(f"host graph cache: {graph_cache['hits']} hits, {graph_cache['misses']} misses")
    if peer is None:
        print(peer_skipped)
        return 0
    print(f"\nthe peer: ggml-rpc, rpc-server on loopback (ggml CPU, {args.threads} threads), same batch")
    print(f"{'':28}{'batch ms':>10}{'/ ggml-rpc':>12}{'target':>9}{'paired (95% interval)':>25}"
          f"{'upload MB/s':>13}  same output")
    for row in peer["rows"]:
        lo, hi = row["paired_interval"]
        paired = f"{row['paired_ratio']:.3f} ({lo:.3f}-{hi:.3f})"
        print(f"{row['name']:28}{row['batch_s'] * 1e3:10.1f}{row['ratio']:12.3f}{'<= 1.0' if row['apir'] else '':>9}"
              f"{paired:>25}{row['upload_MBps']:13.0f}  {'yes' if row['byte_identical'] else 'NO'}")
    print(f"{'ggml-rpc':28}{peer['ggml_rpc_batch_s'] * 1e3:10.1f}{1.0:12.3f}{'':9}{'':25}"
          f"{peer['ggml_rpc_upload_MBps']:13.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
