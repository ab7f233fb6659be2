"""Round-trip time through the vhost-user virtio-gpu device, next to the embedded host.

Prints p50 / p99 in microseconds for:
  - a virtio-gpu control command (GET_DISPLAY_INFO) through the device: the fake front-end
    (tests/vhost_user/frontend.py, playing QEMU and the guest kernel) writes the chain into
    shared guest memory, kicks, and waits for the call eventfd;
  - an APIR call (device_get_type) through the device: SUBMIT_3D on the context's worker,
    the guest spinning on the reply word of a HOST3D blob mapped through SHMEM_MAP;
  - the same call over the embedded host (a thread of this process), for the ratio.
The device runs in this process (its control and queue threads), so what shows is the
device's own cost, not QEMU's or a guest kernel's. Same run, same machine: compare ratios.

    PYTHONPATH=. python benchmarks/bench_vhost_user.py [--calls N] [--warmup N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from apir.codec.virtgpu import VirtioGpuCtrlType  # noqa: E402
from apir.guest.client import ApirClient  # noqa: E402
from apir.host.vhost_user import VhostUserServer  # noqa: E402
from apir.local.embedded import EmbeddedDevice  # noqa: E402
from tests.vhost_user.frontend import FakeFrontend, hdr  # noqa: E402
from tests.vhost_user.guest_driver import FrontendDriver  # noqa: E402


def percentiles(samples):
    s = sorted(samples)
    return s[len(s) // 2] * 1e6, s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6


def timed(fn, calls, warmup):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return percentiles(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        srv = VhostUserServer(os.path.join(tmp, "vgpu.sock"), shm_size=64 << 20).start()
        fe = FakeFrontend.connect(srv.path)
        try:
            display = hdr(VirtioGpuCtrlType.CMD_GET_DISPLAY_INFO)
            rows.append(
                ("virtio-gpu GET_DISPLAY_INFO via device", timed(lambda: fe.command(display), args.calls, args.warmup))
            )
            client = ApirClient.connect(FrontendDriver(fe))
            rows.append(("APIR device_get_type via device", timed(client.device_get_type, args.calls, args.warmup)))
            client.close()
        finally:
            fe.close()
            srv.close()
    client = ApirClient.connect(EmbeddedDevice())
    rows.append(("APIR device_get_type, embedded host", timed(client.device_get_type, args.calls, args.warmup)))
    client.close()
    width = max(len(name) for name, _ in rows)
    for name, (p50, p99) in rows:
        print(f"{name:<{width}}  p50 {p50:9.1f} us  p99 {p99:9.1f} us")
    print(f"device / embedded (p50): {rows[1][1][0] / rows[2][1][0]:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
