"""ctypes access to libggml, shared by apir's guest and host halves.

`load()` gives the one checked `Ggml` object per ggml build; see `apir.ggml.lib`.
"""

from apir.ggml.lib import Ggml, GgmlLoadError, InitParams, load

__all__ = ["Ggml", "GgmlLoadError", "InitParams", "load"]
