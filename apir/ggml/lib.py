"""Loading libggml through ctypes, and what apir reads from it at start-up.

Theory of operation: apir never hard-codes what differs between ggml builds. `load()` opens
the three shared libraries (libggml-base, libggml-cpu, libggml) of one ggml build, declares
the functions of `apir.ggml.functions`, reads the headers that came with it
(`apir.ggml.header`: op and type enums, GGML_MAX_* sizes, ...), checks those against the
library itself (`ggml_op_name`, `ggml_type_name`, and a real tensor's field offsets, see
`apir.ggml.layout`), looks its version up in `apir.ggml.features`, and returns one complete `Ggml`
object (no attribute is added to it later).

Which build: `APIR_GGML_LIB_DIR` (a folder with the .so files) and `APIR_GGML_INCLUDE_DIR`
(a folder with ggml.h) select another build; by default the pinned libggml-python wheel's
`libggml/lib64` and `libggml/include`. The build-c-reference.sh outputs work as they are.

Errors: `GgmlLoadError` names the file or the symbol that is missing or disagrees.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, Optional, Tuple

import numpy as np

from apir.codec.records import GgmlLimits, ggml_tensor_dtype
from apir.ggml.errors import GgmlLoadError
from apir.ggml.features import Feature, Version, features_of, parse_version, series_name
from apir.ggml.functions import SIGNATURE_LETTERS, SIGNATURES, GgmlFunctions, InitParams, declare
from apir.ggml.header import HeaderFacts, read_headers
from apir.ggml.layout import check_layout

__all__ = ["Ggml", "GgmlLoadError", "load", "default_paths", "SIGNATURES", "SIGNATURE_LETTERS", "InitParams"]

ENV_LIB_DIR = "APIR_GGML_LIB_DIR"
ENV_INCLUDE_DIR = "APIR_GGML_INCLUDE_DIR"


def default_paths() -> tuple[Path, Path]:
    """(lib_dir, include_dir) from the environment, else the libggml-python wheel's."""
    lib_dir = os.environ.get(ENV_LIB_DIR)
    inc_dir = os.environ.get(ENV_INCLUDE_DIR)
    if lib_dir and inc_dir:
        return Path(lib_dir), Path(inc_dir)
    try:
        import libggml  # the libggml-python wheel: only data, no Python API
    except ImportError as exc:  # pragma: no cover - a broken install
        raise GgmlLoadError("libggml-python is not installed and APIR_GGML_LIB_DIR is not set") from exc
    root = Path(libggml.__file__).parent
    return Path(lib_dir or root / "lib64"), Path(inc_dir or root / "include")


# slots: no attribute can be added after load(); a test may still replace a declared function
# (fault injection through monkeypatch). eq=False: compared and hashed by identity.
@dataclass(eq=False, kw_only=True, slots=True, repr=False)
class Ggml(GgmlFunctions):
    """One loaded ggml build, complete when built (by `load()`). Functions are
    the fields of `GgmlFunctions` (`g.ggml_add(...)`; `g.has(name)` says whether this build
    exports one). Facts: `ops` / `types` map names (``"ADD"``, ``"F32"``) to enum values and
    `op_names` / `type_names` back; `op_count` / `type_count` are GGML_OP_COUNT /
    GGML_TYPE_COUNT; `header` holds every header fact (`apir.ggml.header.HeaderFacts`);
    `version` is `ggml_version()` ("0.20.2"), `version_tuple` (0, 20, 2), `series` its API
    series ("0.20") and `features` the version-dependent kernel facts it has
    (`apir.ggml.features`); `tensor_dtype` is `struct ggml_tensor` as numpy (checked against
    the library); `valid_types` is bool[GGML_TYPE_COUNT], the one definition of a valid type."""

    lib_dir: Path
    include_dir: Path
    cdlls: Tuple[ctypes.CDLL, ...]  # libggml-base, libggml-cpu, libggml
    header: HeaderFacts
    ops: Dict[str, int]
    types: Dict[str, int]
    op_count: int
    type_count: int
    op_names: Dict[int, str]
    type_names: Dict[int, str]
    limits: GgmlLimits
    tensor_flags: Dict[str, int]  # "COMPUTE" -> GGML_TENSOR_FLAG_COMPUTE, ...
    statuses: Dict[str, int]  # enum ggml_status: {"ALLOC_FAILED": -2, ..., "ABORTED": 1}
    version: str
    version_tuple: Version
    series: str
    features: FrozenSet[Feature]
    tensor_dtype: np.dtype
    # True for the types this build can hold data of: named in ggml.h's `enum ggml_type`
    # (removed types are holes there) and with a block size and an element size
    # (`ggml_blck_size`, `ggml_type_size`; ggml keeps placeholders of some removed types with
    # neither). The `type_valid` argument of `apir.codec.graph.parse_graph`.
    valid_types: np.ndarray

    def __repr__(self) -> str:  # not the ~270 fields: it shows up in test failures and logs
        return f"Ggml({self.version!r}, lib_dir={str(self.lib_dir)!r})"

    def has(self, name: str) -> bool:
        """Whether `name` is a function of `GgmlFunctions` that this build exports."""
        return name in SIGNATURES and bool(getattr(self, name))

    def valid_type(self, type_: int) -> bool:
        """Whether `type_` is a valid type of this build (`valid_types`)."""
        return 0 <= type_ < self.type_count and bool(self.valid_types[type_])


