"""ctypes access to libggml, shared by apir's guest and host halves.

`load()` gives the one checked `Ggml` object per ggml build (`apir.ggml.lib`). Its parts:
`functions` (the C functions apir declares), `header` (what is read from ggml.h and
ggml-backend.h), `features` (which ggml version has what), `layout` (the start-up check of
`struct ggml_tensor`), `backend_props` (`struct ggml_backend_dev_props` of the build).
"""

from apir.ggml.errors import GgmlLoadError
from apir.ggml.functions import InitParams
from apir.ggml.lib import Ggml, load

__all__ = ["Ggml", "GgmlLoadError", "InitParams", "load"]
