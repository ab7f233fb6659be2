"""`struct ggml_backend_dev_props` of one ggml build.

Theory of operation: `ggml_backend_dev_get_props` fills a caller-owned struct whose tail,
`struct ggml_backend_dev_caps`, grew a fifth boolean (`mmap_support`) between ggml 0.10 and
0.20. The struct is therefore declared per build from the build's own `ggml-backend.h`, so
reading the caps never reads past what the library wrote.

Errors: `GgmlLoadError` when a header lacks the struct.
"""

from __future__ import annotations

import ctypes
import re
from typing import Dict, List, Type

from apir.ggml.lib import Ggml, GgmlLoadError

__all__ = ["dev_props_struct", "get_dev_props", "DevProps"]

_cache: Dict[int, Type[ctypes.Structure]] = {}


def _caps_fields(g: Ggml) -> List[str]:
    header = g.include_dir / "ggml-backend.h"
    if not header.exists():
        raise GgmlLoadError(f"{header}: not found")
    m = re.search(r"struct\s+ggml_backend_dev_caps\s*\{(.*?)\};", header.read_text(), re.S)
    if not m:
        raise GgmlLoadError(f"{header}: struct ggml_backend_dev_caps not found")
    body = re.sub(r"//[^\n]*|/\*.*?\*/", "", m.group(1), flags=re.S)
    return re.findall(r"bool\s+(\w+)\s*;", body)


def dev_props_struct(g: Ggml) -> Type[ctypes.Structure]:
    """The ctypes twin of `struct ggml_backend_dev_props` (ggml-backend.h) for build `g`;
    `caps` holds one c_bool per field of that build's `ggml_backend_dev_caps`."""
    cls = _cache.get(id(g))
    if cls is None:
        caps = type(
            "GgmlBackendDevCaps", (ctypes.Structure,), {"_fields_": [(name, ctypes.c_bool) for name in _caps_fields(g)]}
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
        _cache[id(g)] = cls
    return cls


class DevProps(dict):
    """The caps of a device as a dict of bool, in the C field order (dicts keep order)."""


def get_dev_props(g: Ggml, dev: int) -> DevProps:
    """`ggml_backend_dev_get_props(dev)`'s caps: {"async": bool, "host_buffer": ...,
    "buffer_from_host_ptr": ..., "events": ..., ["mmap_support": ...]}."""
    props = dev_props_struct(g)()
    g.ggml_backend_dev_get_props(dev, ctypes.byref(props))
    return DevProps((name, bool(getattr(props.caps, name))) for name, _ in props.caps._fields_)
