"""apir: a Python reference implementation of ggml's API Remoting (APIR) protocol.

The Python API (apir.api): `apir.open(device)` gives a `Device`, apir's ggml backend over an
APIR device (``embedded``, ``unix:PATH``, ``drm[:NODE]``) for one's own ggml graphs;
`apir.embed(sentences, device=...)` computes all-MiniLM-L6-v2 embeddings through it.
`ApirError` is the root of every apir exception.
Packages: `apir.codec` (the wire format, shared), `apir.guest` (the VM side),
`apir.host` (the hypervisor side), `apir.ggml` (ctypes access to libggml).
"""

from apir.api import Device, DeviceError, embed, open
from apir.errors import ApirError

__version__ = "0.1.0"

__all__ = ["ApirError", "Device", "DeviceError", "embed", "open", "__version__"]
