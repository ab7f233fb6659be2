"""A soak: one apir host process serving guests that come and go, sampled for leaks.

Theory of operation: a child process (`soak.py host`) serves a socket host (LocalServer) and,
with --vm, a vhost-user virtio-gpu device (VhostUserServer) in the same process, and writes a
sample every --sample-s seconds: its RSS, open descriptors, threads, and what the guests hold
(contexts, blobs, blob bytes, ggml buffers). Meanwhile guests join and leave until the time is
up, each in a process of its own, one loop per kind, the kinds at once:
  llama   llama.cpp (tests/llama's llama_tokens, SmolLM2-135M Q4_1) decoding 16 tokens
          through the socket host with tests/interop's C shim (then the host and the other
          guests load that build's ggml too);
  minilm  `apir embed --socket` of a batch of sentences;
  killed  the same embed, SIGKILLed at a random moment (a guest that dies mid-command);
  vm      (--vm) `apir vm run --device` of llama.cpp (16 tokens; without llama.cpp, `ls
          /dev/dri`) in a VM on the vhost-user device of the same host process.
After a warm-up of one guest of each kind, one at a time (kernels compiled, caches warm), the
first idle sample is the start; after the last guest left, the first idle sample is the end. The host is flat when
descriptors, threads, contexts and blobs are back where they started and RSS grew by less
than --rss-slack-mib. Prints the table and the verdict; exits 1 when not flat or when a
guest failed.

    PYTHONPATH=. python benchmarks/soak.py [--minutes 60] [--sample-s 10] [--vm] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SENTENCES = [f"sentence {i}: a soak keeps the host busy while guests come and go" for i in range(32)]


# --- the host process ---------------------------------------------------------------------------
def _proc_sample() -> Dict[str, int]:
    with open("/proc/self/status", encoding="ascii") as fh:
        status = dict(line.split(":", 1) for line in fh if ":" in line)
    return {
        "rss_kib": int(status["VmRSS"].split()[0]),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(status["Threads"]),
    }


def run_host(args: argparse.Namespace) -> int:
    from apir.host.local.server import LocalServer

    # device type gpu: llama.cpp takes a remote device of type CPU for host memory (as the tests
    # and bench_llama serve it)
    config = {"apir.host.n_threads": str(args.threads), "apir.host.device_type": "gpu"}
    servers: List = [LocalServer(args.socket, config=config, stat_host_wide=True).start()]
    vhost = None
    if args.vhost_socket:
        from apir.host.vhost_user import VhostUserServer

        from apir.codec.virtgpu import VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS

        # (llama.cpp's ggml-virtgpu asks for the Venus capset)
        vhost = VhostUserServer(
            args.vhost_socket, config=config, capsets=(VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS)
        )
        vhost.start()
        servers.append(vhost)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    t0 = time.monotonic()
    with open(args.samples, "a", encoding="utf-8") as out:
        while True:
            sample = {"t": round(time.monotonic() - t0, 1), **_proc_sample()}
            st = servers[0].stats()
            sample.update(contexts=st.contexts, blobs=st.blobs, blob_bytes=st.blob_bytes, ggml_buffers=st.ggml_buffers)
            if vhost is not None:
                vc = vhost.counts()
                sample.update(
                    contexts=sample["contexts"] + vc.contexts,
                    blobs=sample["blobs"] + vc.blobs,
                    blob_bytes=sample["blob_bytes"] + vc.blob_bytes,
                )
            out.write(json.dumps(sample) + "\n")
            out.flush()
            if stop.wait(args.sample_s):
                break
    for server in servers:
        server.close()
    return 0


# --- the guests -----------------------------------------------------------------------------------
class Guests:
    """Runs guests of each kind in a loop, one at a time per kind, until `stop`; counts them."""

    def __init__(self, socket_path: str, vhost_socket: Optional[str], workdir: Path, env: dict, llama):
        self.socket_path, self.vhost_socket, self.workdir, self.env = socket_path, vhost_socket, workdir, env
        self.stop = threading.Event()
        self.runs: Dict[str, int] = {}
        self.failures: List[str] = []
        self._kinds: Dict[str, Callable[[], None]] = {"minilm": self.minilm, "killed": self.killed}
        self._llama = llama
        if llama is not None:
            self._kinds["llama"] = self.llama
        if vhost_socket:
            self._kinds["vm"] = self.vm
        self.sentences = workdir / "sentences.txt"
        self.sentences.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")

    @property
    def kinds(self) -> List[str]:
        return sorted(self._kinds)

    def start(self) -> List[threading.Thread]:
        threads = [threading.Thread(target=self._loop, args=(k,), daemon=True) for k in self._kinds]
        for t in threads:
            t.start()
        return threads

    def run_once(self, kind: str) -> None:
        try:
            self._kinds[kind]()
        except Exception as exc:  # noqa: BLE001 - a failed guest is a finding, reported at the end
            self.failures.append(f"{kind}: {exc}"[:2000])
        self.runs[kind] = self.runs.get(kind, 0) + 1

    def _loop(self, kind: str) -> None:
        while not self.stop.is_set():
            self.run_once(kind)

    def _embed_command(self, out: Path) -> List[str]:
        return [sys.executable, "-m", "apir", "embed", "--socket", self.socket_path, "-f", str(self.sentences),
                "--batch-size", "16", "--format", "jsonl", "--no-progress", "-o", str(out)]

    def minilm(self) -> None:
        out = self.workdir / "minilm.jsonl"
        subprocess.run(self._embed_command(out), env=self.env, check=True, capture_output=True, text=True, timeout=600)
        lines = out.read_text(encoding="utf-8").splitlines()
        if len(lines) != len(SENTENCES):
            raise RuntimeError(f"embed wrote {len(lines)} lines for {len(SENTENCES)} sentences")

    def killed(self) -> None:
        proc = subprocess.Popen(self._embed_command(self.workdir / "killed.jsonl"), env=self.env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(random.uniform(0.5, 4.0))
        proc.kill()
        proc.wait()

    def llama(self) -> None:
        from tests.llama.runner import apir_env, generate

        paths, model = self._llama
        gen = generate(paths, model, "The capital of France is", apir_env(paths, Path(self.socket_path)), n_predict=16)
        if len(gen.generated) != 16:
            raise RuntimeError(f"llama.cpp generated {len(gen.generated)} tokens of 16")

    def vm(self) -> None:
        if self._llama is not None:
            paths, model = self._llama
            program = [paths["LLAMA_SIMPLE"], "-m", str(model), "-n", "16", "-ngl", "99", "The capital of France is"]
        else:
            program = ["ls", "/dev/dri"]
        cmd = [sys.executable, "-m", "apir", "vm", "run", "--device", str(self.vhost_socket), "--", *program]
        run = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=1800)
        if run.returncode != 0:
            raise RuntimeError(f"apir vm run exited {run.returncode}: {run.stderr[-1500:]}")


def _llama_setup():
    """(paths, model) of the llama.cpp build and SmolLM2, or None (with a note) without them."""
    try:
        from tests.llama.build import build, is_built, model

        if not is_built():
            print("soak: llama.cpp is not built (python -m tests.llama.build): no llama guests", file=sys.stderr)
            return None
        return build(), model()
    except Exception as exc:  # noqa: BLE001 - the soak runs without that kind
        print(f"soak: no llama guests: {exc}", file=sys.stderr)
        return None


# --- the run --------------------------------------------------------------------------------------
def _read_samples(path: Path) -> List[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _idle_after(samples: List[dict], t: float) -> Optional[dict]:
    return next((s for s in samples if s["t"] >= t and s["contexts"] == 0), None)


def _wait_idle(samples_path: Path, after: float, timeout_s: float) -> Optional[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        idle = _idle_after(_read_samples(samples_path), after)
        if idle is not None:
            return idle
        time.sleep(0.5)
    return None


def run_soak(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="apir-soak-"))
    socket_path = str(workdir / "apir.sock")
    vhost_socket = str(workdir / "vhost.sock") if args.vm else None
    samples_path = workdir / "samples.jsonl"
    host_cmd = [sys.executable, __file__, "host", "--socket", socket_path, "--samples", str(samples_path),
                "--sample-s", str(args.sample_s), "--threads", str(args.threads)]
    if vhost_socket:
        host_cmd += ["--vhost-socket", vhost_socket]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    llama = _llama_setup()
    if llama is not None:  # then the host and every guest load llama.cpp's ggml, as llama.cpp does
        from tests.interop.harness import c_build_env

        env = c_build_env(llama[0], env)
    host = subprocess.Popen(host_cmd, env=env)
    t0 = time.monotonic()
    try:
        while not os.path.exists(socket_path):
            if host.poll() is not None:
                raise RuntimeError(f"the host exited with {host.returncode}")
            time.sleep(0.1)
        guests = Guests(socket_path, vhost_socket, workdir, env, llama)
        print(f"soak: {args.minutes:g} min, guests: {', '.join(guests.kinds)}; samples in {samples_path}", flush=True)
        for kind in guests.kinds:  # the warm-up: one of each, one at a time
            guests.run_once(kind)
        start = _wait_idle(samples_path, time.monotonic() - t0, 120 + 2 * args.sample_s)
        threads = guests.start()
        time.sleep(max(0.0, args.minutes * 60 - (time.monotonic() - t0)))
        guests.stop.set()
        for t in threads:
            t.join(timeout=1800)
        end_after = time.monotonic() - t0
        end = _wait_idle(samples_path, end_after, 120 + 2 * args.sample_s)
        samples = _read_samples(samples_path)
    finally:
        host.send_signal(signal.SIGTERM)
        try:
            host.wait(timeout=60)
        except subprocess.TimeoutExpired:
            host.kill()
    report = {"minutes": args.minutes, "guest_runs": guests.runs, "guest_failures": guests.failures,
              "start": start, "end": end, "samples": len(samples),
              "rss_kib_max": max((s["rss_kib"] for s in samples), default=None)}
    flat = _verdict(report, args.rss_slack_mib)
    report["flat"] = flat
    if args.json:
        print(json.dumps(report))
    else:
        _print_report(report)
    return 0 if flat and not guests.failures else 1


def _verdict(report: dict, rss_slack_mib: float) -> bool:
    start, end = report["start"], report["end"]
    if start is None or end is None:
        return False
    same = all(end[k] <= start[k] for k in ("fds", "threads", "contexts", "blobs", "blob_bytes"))
    return same and end["rss_kib"] - start["rss_kib"] < rss_slack_mib * 1024


def _print_report(report: dict) -> None:
    start, end = report["start"], report["end"]
    print(f"guest runs: {report['guest_runs']}; failures: {len(report['guest_failures'])}")
    for failure in report["guest_failures"][:5]:
        print(f"  {failure}")
    print(f"{'':12} {'start':>10} {'end':>10}")
    for key in ("t", "rss_kib", "fds", "threads", "contexts", "blobs", "blob_bytes", "ggml_buffers"):
        print(f"{key:12} {start.get(key, '-') if start else '-':>10} {end.get(key, '-') if end else '-':>10}")
    print(f"max RSS {report['rss_kib_max']} KiB over {report['samples']} samples; flat: {report['flat']}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    host = sub.add_parser("host", help="(internal) the host process")
    host.add_argument("--socket", required=True)
    host.add_argument("--vhost-socket")
    host.add_argument("--samples", required=True)
    host.add_argument("--sample-s", type=float, default=10.0)
    host.add_argument("--threads", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=1, help="host compute threads (default 1)")
    parser.add_argument("--vm", action="store_true", help="VM guests too (apir vm run, vhost-user)")
    parser.add_argument("--rss-slack-mib", type=float, default=32.0, help="RSS growth still flat (default 32)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "host":
        return run_host(args)
    return run_soak(args)


if __name__ == "__main__":
    sys.exit(main())
