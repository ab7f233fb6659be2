"""One host process serving two VMs (tests/vm/test_paired.py): apir's virtio-gpu device on two
vhost-user sockets, each VM its own socket and so its own device state, in this one process.
Every 0.2 s it writes what each VM's device holds to STATUS (JSON), read by the test:

    python paired_host.py STATUS NAME=SOCKET NAME=SOCKET

STATUS: {"pid", "vms": {NAME: {"connected", "sessions_ended", "device": DeviceCounts of the
current front-end's device -- or, once it is gone, of the last one, which must hold nothing --,
"host_contexts": number of HostContexts made for this VM, "ggml_buffers": the ggml buffers they
hold now, summed (the last one's too after they are closed)}}}. Ends on SIGTERM.
"""

import dataclasses
import json
import os
import signal
import sys
import threading

import apir.host.component.context  # noqa: F401 - now, not at the first CTX_CREATE (as apir host vhost-user)
from apir.host.local.kernel import default_context_factory
from apir.host.vhost_user import VhostUserServer
from apir.host.local.kernel import ggml_buffer_count


def main(argv):
    status_path, pairs = argv[0], [a.split("=", 1) for a in argv[1:]]
    made = {name: [] for name, _ in pairs}

    def factory_for(name):
        def factory(*args, **kwargs):
            ctx = default_context_factory(*args, **kwargs)
            made[name].append(ctx)
            return ctx

        return factory

    servers = {name: VhostUserServer(path, context_factory=factory_for(name)) for name, path in pairs}
    last_device = {}
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for server in servers.values():
        server.start()
    while not stop.wait(0.2):
        status = {"pid": os.getpid(), "vms": {}}
        for name, server in servers.items():
            session = server.session
            if session is not None:
                last_device[name] = session.device
            device = last_device.get(name)
            counts = dataclasses.asdict(device.counts()) if device is not None else None
            status["vms"][name] = {
                "connected": session is not None, "sessions_ended": server.sessions_served, "device": counts,
                "host_contexts": len(made[name]),
                "ggml_buffers": sum(ggml_buffer_count(ctx) or 0 for ctx in made[name])}
        with open(status_path + ".tmp", "w") as f:
            json.dump(status, f)
        os.replace(status_path + ".tmp", status_path)
    for server in servers.values():
        server.close()


if __name__ == "__main__":
    main(sys.argv[1:])
