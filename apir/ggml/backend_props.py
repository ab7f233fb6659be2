"""`struct ggml_backend_dev_props` of one ggml build.

Theory of operation: `ggml_backend_dev_get_props` fills a caller-owned struct whose tail,
`struct ggml_backend_dev_caps`, grew a fifth boolean (`mmap_support`) between ggml 0.10 and
0.20. The struct is therefore declared per build from the caps fields of the build's own
`ggml-backend.h` (`Ggml.header.dev_caps`), so reading the caps never reads past what the
library wrote.
"""

from __future__ import annotations

import ctypes
from typing import Dict, Tuple, Type

from apir.ggml.lib import Ggml

__all__ = ["dev_props_struct", "get_dev_props", "DevProps"]

_cache: Dict[Tuple[str, ...], Type[ctypes.Structure]] = {}


def dev_props_struct(g: Ggml) -> Type[ctypes.Structure]:
    """The ctypes twin of `struct ggml_backend_dev_props` (ggml-backend.h) for build `g`;
    `caps` holds one c_bool per field of that build's `ggml_backend_dev_caps`."""
    cls = _cache.get(g.header.dev_caps)
    if cls is None:
        caps = type(
            "GgmlBackendDevCaps",
            (ctypes.Structure,),
            {"_fields_": [(name, ctypes.c_bool) for name in g.header.dev_caps]},
        )
        cls = type(
            "GgmlBackendDevProps",
            (ctypes.Structure,),
            {
                "_fields_": [
                    ("name", ctypes.c_char_p),
                    ("description", ctypes.c_char_p),
                    ("memory_free", ctypes.c_size_t),
                    ("memory_total", ctypes.c_size_t),
                    ("type", ctypes.c_int),
                    ("device_id", ctypes.c_char_p),
                    ("caps", caps),
                ]
            },
        )
        _cache[g.header.dev_caps] = cls
    return cls


class DevProps(dict):
    """The caps of a device as a dict of bool, in the C field order (dicts keep order)."""


def get_dev_props(g: Ggml, dev: int) -> DevProps:
    """`ggml_backend_dev_get_props(dev)`'s caps: {"async": bool, "host_buffer": ...,
    "buffer_from_host_ptr": ..., "events": ..., ["mmap_support": ...]}."""
    props = dev_props_struct(g)()
    g.ggml_backend_dev_get_props(dev, ctypes.byref(props))
    return DevProps((name, bool(getattr(props.caps, name))) for name, _ in props.caps._fields_)
