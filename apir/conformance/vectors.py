"""The conformance vectors (apir/conformance/data/*.json) and their comparison rules.

Theory of operation: a vector file holds, per APIR version, sessions of steps captured from
ggml's C guest and C host library (scripts/make-conformance-vectors.py). Every command, reply
and shared-memory payload comes as hex plus fields ``[offset, size, name, helper, value,
rule?]``. `compare` checks actual bytes against one annotated payload and returns the first
field that differs, applying the rule of each field (conformance/README.md):

    (none)      the bytes are equal
    any         not compared (padding, holes, name tails, run-dependent values)
    any-string  a reply string (array size + chars) of any length and content
    nonzero     0 where the vector has 0, any non-zero value where it has one (elementwise
                for arrays of u64: guest pointers, handles given by the host, bases)
    handle      a host handle: non-zero; remembered as "<step>.<field>" for later "ref:"s
    ref:S.F     equal to what the host's reply to step S gave in field F
    res:ROLE    the res_id of the blob with that role (reply, data, blob.<step>)
    id          a tensor id: non-zero and unique in the message; the vector's id maps to it
    id-ref      0 where the vector has 0, else the id the vector's id mapped to (elementwise)
    guest-id    a value the guest picks (graph ids of graph replay): non-zero; within a session
                one vector value maps to one actual value, and different ones to different ones

A session may carry `host_config`: the host configuration its replies need (apir's host keys,
e.g. {"apir.host.extensions": "off"} for the APIR 0.2 fallback of the extension vectors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional

__all__ = [
    "VECTOR_FORMAT",
    "Context",
    "Session",
    "Step",
    "VectorFile",
    "compare",
    "default_vector_dir",
    "field_value",
    "load",
]

VECTOR_FORMAT = "apir-conformance/1"


def default_vector_dir() -> Path:
    """apir/conformance/data/, shipped with the package (a wheel has them too)."""
    return Path(__file__).resolve().parent / "data"


@dataclass
class Step:
    raw: dict

    @property
    def name(self) -> str:
        return self.raw["name"]

    @property
    def function(self) -> Optional[str]:
        return self.raw.get("function")

    @property
    def command(self) -> bytes:
        return bytes.fromhex(self.raw["command"]["hex"])

    def arg(self, name: str):
        """The value of the command field `name` (e.g. "size", "buft")."""
        return field_value(self.raw["command"]["fields"], name)


@dataclass
class Session:
    name: str
    capset: int
    resources: Dict[str, dict]
    steps: List[Step]
    host_config: Optional[Dict[str, str]] = None


@dataclass
class VectorFile:
    path: Path
    apir: str
    ggml: str
    layouts: dict
    constants: dict
    sessions: List[Session]
    extensions: bool = False  # vectors of the extensions beyond APIR 0.2, answered by apir's host

    @property
    def minor(self) -> int:
        return int(self.apir.split(".")[1])

    def __str__(self) -> str:
        return self.path.name


def load(path) -> VectorFile:
    """Reads one vector file. Raises ValueError for another format."""
    path = Path(path)
    doc = json.loads(path.read_text())
    if doc.get("format") != VECTOR_FORMAT:
        raise ValueError(f"{path}: not an {VECTOR_FORMAT} file")
    sessions = [
        Session(s["name"], s["capset"], s["resources"], [Step(st) for st in s["steps"]], s.get("host_config"))
        for s in doc["sessions"]
    ]
    return VectorFile(
        path, doc["apir"], doc["ggml"], doc["layouts"], doc["constants"], sessions, bool(doc.get("extensions"))
    )


def load_all(paths: Iterable) -> List[VectorFile]:
    out = []
    for p in paths:
        p = Path(p)
        out += [load(f) for f in sorted(p.glob("*.json"))] if p.is_dir() else [load(p)]
    return out


def field_value(fields: list, name: str):
    for item in fields:
        if item[2] == name:
            return item[4]
    raise KeyError(name)


@dataclass
class Context:
    """What the rules carry between fields and steps of one session replay."""

    res: Dict[str, int] = field(default_factory=dict)  # role -> actual res_id
    handles: Dict[str, int] = field(default_factory=dict)  # "step.field" -> actual handle
    ids: Dict[int, int] = field(default_factory=dict)  # vector id -> actual id (one message)
    guest_ids: Dict[int, int] = field(default_factory=dict)  # vector guest-id -> actual (one session)


def _ints(raw: bytes, size: int) -> List[int]:
    return [int.from_bytes(raw[i : i + 8], "little") for i in range(0, size, 8)]


def compare(fields: list, actual: bytes, ctx: Context, step: str = "", strict_length: bool = True) -> Optional[str]:
    """Checks `actual` against annotated `fields`; returns None, or a description of the first
    field that differs. "handle" fields are recorded in ctx.handles under "<step>.<field>";
    ids are mapped afresh for this message (ctx.ids is reset)."""
    ctx.ids = {}
    seen_ids: set = set()
    end = 0
    # ids first: id-refs may come before the record that defines the id (graph node lists)
    for off, size, name, _helper, value, *rule in fields:
        if rule and rule[0] == "id":
            got = int.from_bytes(actual[off : off + size], "little")
            if off + size > len(actual):
                return f"{name}: missing (message is {len(actual)} bytes)"
            if not got or got in seen_ids:
                return f"{name}: id {got:#x} is zero or not unique"
            seen_ids.add(got)
            ctx.ids[value] = got
    for item in fields:
        off, size, name, _helper, value = item[:5]
        rule = item[5] if len(item) > 5 else None
        end = max(end, off + size)
        if rule == "any-string":
            end = len(actual)
            if len(actual) - off < 8:
                return f"{name}: missing string"
            n = int.from_bytes(actual[off : off + 8], "little")
            if n == 0 or off + 8 + n > len(actual) or actual[off + 8 + n - 1] != 0:
                return f"{name}: not a NUL-terminated string of array size {n}"
            continue
        if off + size > len(actual):
            return f"{name}: missing (message is {len(actual)} bytes, field ends at {off + size})"
        got_raw = actual[off : off + size]
        if rule is None:
            if not _equal(item, got_raw):
                return _diff(name, value, got_raw, item)
            continue
        if rule.startswith(("res:", "ref:")):
            expected = (ctx.res if rule.startswith("res:") else ctx.handles).get(rule[4:])
            if expected is None:
                return f"{name}: {rule} unknown (an earlier step failed)"
            elif int.from_bytes(got_raw, "little") != expected:
                return f"{name}: {int.from_bytes(got_raw, 'little'):#x}, expected {rule} = {expected:#x}"
            continue
        if rule == "any":
            continue
        if rule == "handle":
            handle = int.from_bytes(got_raw, "little")
            if not handle:
                return f"{name}: null handle"
            ctx.handles[f"{step}.{name}"] = handle
            continue
        if rule in ("nonzero", "id-ref"):
            want = value if isinstance(value, list) else [value]
            values = _ints(got_raw, size) if size >= 8 else [int.from_bytes(got_raw, "little")]
            for i, (w, g) in enumerate(zip(want, values)):
                label = f"{name}[{i}]" if isinstance(value, list) else name
                if (w == 0) != (g == 0):
                    return f"{label}: {g:#x}, expected {'0' if w == 0 else 'non-zero'}"
                if rule == "id-ref" and w and ctx.ids.get(w) != g:
                    return f"{label}: {g:#x} does not name the tensor the vector's id {w:#x} names"
            continue
        if rule == "id":
            continue
        if rule == "guest-id":
            sent = int.from_bytes(got_raw, "little")
            mapped = ctx.guest_ids.get(value)
            if not sent:
                return f"{name}: 0, expected a non-zero id"
            if mapped is None and sent in ctx.guest_ids.values():
                return f"{name}: {sent:#x} is already the id of another vector value"
            if mapped is not None and sent != mapped:
                return f"{name}: {sent:#x}, expected {mapped:#x} (the id sent for the vector's {value:#x} before)"
            ctx.guest_ids[value] = sent
            continue
        raise ValueError(f"unknown rule {rule!r} in field {name}")
    if strict_length and len(actual) != end:
        return f"length {len(actual)}, expected {end}"
    return None


def _expected_bytes(item) -> Optional[bytes]:
    size, value = item[1], item[4]
    if isinstance(value, str):
        return value.encode("latin-1") + b"\0"
    if isinstance(value, list):
        width = size // len(value)
        signed = any(v < 0 for v in value)
        return b"".join(int(v).to_bytes(width, "little", signed=signed) for v in value)
    if isinstance(value, int):
        return int(value).to_bytes(size, "little", signed=value < 0)
    return None


def _equal(item, got_raw: bytes) -> bool:
    expected = _expected_bytes(item)
    return expected is None or expected == bytes(got_raw)


def _diff(name, value, got_raw: bytes, item) -> str:
    size = item[1]
    if isinstance(value, str):
        text = bytes(got_raw).split(b"\0")[0].decode("latin-1")
        return f"{name}: {text!r}, expected {value!r}"
    if isinstance(value, list):
        width = size // len(value)
        signed = any(v < 0 for v in value) or "i" in item[3][:1]
        elems = [int.from_bytes(got_raw[i : i + width], "little", signed=signed) for i in range(0, size, width)]
        return f"{name}: {elems}, expected {value}"
    number = int.from_bytes(got_raw, "little", signed=isinstance(value, int) and value < 0)
    return f"{name}: {number}, expected {value}"
