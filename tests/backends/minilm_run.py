"""One MiniLM batch on one ggml backend, in a process of its own, its embeddings saved as .npy.

    python -m tests.backends.minilm_run --backend SPEC (--local | --device DEVICE) OUT.npy

--local: the backend spec's device in this process (apir.models.backends.open_local_device);
--device: through APIR over an apir.devices spec (``unix:PATH``: an `apir host serve` process;
``embedded``: a host in this process computing on --backend). A process of its own because the
ggml build (APIR_GGML_LIB_DIR) and the Vulkan driver are chosen by environment at load time.
Prints the backend's description, then "batch N done" after each of --repeat batches.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

SENTENCES = [
    "The host executes graphs on the GPU.",
    "A guest in a virtual machine sends ggml compute graphs over virtio-gpu.",
    "Lavapipe runs Vulkan on the CPU.",
    "Two rpc servers on loopback share the work of one host, context by context.",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true")
    where.add_argument("--device")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="embed the sentences this many times, a line after each")
    p.add_argument("out")
    args = p.parse_args(argv)

    from apir.models.backends import open_backend, open_local_device
    from apir.models.minilm import MiniLM

    if args.local:
        ob = open_local_device(args.backend, args.threads)
    else:
        device = None if args.device == "embedded" else args.device
        config = {"apir.host.backend": args.backend, "apir.host.n_threads": str(args.threads)}
        ob = open_backend(device, allow_fallback=False, config=config)
    print(ob.description, flush=True)
    with ob:
        with MiniLM(ob.backend, ob.buft) as model:
            for i in range(args.repeat):
                out = model.embed(SENTENCES)
                print(f"batch {i + 1} done", flush=True)
    np.save(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