def _open(lib_dir: Path) -> Tuple[ctypes.CDLL, ...]:
    cdlls = []
    for stem in ("libggml-base", "libggml-cpu", "libggml"):
        path = lib_dir / f"{stem}.so"
        if not path.exists():
            raise GgmlLoadError(f"{path}: not found (set {ENV_LIB_DIR} to a ggml build)")
        # RTLD_GLOBAL: the CPU backend and ggml resolve their symbols against ggml-base.
        cdlls.append(ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL))
    return tuple(cdlls)


def _check_enums(fns: GgmlFunctions, h: HeaderFacts, lib_dir: Path) -> None:
    # ggml_op_name(op) returns GGML_OP_NAME[op]: the header's names must match it.
    for name, value in h.ops.items():
        got = fns.ggml_op_name(value).decode()
        if got != name:
            raise GgmlLoadError(f"ggml.h and {lib_dir} disagree: op {value} is {name} vs {got}")
    for name, value in h.types.items():
        got = fns.ggml_type_name(value)
        if got is not None and got.decode().upper() != name:
            raise GgmlLoadError(f"ggml.h and {lib_dir} disagree: type {value} is {name} vs {got!r}")


def _build(lib_dir: Path, include_dir: Path) -> Ggml:
    cdlls = _open(lib_dir)
    h = read_headers(include_dir)
    fns = declare(cdlls, lib_dir)
    version = fns["ggml_version"]().decode()
    valid = np.zeros(h.type_count, dtype=np.bool_)
    for t in h.types.values():
        valid[t] = fns["ggml_type_size"](t) > 0 and fns["ggml_blck_size"](t) > 0
    g = Ggml(
        **fns,
        lib_dir=lib_dir,
        include_dir=include_dir,
        cdlls=cdlls,
        header=h,
        ops=h.ops,
        types=h.types,
        op_count=h.op_count,
        type_count=h.type_count,
        op_names={v: k for k, v in h.ops.items()},
        type_names={v: k for k, v in h.types.items()},
        limits=h.limits,
        tensor_flags=h.tensor_flags,
        statuses=h.statuses,
        version=version,
        version_tuple=parse_version(version),
        series=series_name(parse_version(version)),
        features=features_of(parse_version(version)),
        tensor_dtype=ggml_tensor_dtype(h.limits),
        valid_types=valid,
    )
    _check_enums(g, h, lib_dir)
    check_layout(g, h, g.tensor_dtype, lib_dir)
    return g


_loaded: Dict[tuple, Ggml] = {}
_lock = threading.Lock()


def load(lib_dir: Optional[os.PathLike] = None, include_dir: Optional[os.PathLike] = None) -> Ggml:
    """The ggml build at (`lib_dir`, `include_dir`), default `default_paths()`; loaded and
    checked once per process. Raises GgmlLoadError."""
    if lib_dir is None or include_dir is None:
        d_lib, d_inc = default_paths()
        lib_dir = lib_dir or d_lib
        include_dir = include_dir or d_inc
    key = (str(Path(lib_dir).resolve()), str(Path(include_dir).resolve()))
    with _lock:
        g = _loaded.get(key)
        if g is None:
            g = _loaded[key] = _build(Path(key[0]), Path(key[1]))
        return g
