"""What apir reads from one ggml build's headers (`ggml.h`, `ggml-backend.h`): the one place
that parses them.

Theory of operation: enum values, GGML_MAX_* sizes and the device caps struct differ between
ggml builds (ops are renumbered, types removed, a caps boolean added), so apir reads them from
the headers that came with the loaded libraries instead of hard-coding them. The parser is a
few regular expressions over C text: it understands `enum NAME { A = 1, B, ... };` with
comments, `#define NAME <decimal>` and the `bool` fields of a struct; nothing more.
`apir.ggml.lib.load` checks the op and type names it reads against the library itself.

Errors: `GgmlLoadError` names the header and what is missing from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

from apir.codec.records import GgmlLimits
from apir.ggml.errors import GgmlLoadError

__all__ = ["HeaderFacts", "read_headers", "parse_enum", "parse_defines", "parse_bool_fields"]

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def parse_enum(text: str, enum_name: str, prefix: str) -> Dict[str, int]:
    """`enum enum_name { ... };` of C `text` as {name without `prefix`: value}, values counted
    as C does (implicit values follow the previous one; holes where `= N` jumps). Members
    without `prefix` are counted but left out. Raises GgmlLoadError when the enum is missing."""
    m = re.search(r"enum\s+%s\s*\{(.*?)\};" % re.escape(enum_name), text, re.S)
    if not m:
        raise GgmlLoadError(f"enum {enum_name} not found")
    body = _COMMENTS.sub("", m.group(1))
    out: Dict[str, int] = {}
    value = -1
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, expr = item.partition("=")
        name = name.strip()
        value = int(expr.strip(), 0) if expr.strip() else value + 1
        if name.startswith(prefix):
            out[name[len(prefix) :]] = value
    return out


def parse_defines(text: str, prefix: str) -> Dict[str, int]:
    """Every `#define <prefix>NAME <decimal>` of `text` as {NAME: value} (may be empty)."""
    pattern = r"#\s*define\s+%s(\w+)\s+(\d+)" % re.escape(prefix)
    return {m.group(1): int(m.group(2)) for m in re.finditer(pattern, text)}


def parse_bool_fields(text: str, struct_name: str) -> Tuple[str, ...]:
    """The `bool` fields of `struct struct_name { ... };` in C order. Raises GgmlLoadError
    when the struct is missing."""
    m = re.search(r"struct\s+%s\s*\{(.*?)\};" % re.escape(struct_name), text, re.S)
    if not m:
        raise GgmlLoadError(f"struct {struct_name} not found")
    return tuple(re.findall(r"bool\s+(\w+)\s*;", _COMMENTS.sub("", m.group(1))))


@dataclass(frozen=True)
class HeaderFacts:
    """One build's header facts. Enum dicts map names without their prefix to values
    (`ops["ADD"]`, `types["F32"]`); `ops` and `types` leave out COUNT (`op_count`,
    `type_count` hold GGML_OP_COUNT and GGML_TYPE_COUNT); `unary_ops` and `glu_ops` keep
    their COUNT (`glu_ops` is empty in a build without `enum ggml_glu_op`)."""

    ops: Dict[str, int]  # enum ggml_op
    op_count: int  # GGML_OP_COUNT
    types: Dict[str, int]  # enum ggml_type (removed types are holes)
    type_count: int  # GGML_TYPE_COUNT
    limits: GgmlLimits  # GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME
    tensor_flags: Dict[str, int]  # enum ggml_tensor_flag: "INPUT", "OUTPUT", "PARAM", ...
    statuses: Dict[str, int]  # enum ggml_status: "ALLOC_FAILED" -2 ... "ABORTED" 1
    unary_ops: Dict[str, int]  # enum ggml_unary_op, COUNT included
    glu_ops: Dict[str, int]  # enum ggml_glu_op, COUNT included; {} where the build has none
    rope_types: Dict[str, int]  # #define GGML_ROPE_TYPE_*: "NORMAL" 0, "NEOX" 2, ...
    op_hints: Dict[str, int]  # enum ggml_op_hint: "NONE" 0, "SRC0_IS_HADAMARD" 1; {} where none
    dev_types: Dict[str, int]  # enum ggml_backend_dev_type (ggml-backend.h): "CPU", "GPU", ...
    dev_caps: Tuple[str, ...]  # struct ggml_backend_dev_caps' bool fields (ggml-backend.h)
    max_n_threads: int = 0  # GGML_MAX_N_THREADS (struct ggml_threadpool_params' cpumask); 0: none


def _read(path: Path) -> str:
    if not path.exists():
        raise GgmlLoadError(f"{path}: not found (set APIR_GGML_INCLUDE_DIR)")
    return path.read_text()


def read_headers(include_dir: Path) -> HeaderFacts:
    """The facts of `include_dir`/ggml.h and ggml-backend.h. Raises GgmlLoadError naming the
    header and what it lacks."""
    ggml_h, backend_h = include_dir / "ggml.h", include_dir / "ggml-backend.h"
    text, backend = _read(ggml_h), _read(backend_h)
    try:
        max_ = parse_defines(text, "GGML_MAX_")
        for name in ("DIMS", "SRC", "OP_PARAMS", "NAME"):
            if name not in max_:
                raise GgmlLoadError(f"#define GGML_MAX_{name} not found")
        ops = parse_enum(text, "ggml_op", "GGML_OP_")
        types = parse_enum(text, "ggml_type", "GGML_TYPE_")
        if "COUNT" not in ops or "COUNT" not in types:
            raise GgmlLoadError("GGML_OP_COUNT or GGML_TYPE_COUNT not found")
        op_count, type_count = ops.pop("COUNT"), types.pop("COUNT")
        tensor_flags = parse_enum(text, "ggml_tensor_flag", "GGML_TENSOR_FLAG_")
        statuses = parse_enum(text, "ggml_status", "GGML_STATUS_")
        unary_ops = parse_enum(text, "ggml_unary_op", "GGML_UNARY_OP_")
        glu_ops = parse_enum(text, "ggml_glu_op", "GGML_GLU_OP_") if "enum ggml_glu_op" in text else {}
        op_hints = parse_enum(text, "ggml_op_hint", "GGML_HINT_") if "enum ggml_op_hint" in text else {}
    except GgmlLoadError as exc:
        raise GgmlLoadError(f"{ggml_h}: {exc}") from None
    try:
        dev_types = parse_enum(backend, "ggml_backend_dev_type", "GGML_BACKEND_DEVICE_TYPE_")
        dev_caps = parse_bool_fields(backend, "ggml_backend_dev_caps")
    except GgmlLoadError as exc:
        raise GgmlLoadError(f"{backend_h}: {exc}") from None
    return HeaderFacts(
        ops=ops,
        op_count=op_count,
        types=types,
        type_count=type_count,
        limits=GgmlLimits(max_["DIMS"], max_["SRC"], max_["OP_PARAMS"], max_["NAME"]),
        tensor_flags=tensor_flags,
        statuses=statuses,
        unary_ops=unary_ops,
        glu_ops=glu_ops,
        rope_types=parse_defines(text, "GGML_ROPE_TYPE_"),
        op_hints=op_hints,
        dev_types=dev_types,
        dev_caps=dev_caps,
        max_n_threads=max_.get("N_THREADS", 0),
    )
