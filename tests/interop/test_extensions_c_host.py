"""An extended apir guest against the C reference host library (APIR 0.2): EXT_QUERY is
answered APIR_BACKEND_FORWARD_INDEX_INVALID, the guest takes it as no extensions, and works on
as an APIR 0.2 guest (docs/protocol.md, "Extensions")."""

import subprocess
import sys

from tests.interop.harness import REPO, c_build_env

_RUN = r"""
import sys
from apir.guest.client import ApirClient
from apir.local.embedded import EmbeddedDevice
import apir.ggml
apir.ggml.load()  # this process's ggml comes first: the C library binds its libggml-base
dev = EmbeddedDevice(config={"apir.load_library.path": sys.argv[1], "ggml.library.path": sys.argv[2],
                             "ggml.library.reg": "ggml_backend_cpu_reg"})
client = ApirClient.connect(dev)  # asks for every extension
print("extensions", client.extensions, client.device_count)
print("device", client.device_get_name(), client.device_get_count())
buft = client.device_get_buffer_type()
buf = client.buffer_type_alloc_buffer(buft, 4096)
print("buffer", bool(buf))
import numpy as np  # ASYNC not agreed: set and clear are waited for, as APIR 0.2's
rec = np.zeros(1, dtype=client.rpc_dtype)[0]
rec["id"], rec["type"], rec["buffer"], rec["data"] = 1, 0, buf, 0  # data: an offset
rec["ne"], rec["nb"] = [16, 1, 1, 1], [4, 64, 64, 64]
waited = client.remote.waited
client.buffer_set_tensor(buf, rec, 0, np.arange(16, dtype=np.float32))
client.synchronize()
out = np.zeros(16, dtype=np.float32)
client.buffer_get_tensor(buf, rec, 0, out)
print("data", out.tolist() == list(range(16)), client.remote.waited - waited, client.remote.posted)
client.buffer_free_buffer(buf)
client.close()
"""


def test_extended_guest_falls_back_on_the_c_host(cref_paths):
    run = subprocess.run(
        [sys.executable, "-c", _RUN, cref_paths["LIBGGML_VIRTGPU_BACKEND"], cref_paths["LIBGGML_CPU"]],
        env=c_build_env(cref_paths), cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:4] == ["extensions 0 1", "device CPU 1", "buffer True", "data True 2 0"], run.stderr
