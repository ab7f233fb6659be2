"""The fuzzed host's process: runs inputs by index, reports each over stdout.

Run by the driver as `python -m tests.fuzz.child --seed S [options]`. It loads ggml,
installs the fences (`FencedBuffers`, `Fences`), builds the seed graphs, prints `ready
N_SEEDS N_SKIPPED`, then serves lines on stdin: `run A B` runs inputs A..B-1 and prints `s I
CASE` before, `k I MUTATIONS` (JSON) before each command, and `d I NO_REPLY ALIVE EXCEPTIONS
COMPUTED 0 USE_COUNTS` after each (0: no oracle of its own fails; USE_COUNTS 1 when the host
built the input's graphs with the guest's use counts), then `ok`. An exception of the
harness itself (not of the host, whose `submit` never raises) is reported as `e I MESSAGE`
instead of `d`. Input I is `make_input(numpy.random.default_rng([S, I]), seed graph, fresh
Env, agrees_use_counts(I))`: the same on every run and in every worker. `--record PATH
--only I` runs input I alone, rewriting the reproducer at PATH before each step (the
driver's way to save a crash); `--replay PATH` runs a saved reproducer
(exit status 1 when the host failed without crashing).

An input after which this process's peak RSS is more than `--rss-limit` bytes (2 GiB) above
what it was once the seeds were built is reported as `m I BYTES` (a memory fault: the host
committed that much for one guest's input), and the process exits (its peak cannot go down
again).

Faults are the point: a signal kills this process (faulthandler prints where, on stderr), a
GGML_ASSERT aborts it; the driver counts it and starts another.
`APIR_FUZZ_SELFTEST=KIND@I,...` (oob, buf, uaf, abort, hang) makes input I do that instead,
to test that the harness sees each kind.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import resource
import signal
import sys
import time
import traceback

import numpy as np

# One ggml thread per child (the campaign runs a child per core); the buffer budget and the
# host's default work budget (1 GiB) together under the memory-fault threshold (--rss-limit,
# 2 GiB), so that an input the host's bounds allow is not counted; a graph time limit well
# under the hang deadline (20 s), so that only a single node running on (which ggml's abort
# callback cannot stop) is a hang.
DEFAULT_CONFIG = {
    "apir.host.n_threads": "1",
    "apir.host.buffer_budget": str(256 << 20),
    "apir.host.graph_time_limit_s": "5",
}


def _selftest(kind: str, env, fences, fenced) -> None:
    """Faults of each kind the harness must see, done by the harness itself."""
    base = env.ctx._library.buffers.get(env.alloc([b"\0" * 4000])[0]).base
    if kind == "oob":  # one byte past the data blob: its guard page
        ctypes.string_at(fences.data.end, 1)
    elif kind == "buf":  # one page past the end of a host buffer of 4000 bytes: its guard
        ctypes.string_at(base + 4096, 1)
    elif kind == "uaf":  # a host buffer after free_buffer (kept unreadable in the quarantine)
        env.close()
        ctypes.string_at(base, 1)
    elif kind == "abort":
        os.abort()
    elif kind == "hang":
        time.sleep(3600)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _replay_all(paths, fences, errors) -> int:
    """Replays each reproducer on a fresh context, saying which before it runs (a crash
    then names its file); 1 when one failed without crashing (no reply, not serving, an
    internal exception), else 0."""
    from tests.fuzz.inputs import Recording, replay

    worst = 0
    for path in paths:
        print(f"replaying {path}", flush=True)
        with open(path) as fh:
            rec = Recording.from_json(fh.read())
        no_reply, alive, exceptions, use_counts = replay(rec, fences)
        ok = (no_reply, alive, exceptions) == (0, True, 0)
        print(
            f"replayed: {no_reply} commands without a reply, host alive: {alive}, "
            f"internal exceptions: {exceptions} ({errors.last}), use counts: {use_counts}",
            flush=True,
        )
        worst = worst or (0 if ok else 1)
    return worst


def _warm_up(seed, fences, config) -> None:
    """Computes `seed` as it is, on a throwaway Env, before the child says `ready`. Otherwise
    a fresh child's first input pays for what the host loads on first use (ggml's backend,
    its Numba kernels from their cache), many times a typical input, and on a loaded machine
    past the hang deadline, where a child started after a fault would have its first input
    counted as a hang. Raises RuntimeError when the
    seed is not computed (every seed is a graph this host accepted)."""
    import struct

    from apir.codec.constants import ApirBackendCommandType as Cmd
    from tests.fuzz.corpus import join_wire
    from tests.fuzz.inputs import GRAPH_RES, Env, forward

    env = Env(fences, config, 4096)
    try:
        handle = env.alloc([seed.image])[0]
        recs = seed.recs.copy()
        recs["buffer"][recs["buffer"] == seed.handle] = handle
        wire = join_wire(seed.nodes, recs)
        env.write(GRAPH_RES, wire)
        rc, _ = env.submit(forward(Cmd.BACKEND_GRAPH_COMPUTE, struct.pack("<IQ", GRAPH_RES, len(wire))))
        if env.computed != 1:
            raise RuntimeError(f"warm-up: seed {seed.name} not computed (rc {rc})")
    finally:
        env.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default="{}", help="JSON: host configuration keys added to the defaults")
    ap.add_argument("--record", help="reproducer path (with --only)")
    ap.add_argument("--only", type=int, help="run this one input and exit")
    ap.add_argument("--seeds-cache", help="file the seed graphs are kept in (built when missing)")
    ap.add_argument("--replay", nargs="+", help="run these reproducer files (tests.fuzz.inputs.Recording) and exit")
    ap.add_argument("--no-fence-buffers", action="store_true")
    ap.add_argument("--rlimit-as", type=int, default=0, help="address-space limit in bytes (0: none)")
    ap.add_argument(
        "--rss-limit",
        type=int,
        default=2 << 30,
        help="peak-RSS growth over the start that makes an input a memory fault (0: none)",
    )
    args = ap.parse_args(argv)

    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)  # the driver's "where are you" before it kills a hang
    if args.rlimit_as:
        resource.setrlimit(resource.RLIMIT_AS, (args.rlimit_as, args.rlimit_as))
    import apir.ggml
    from apir.host import HostContext
    from tests.fuzz.corpus import load_or_build_seeds
    from tests.fuzz.fence import FencedBuffers
    from tests.fuzz.inputs import Env, Fences, HostErrors
    from tests.fuzz.mutate import Mutator, agrees_use_counts
    from tests.host.hostkit import Guest

    config = {**DEFAULT_CONFIG, **json.loads(args.config)}
    g = apir.ggml.load()
    errors = HostErrors.install()
    fenced = FencedBuffers(g)
    if not args.no_fence_buffers:
        fenced.install()
    fences = Fences()
    if args.replay:
        return _replay_all(args.replay, fences, errors)
    seeds, skipped = load_or_build_seeds(g, lambda: Guest(HostContext(900, config)), args.seeds_cache)
    if not seeds:
        print("no seed graphs", file=sys.stderr)
        return 2
    mut = Mutator(g)
    selftest = {}
    for item in filter(None, os.environ.get("APIR_FUZZ_SELFTEST", "").split(",")):
        kind, _, at = item.partition("@")
        selftest[int(at)] = kind
    out = sys.stdout

    baseline = _peak_rss()

    def run(i: int, record=None) -> None:
        rng = np.random.default_rng([args.seed, i])
        seed = seeds[int(rng.integers(len(seeds)))]
        out.write(f"s {i} {seed.name}\n")
        out.flush()
        env = Env(fences, config, 4096, record_to=record, meta={"ggml": g.version, "seed": args.seed, "index": i})
        before = errors.count
        env.on_command = lambda meta: (out.write(f"k {i} {json.dumps(meta.get('mutations', []))}\n"), out.flush())
        try:
            if i in selftest:
                _selftest(selftest[i], env, fences, fenced)
            mut.make_input(rng, seed, env, use_counts=agrees_use_counts(i))
            alive = env.alive()
            use_counts = env.use_counts()
        finally:
            env.close()
        out.write(f"d {i} {env.no_reply} {int(alive)} {errors.count - before} {env.computed} 0 {int(use_counts)}\n")
        grown = _peak_rss() - baseline
        if args.rss_limit and grown > args.rss_limit:
            # ru_maxrss only grows: report the input that raised it, then start afresh
            out.write(f"m {i} {grown}\n")
            out.flush()
            sys.exit(3)
        out.flush()

    if args.only is not None:
        run(args.only, args.record)
        return 0
    _warm_up(seeds[0], fences, config)
    baseline = _peak_rss()
    out.write(f"ready {len(seeds)} {len(skipped)} {fenced.fenced_allocs}\n")
    out.flush()
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "run":
            break
        a, b = int(parts[1]), int(parts[2])
        for i in range(a, b):
            try:
                run(i)
            except Exception as exc:  # noqa: BLE001 - the harness's own bug: reported, not a host fault
                traceback.print_exc()
                out.write(f"e {i} {type(exc).__name__}: {exc!s:.200}\n".replace("\n", " ").rstrip() + "\n")
                out.flush()
        out.write(f"ok {fenced.fenced_allocs} {errors.last!r}\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
