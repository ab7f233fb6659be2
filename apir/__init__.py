"""apir: a Python reference implementation of ggml's API Remoting (APIR) protocol.

Packages: `apir.codec` (the wire format, shared), `apir.guest` (the VM side),
`apir.host` (the hypervisor side), `apir.ggml` (ctypes access to libggml).
"""

__version__ = "0.1.0"
