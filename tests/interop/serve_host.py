"""An apir host process for the interop tests: the local transport's server, one HostContext per
guest, with either apir's Python dispatcher or a C backend library behind it.

    python -m tests.interop.serve_host --socket PATH [--c-library LIB] [--ggml-library LIB --ggml-reg SYM]
                                       [--backend SPEC]

`--c-library` makes every context load that C backend library (libggml-virtgpu-backend.so)
through apir.host.backend.c_library; without it the built-in Python dispatcher serves. The ggml this
process uses is whatever APIR_GGML_LIB_DIR / APIR_GGML_INCLUDE_DIR select: the tests point them at
the C reference build, so the C backend library and apir share one libggml (docs/interop.md).
The server runs until SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--c-library", help="C APIR backend library (apir.load_library.path)")
    ap.add_argument("--ggml-library", help="ggml backend library for the C library (ggml.library.path)")
    ap.add_argument("--ggml-reg", help="its registration symbol (ggml.library.reg)")
    ap.add_argument("--backend", help="ggml backend spec (apir.host.backend: vulkan:0, rpc:HOST:PORT, ...)")
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument("--n-threads", type=int, help="CPU backend threads (apir.host.n_threads)")
    ap.add_argument("--device-type", help="device type reported to the guest (apir.host.device_type)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from apir.host.config import CONFIG_KEY_MAX_BLOBS
    from apir.host.backend.c_library import c_library_factory
    from apir.host.component.context import HostContext
    from apir.host.local.server import LocalServer

    config = {}
    if args.c_library:
        config["apir.load_library.path"] = args.c_library
    if args.ggml_library:
        config["ggml.library.path"] = args.ggml_library
    if args.ggml_reg:
        config["ggml.library.reg"] = args.ggml_reg
    if args.backend:
        config["apir.host.backend"] = args.backend
    if args.n_threads:
        config["apir.host.n_threads"] = str(args.n_threads)
    if args.device_type:
        config["apir.host.device_type"] = args.device_type
    # ggml's C guest (0.20) never destroys the blob of a host-memory buffer it frees
    # (docs/interop.md), so one test-backend-ops process holds about two blobs per case: the
    # default of 1024 blobs per context (apir.host.config) ended MUL_MAT_ID's 872 cases after
    # 511, when CREATE_BLOB failed and the C guest aborted. A quarter of Linux's default
    # vm.max_map_count (one host mapping per blob) leaves room for every op's cases.
    config.setdefault(CONFIG_KEY_MAX_BLOBS, "16384")

    def context_factory(ctx_id, capset_id, cfg):
        return HostContext(ctx_id, cfg, capset_id=capset_id, library_factory=c_library_factory)

    server = LocalServer(args.socket, config, context_factory=context_factory)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    print("ready", flush=True)
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
