#!/usr/bin/env python3
"""ggml's test-backend-ops through apir's host, next to the same suite on ggml CPU directly.

    scripts/run-test-backend-ops.py [--version 0.20|0.10|0.25] [--ops ADD,MUL_MAT,...] [--c-library]
                                    [-j N] [--json FILE] [--timeout S] [--max-resume N]
                                    [--deadline S] [--resume-jobs K] [--host-threads N]

Builds (or reuses) the C reference of --version and the shim, starts an apir host process on the
C build's ggml (apir's Python dispatcher, or with --c-library the C backend library), then runs
every op (default: all of `test-backend-ops --list-ops`) twice: `-b CPU` without the shim (ggml
CPU directly) and `-b "[virtgpu] CPU"` with the shim (through apir). Prints per-op and total
passed / failed / not supported counts for both, and every case that passes on CPU but not
through apir. Exit status 1 when there is such a case. `-j N` runs N ops at a time (threads
driving the test-backend-ops processes), each worker with its own apir host process; `--json`
writes the counts (per op and in total), those cases and every case's status. `--deadline S`
bounds the whole run: after S seconds no op is started and no case resumed (those are listed
as not run), so a run fits a machine lent for a fixed time. An --ops entry `OP/REGEX` runs the
cases of OP whose parameters match REGEX (test-backend-ops -p), so a heavy op can be split
over several workers (e.g. FLASH_ATTN_EXT/type_KV=f16, FLASH_ATTN_EXT/type_KV=q8_0).
`--resume-jobs K` re-runs up to K cases of an op at a time after an early end; `--host-threads`
sets the CPU threads of each apir host (default: the core count, too many with -j).
`--backend vulkan[:N]` makes the hosts compute on ggml Vulkan (scripts/build-ggml-backends.sh's
build) and the baseline that build's test-backend-ops on `VulkanN` directly, so the counts read
"through apir on Vulkan" next to "Vulkan directly"; `--lavapipe` runs both on the build's Mesa
lavapipe (tests/ggml_backends.py), else on the machine's Vulkan driver. Run from the
repository root (or anywhere: it puts the root on sys.path). See docs/interop.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import cref  # noqa: E402
from tests.interop import backend_ops as bo  # noqa: E402
from tests.interop.harness import HostProcess, build_shim, guest_env  # noqa: E402


def _counts(run: bo.OpRun) -> dict:
    return {k: run.count(k) for k in (bo.OK, bo.FAIL, bo.NOT_SUPPORTED, bo.SKIPPED, bo.CRASHED)}


class _Worker:
    """One apir host process per worker thread (a host that dies takes only its worker's op
    with it, and is restarted for the next)."""

    def __init__(self, paths, sock_dir: Path, c_library: bool, n_threads=None, backend=None, env=None):
        self.paths, self.sock_dir, self.c_library, self.n_threads = paths, sock_dir, c_library, n_threads
        self.backend, self.env = backend, env
        self.local = threading.local()
        self.hosts = []
        self.lock = threading.Lock()

    def host(self) -> HostProcess:
        h = getattr(self.local, "host", None)
        if h is not None and not h.alive():
            print(f"# host died; restarting: {h.log[-500:]}", flush=True)
            h.stop()
            h = None
        if h is None:
            with self.lock:
                n = len(self.hosts)
                h = HostProcess(self.paths, self.sock_dir / f"host{n}.sock", c_library=self.c_library,
                                n_threads=self.n_threads, backend=self.backend, env=self.env)
                self.hosts.append(h)
            self.local.host = h
        return h

    def stop(self) -> None:
        for h in self.hosts:
            h.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", default="0.20", choices=sorted(cref.SDISTS) + ["0.25"],
                    help="the C reference build (0.20, 0.10) or llama.cpp's ggml 0.25 (tests/llama/build.py)")
    ap.add_argument("--ops", help="comma-separated op names (default: all)")
    ap.add_argument("--c-library", action="store_true", help="serve with the C backend library")
    ap.add_argument("--json", help="write the summary (counts per op and in total, the cases passing on "
                                   "CPU but not through apir) and every case's status to this file")
    ap.add_argument("-j", "--jobs", type=int, default=1,
                    help="ops run in parallel (each: its CPU run, then its apir run on the worker's own host)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per test-backend-ops process")
    ap.add_argument("--max-resume", type=int, default=10_000,
                    help="cases to re-run one by one after a run ended early, per op")
    ap.add_argument("--deadline", type=float, help="seconds after which no op is started or case resumed")
    ap.add_argument("--resume-jobs", type=int, default=1, help="cases of one op re-run at a time")
    ap.add_argument("--host-threads", type=int, help="CPU backend threads of each apir host")
    ap.add_argument("--backend", metavar="vulkan[:N]",
                    help="the apir hosts compute on this ggml Vulkan device (scripts/build-ggml-backends.sh's "
                         "build), compared with test-backend-ops of that build on the device directly")
    ap.add_argument("--lavapipe", action="store_true",
                    help="with --backend: Vulkan on the build's Mesa lavapipe (else the machine's driver)")
    args = ap.parse_args(argv)

    if args.version == "0.25":
        from tests.llama.build import build as llama_build

        paths = llama_build()
    else:
        paths = cref.build(args.version)
    tbo = direct_tbo = paths["TEST_BACKEND_OPS"]
    direct_device, direct_env, host_env = "CPU", None, None
    if args.backend:
        from apir.ggml.backend_spec import parse_spec
        from tests import ggml_backends

        spec = parse_spec(args.backend)
        if spec.kind != "reg" or spec.name.lower() != "vulkan":
            ap.error("--backend takes vulkan[:N]")
        vk = ggml_backends.build()
        direct_tbo = vk["TEST_BACKEND_OPS"]
        direct_device = f"Vulkan{spec.index}"
        extra = ggml_backends.lavapipe_env(vk) if args.lavapipe else {}
        direct_env = {**os.environ, **extra}
        host_env = {**ggml_backends.ggml_env(vk), **extra}
    apir_device = f"[virtgpu] {direct_device}"
    ops = args.ops.split(",") if args.ops else bo.list_ops(tbo)
    shim = build_shim(paths)
    sock_dir = Path(tempfile.mkdtemp(prefix="apir-tbo-"))
    workers = _Worker(paths, sock_dir, args.c_library, args.host_threads, args.backend, host_env)
    cpu_runs, apir_runs = {}, {}
    t0 = time.monotonic()
    print(f"test-backend-ops {args.version} ({tbo}); host: "
          f"{'C backend library' if args.c_library else 'apir dispatcher'} on {direct_device}; {args.jobs} job(s)",
          flush=True)
    print(f"{'op':24} {'CPU ok/fail/ns':>18} {'apir ok/fail/ns/crash':>24} {'CPU s':>7} {'apir s':>7}", flush=True)

    deadline = t0 + args.deadline if args.deadline else None
    not_run = []

    def one(op: str):
        if deadline is not None and time.monotonic() > deadline:
            return op, None, None
        name, _, params = op.partition("/")
        cpu = bo.run_op(direct_tbo, name, direct_device, direct_env, timeout=args.timeout, max_resume=0,
                        params=params or None)
        env = guest_env(paths, shim, workers.host().socket_path)
        ap_run = bo.run_op(tbo, name, apir_device, env, expected=cpu.passed(), params=params or None,
                           timeout=args.timeout, max_resume=args.max_resume, deadline=deadline,
                           resume_jobs=args.resume_jobs)
        return op, cpu, ap_run

    # SIGTERM ends like Ctrl-C: the finally below stops the host processes.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for fut in as_completed([pool.submit(one, op) for op in ops]):
                op, cpu, ap_run = fut.result()
                if cpu is None:
                    not_run.append(op)
                    continue
                cpu_runs[op], apir_runs[op] = cpu, ap_run
                print(f"{op:24} {cpu.count(bo.OK):>8}/{cpu.count(bo.FAIL)}/{cpu.count(bo.NOT_SUPPORTED):<6} "
                      f"{ap_run.count(bo.OK):>10}/{ap_run.count(bo.FAIL)}/{ap_run.count(bo.NOT_SUPPORTED)}/"
                      f"{ap_run.count(bo.CRASHED):<6} {cpu.seconds:7.1f} {ap_run.seconds:7.1f}", flush=True)
                for note in ap_run.notes[:3]:
                    print(f"    {note}", flush=True)
    finally:
        workers.stop()
    wall = time.monotonic() - t0
    ops = [op for op in ops if op in cpu_runs]  # list order, whatever order they finished in
    cpu_runs = {op: cpu_runs[op] for op in ops}
    apir_runs = {op: apir_runs[op] for op in ops}
    t_cpu = sum(r.seconds for r in cpu_runs.values())
    t_apir = sum(r.seconds for r in apir_runs.values())
    tc, ta = bo.summarize(cpu_runs), bo.summarize(apir_runs)
    bad = bo.regressions(cpu_runs, apir_runs)
    print()
    print(f"ops: {len(ops)}  (wall {wall:.0f} s with {args.jobs} job(s))")
    if not_run:
        print(f"not run (deadline): {len(not_run)} ops: {','.join(not_run)}")
    print(f"{direct_device + ' directly':18}: passed {tc[bo.OK]}, failed {tc[bo.FAIL]}, "
          f"not supported {tc[bo.NOT_SUPPORTED]}, "
          f"skipped {tc[bo.SKIPPED]}  ({t_cpu:.0f} s)")
    print(f"through apir      : passed {ta[bo.OK]}, failed {ta[bo.FAIL]}, not supported {ta[bo.NOT_SUPPORTED]}, "
          f"skipped {ta[bo.SKIPPED]}, crashed {ta[bo.CRASHED]}  ({t_apir:.0f} s)")
    print(f"cases passing on CPU but not through apir: {len(bad)}")
    for line in bad[:200]:
        print(f"  {line}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "version": args.version, "c_library": args.c_library, "time": time.time(),
            "jobs": args.jobs, "wall_seconds": wall, "ops": ops, "not_run": not_run,
            "summary": {
                "cpu": tc, "apir": ta, "regressions": bad,
                "per_op": {op: {"cpu": _counts(cpu_runs[op]), "apir": _counts(apir_runs[op])} for op in ops},
            },
            "seconds": {"cpu": t_cpu, "apir": t_apir},
            "cpu": {op: r.cases for op, r in cpu_runs.items()},
            "apir": {op: r.cases for op, r in apir_runs.items()},
            "notes": {op: r.notes for op, r in apir_runs.items() if r.notes},
        }, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
