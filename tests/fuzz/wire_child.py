"""The process that hosts a protocol fuzzer's target and runs its inputs (the driver's child).

Run by the driver as `python -m tests.fuzz.wire_child --fuzzer NAME --seed S [options]`
(NAME: socket, vhost, guests; tests.fuzz.protokit says what a target is). It speaks
tests.fuzz.child's line protocol: `ready 0 0 0`, then for `run A B` each input I prints `s I
CASE`, `k I [STEP KINDS]`, a `b I KIND DETAIL` line per oracle failure, and `d I NO_REPLY
ALIVE EXCEPTIONS COMPUTED BROKEN`; then `ok` (after `r` when it leaves to be started afresh,
its resident memory past RECYCLE_RSS). Input I's steps come from
`numpy.random.default_rng([S, I])` alone. After each input: every hostile peer is gone, a
fresh well-behaved peer is served (ALIVE), no internal exception was logged, no descriptor or
thread is left over the baseline taken once the target was warm.

`--only I --record PATH` writes input I's reproducer and runs it; `--replay PATH...` runs
reproducer files (exit 1 when one failed the oracle without crashing).
`APIR_FUZZ_SELFTEST=KIND@I,...` (abort, hang, leak, error) makes input I do that instead.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import resource
import signal
import sys
import tempfile
import time
import traceback

import numpy as np

from tests.fuzz.protokit import Outcome, Recording, Target, Watch

# One ggml thread (a child per core), a small buffer budget, graphs bounded well under the
# hang deadline; HELLO and front-end waits short, so a peer that stalls costs little.
DEFAULT_CONFIG = {
    "apir.host.n_threads": "1",
    "apir.host.buffer_budget": str(256 << 20),
    "apir.host.graph_time_limit_s": "5",
    "apir.local.hello_timeout_s": "2",
}


# A child whose resident memory passed this after a chunk leaves and the driver starts another:
# the guests fuzzer's own clients (numpy, ggml contexts, mappings of a process hosting both
# ends) grow its heap by a few MiB per input, which an address-space limit turns into failures
# that are the harness's, not the host's.
RECYCLE_RSS = int(os.environ.get("APIR_FUZZ_RECYCLE_RSS", 1 << 30))


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_target(name: str, config: dict, workdir: str) -> Target:
    if name == "socket":
        from tests.fuzz.wire_socket import SocketTarget

        return SocketTarget(config, workdir)
    if name == "vhost":
        from tests.fuzz.wire_vhost import VhostTarget

        return VhostTarget(config, workdir)
    if name == "guests":
        from tests.fuzz.guests import GuestsTarget

        return GuestsTarget(config, workdir)
    raise SystemExit(f"unknown fuzzer {name!r} (socket, vhost, guests)")


_leaked = []


def _selftest(kind: str) -> None:
    if kind == "abort":
        os.abort()
    elif kind == "hang":
        time.sleep(3600)
    elif kind == "leak":
        _leaked.append(os.open(os.devnull, os.O_RDONLY))
    elif kind == "error":
        try:
            raise RuntimeError("selftest")
        except RuntimeError:
            logging.getLogger("apir.host.selftest").exception("selftest: an internal error")


def run_one(target: Target, watch: Watch, steps, out=None, i: int = 0, selftest: str = ""):
    """Runs `steps`, then the oracle; (no_reply, alive, exceptions, computed, failures)."""
    before = watch.errors.count
    if selftest:
        _selftest(selftest)
    outcome: Outcome = target.run(steps)
    alive, failures = target.check()
    failures = outcome.broken + failures + watch.leaks()
    exceptions = watch.errors.count - before
    if exceptions:
        failures.append(f"internal-exception {watch.errors.last}")
    if outcome.no_reply:
        failures.append(f"no-reply {outcome.no_reply} requests unanswered")
    if not alive:
        failures.append("not-serving a fresh peer was not served")
    if out is not None:
        for f in failures:
            out.write(f"b {i} {f}".replace("\n", " ")[:1000] + "\n")
    return outcome.no_reply, alive, exceptions, outcome.computed, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fuzzer", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default="{}")
    ap.add_argument("--record")
    ap.add_argument("--only", type=int)
    ap.add_argument("--replay", nargs="+")
    ap.add_argument("--seeds-cache", help="(the graph fuzzer's; unused)")
    ap.add_argument("--rlimit-as", type=int, default=0)
    ap.add_argument("--rss-limit", type=int, default=2 << 30)
    args = ap.parse_args(argv)

    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)
    if args.rlimit_as:
        resource.setrlimit(resource.RLIMIT_AS, (args.rlimit_as, args.rlimit_as))
    config = {**DEFAULT_CONFIG, **json.loads(args.config)}
    recs = []
    if args.replay:
        for path in args.replay:
            with open(path) as fh:
                recs.append((path, Recording.from_json(fh.read())))
        if {r.fuzzer for _, r in recs} != {args.fuzzer}:
            print(f"reproducers of {sorted({r.fuzzer for _, r in recs})}, not {args.fuzzer}", file=sys.stderr)
            return 2
        config = {**config, **recs[0][1].config}
    watch = Watch()
    workdir = tempfile.mkdtemp(prefix=f"apir-fuzz-{args.fuzzer}-")
    target = make_target(args.fuzzer, config, workdir)
    for _ in range(2):  # warm: the first context loads ggml, the first peers start pools
        target.check()
    watch.set_baseline()
    out = sys.stdout

    if args.replay:
        worst = 0
        for path, rec in recs:
            print(f"replaying {path}", flush=True)
            no_reply, alive, exc, computed, failures = run_one(target, watch, rec.steps)
            print(
                f"replayed: {no_reply} requests without a reply, fresh peer served: {alive}, "
                f"internal exceptions: {exc}, failures: {failures}",
                flush=True,
            )
            if failures:
                worst = 1
        return worst

    selftest = {}
    for item in filter(None, os.environ.get("APIR_FUZZ_SELFTEST", "").split(",")):
        kind, _, at = item.partition("@")
        selftest[int(at)] = kind
    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def run(i: int) -> None:
        rng = np.random.default_rng([args.seed, i])
        case, steps = target.generate(rng)
        if args.record:
            meta = {"seed": args.seed, "index": i, "fuzzer": args.fuzzer}
            with open(args.record, "w") as fh:
                fh.write(Recording(args.fuzzer, config, case, steps, meta).to_json())
        out.write(f"s {i} {args.fuzzer}:{case}\n")
        out.write(f"k {i} {json.dumps(sorted({s.get('op', '?') for s in steps}))}\n")
        out.flush()
        no_reply, alive, exc, computed, failures = run_one(target, watch, steps, out, i, selftest.get(i, ""))
        out.write(f"d {i} {no_reply} {int(alive)} {exc} {computed} {len(failures)}\n")
        if failures:
            watch.set_baseline()  # one leak is one input's fault, not every later one's
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline_rss
        if args.rss_limit and grown > args.rss_limit:
            out.write(f"m {i} {grown}\n")
            out.flush()
            sys.exit(3)
        out.flush()

    if args.only is not None:
        run(args.only)
        return 0
    out.write("ready 0 0 0\n")
    out.flush()
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "run":
            break
        for i in range(int(parts[1]), int(parts[2])):
            try:
                run(i)
            except Exception as exc:  # noqa: BLE001 - the harness's own bug: reported, not a host fault
                traceback.print_exc()
                out.write(f"e {i} {type(exc).__name__}: {exc!s:.200}\n".replace("\n", " ").rstrip() + "\n")
                out.flush()
        recycle = _rss() > RECYCLE_RSS
        if recycle:
            out.write("r\n")
        out.write("ok 0 ''\n")
        out.flush()
        if recycle:
            os._exit(0)  # (its threads and mappings go with it)
    target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
