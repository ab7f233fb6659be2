"""apir's guest in a real VM (QEMU 11.1, TCG, the kernel's virtio_gpu driver, `apir host
vhost-user` as the device) next to embedded mode on the host, in one run.

Measures, both ways:
  round trip     device_get_type (the smallest APIR call): p50 / p99 in microseconds
  MiniLM batch   one all-MiniLM-L6-v2 `embed_tokens` of a fixed padded batch (graph build,
                 allocation, inputs, compute, output): median of --repeats, after a warm-up
and prints VM / embedded ratios. Under TCG the guest CPU is emulated, so absolute VM figures
mean little; the ratio says what the virtualized path costs here. Both sides run with the
guest's Numba settings (NUMBA_CPU_NAME=generic). Needs `apir vm provision`'s cache.

    PYTHONPATH=. python benchmarks/bench_vm.py [--kernel bookworm|trixie] [--calls N]
                                               [--batch-size N] [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NODE = "/dev/dri/renderD128"


def measure(where: str, calls: int, batch_size: int, repeats: int) -> dict:
    """Round trip and MiniLM batch over `where` ("embedded" or "drm")."""
    from apir.devices import device_spec
    from apir.guest.client import ApirClient
    from apir.models.assets import load_assets
    from apir.models.backends import open_backend
    from apir.models.minilm import MiniLM

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_minilm import make_sentences

    if where == "drm":
        from apir.guest.drm import DrmDevice

        device = DrmDevice(NODE)
    else:
        from apir.local.embedded import EmbeddedDevice

        device = EmbeddedDevice()
    samples = []
    with ApirClient.connect(device) as client:
        for _ in range(max(10, calls // 10)):
            client.device_get_type()
        for _ in range(calls):
            t = time.perf_counter()
            client.device_get_type()
            samples.append(time.perf_counter() - t)
    samples.sort()
    assets = load_assets()
    ob = open_backend(device_spec(None, NODE if where == "drm" else None))
    try:
        model = MiniLM(ob.backend, ob.buft, assets=assets)
        batch = assets.tokenizer.encode(make_sentences(batch_size, 40))
        model.embed_tokens(batch)  # warm-up: first allocation of the compute buffers
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            model.embed_tokens(batch)
            times.append(time.perf_counter() - t)
        description = ob.description
        model.close()
    finally:
        ob.close()
    return {"where": where, "description": description, "calls": calls,
            "roundtrip_us": {"p50": samples[len(samples) // 2] * 1e6, "p99": samples[int(len(samples) * 0.99)] * 1e6},
            "batch_size": batch_size, "padded_tokens": int(batch.ids.shape[1]), "repeats": repeats,
            "batch_s": statistics.median(times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", default="bookworm", help="guest kernel: bookworm (6.1) or trixie (6.12)")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--measure", choices=["embedded", "drm"], help=argparse.SUPPRESS)  # one side, to --out
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = ["--calls", str(args.calls), "--batch-size", str(args.batch_size), "--repeats", str(args.repeats)]
    if args.measure:
        res = measure(args.measure, args.calls, args.batch_size, args.repeats)
        Path(args.out).write_text(json.dumps(res))
        return 0

    from apir.vm import machine, provision
    from apir.vm.host import VhostUserHost
    from tests.vm.session import guest_env

    prov = provision.find()
    kernel = prov.kernel(args.kernel)
    with tempfile.TemporaryDirectory(prefix="apir-bench-vm-") as tmp:
        work = Path(tmp)
        env = guest_env(work)
        # the host side first: it also fills the Numba cache the guest loads
        subprocess.run([sys.executable, __file__, "--measure", "embedded", "--out", str(work / "embedded.json")]
                       + sizes, check=True, env=dict(os.environ, **env), cwd=ROOT)
        command = (" ".join(f"{k}={v}" for k, v in env.items()) + f" {sys.executable} {__file__} --measure drm"
                   f" --out {work}/vm.json {' '.join(sizes)} > {work}/guest.log 2>&1")
        device = VhostUserHost([work / "vgpu.sock"], work / "device.log").start()
        try:
            vm = machine.Vm(prov, kernel, work, command, socket=device.socket, timeout_s=1200, name="bench").start()
            vm.wait()
        finally:
            device.stop()
        if not (work / "vm.json").exists():
            sys.stderr.write(vm.console[-3000:] + (work / "guest.log").read_text(errors="replace")[-3000:])
            return 1
        emb = json.loads((work / "embedded.json").read_text())
        inv = json.loads((work / "vm.json").read_text())
    res = {"kernel": kernel.release, "embedded": emb, "vm": inv,
           "roundtrip_p50_ratio": inv["roundtrip_us"]["p50"] / emb["roundtrip_us"]["p50"],
           "batch_ratio": inv["batch_s"] / emb["batch_s"], "vm_boot_s": vm.boot_seconds(), "vm_s": vm.seconds}
    if args.json:
        json.dump(res, sys.stdout, indent=1)
        print()
        return 0
    print(f"VM (kernel {res['kernel']}, TCG, apir host vhost-user) vs embedded, {args.calls} calls, "
          f"MiniLM batch of {args.batch_size} padded to {emb['padded_tokens']} tokens, median of {args.repeats}")
    print(f"{'':24}{'VM':>12}{'embedded':>12}{'ratio':>9}")
    for label, key in (("round trip p50 us", "p50"), ("round trip p99 us", "p99")):
        a, b = inv["roundtrip_us"][key], emb["roundtrip_us"][key]
        print(f"{label:24}{a:12.1f}{b:12.1f}{a / b:9.1f}")
    print(f"{'MiniLM batch ms':24}{inv['batch_s'] * 1e3:12.1f}{emb['batch_s'] * 1e3:12.1f}{res['batch_ratio']:9.1f}")
    print(f"VM boot to userspace {res['vm_boot_s']} s, whole VM run {res['vm_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
