"""The C backend library behind apir's HostContext (apir.host.backend.c_library) hands out fresh
buffers that read as zeros, like apir's own dispatcher."""

import subprocess
import sys

from tests.interop.harness import REPO, c_build_env

# Two contexts of one process on the C library: the first writes a secret into a buffer and
# leaves; the second allocates buffers of the same size and reads them back.
_SCRIPT = r"""
import sys
from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.host.component.context import HostContext
from tests.host.hostkit import Guest, GgmlScratch, rpc_bytes, rpc_record
import apir.ggml
g = apir.ggml.load()
config = {"apir.load_library.path": sys.argv[1], "ggml.library.path": sys.argv[2],
          "ggml.library.reg": "ggml_backend_cpu_reg"}
size = 16384
s = GgmlScratch(g)
def rpc(buf):
    return rpc_bytes(rpc_record(g, g.ggml_new_tensor_1d(s.ctx, g.types["F32"], size // 4), buf, data=0))
keep = Guest(HostContext(1, config))  # keeps the C library initialized between the two
a = Guest(HostContext(2, config))
buf = a.alloc(size)
assert a.set_tensor(buf, rpc(buf), b"secret!\0" * (size // 8)) == 0
assert a.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(buf))[0] == 0
a.close()
b = Guest(HostContext(3, config))
for _ in range(4):
    buf = b.alloc(size)
    b.data[:size] = b"\xa5" * size
    rc, got = b.get_tensor(buf, rpc(buf), size)
    print("read", rc, got == bytes(size), got[:16].hex())
b.close()
keep.close()
"""


def test_c_library_fresh_buffers_read_zeros(cref_paths):
    run = subprocess.run([sys.executable, "-c", _SCRIPT, cref_paths["LIBGGML_VIRTGPU_BACKEND"],
                          cref_paths["LIBGGML_CPU"]], env=c_build_env(cref_paths), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    reads = [line.split() for line in run.stdout.splitlines() if line.startswith("read")]
    assert len(reads) == 4
    assert all(r[1:3] == ["0", "True"] for r in reads), run.stdout
