"""The Forward table (apir.codec.forward) against the C's bytes: every conformance vector step
(captured from ggml's C guest and C host library, APIR 0.1 and 0.2) decodes through the table
as the host decodes it, encodes back to the C guest's command as the client encodes it, and
its reply decodes and encodes the same way."""

from __future__ import annotations

import numpy as np
import pytest

from apir.codec.constants import (
    APIR_FORWARD_POSTED,
    APIR_PROTOCOL_0_1,
    APIR_PROTOCOL_0_2,
    ApirBackendCommandType,
    ApirExtensionCommandType,
)
from apir.codec.forward import (
    FORWARD,
    InlineTensor,
    Kind,
    MalformedMessage,
    TensorLayouts,
    decode_args,
    decode_reply,
    encode_args,
    encode_reply,
    reply_writers,
)
from apir.codec.records import GGML_0_20_LIMITS
from apir.codec.wire import Decoder, Encoder
from apir.conformance import vectors

FILES = sorted(vectors.default_vector_dir().glob("*.json"))
# the C guest's and C host library's (APIR 0.1, 0.2); the others are the extension vectors
C_FILES = [f for f in FILES if not vectors.load(f).extensions]
HEADER = 12  # command type, flags, reply resource id
LAYOUTS = TensorLayouts.of(GGML_0_20_LIMITS)
TENSORS = (Kind.RPC_TENSOR, Kind.INLINE_TENSOR)


def _steps(vf):
    """(step, function) of each Forward step of a vector file; the error steps too."""
    by_name = {f.name: f for f in FORWARD.values()}
    for session in vf.sessions:
        for step in session.steps:
            if step.raw["command_type"] == "Forward" and step.function in by_name:
                yield step, by_name[step.function]


def _offset(fields, name: str) -> int:
    return next(item[0] for item in fields if item[2] == name)


def _masked(raw: bytes, fields) -> bytes:
    """`raw` with the bytes of fields whose rule is "any" (padding the C leaves as it was,
    run-dependent values) zeroed."""
    out = bytearray(raw)
    for item in fields:
        if item[5:] == ["any"]:
            out[item[0] : item[0] + item[1]] = bytes(item[1])
    return bytes(out)


def _inline_from_vector(fields, command: bytes, name: str) -> InlineTensor:
    """The inline tensor's parts, cut out of the C's command at the vector's field offsets."""
    size = LAYOUTS.ggml_tensor.itemsize
    type_at = LAYOUTS.ggml_tensor.fields["type"][1]
    names = {item[2] for item in fields}

    def struct(prefix: str) -> bytes:
        start = _offset(fields, prefix + ".type") - type_at
        return command[start : start + size]

    handle = [item for item in fields if item[2].startswith(f"{name}.buffer handle")]
    view_src = struct(f"{name}.view_src") if f"{name}.view_src.type" in names else None
    srcs = []
    while f"{name}.src[{len(srcs)}].type" in names:
        srcs.append(struct(f"{name}.src[{len(srcs)}]"))
    buffer = int.from_bytes(command[handle[0][0] : handle[0][0] + 8], "little") if handle else None
    return InlineTensor(struct(name), buffer, view_src, tuple(srcs))


def _args_from_vector(step, function, version):
    """The arguments as the C guest sent them, read from the vector's annotated fields (not
    through the table's decoder)."""
    fields, command = step.raw["command"]["fields"], step.command
    values = []
    for field in function.args_in(version):
        if field.kind is Kind.RPC_TENSOR:
            start = _offset(fields, field.name + ".id")
            values.append(command[start : start + LAYOUTS.rpc_tensor.itemsize])
        elif field.kind is Kind.INLINE_TENSOR:
            values.append(_inline_from_vector(fields, command, field.name))
        else:
            values.append(step.arg(field.name))
    return values


def test_the_table_has_each_backend_function_once():
    extensions = sorted(int(f) for f in ApirExtensionCommandType)
    assert sorted(FORWARD) == sorted(int(f) for f in ApirBackendCommandType) + extensions
    assert min(extensions) >= len(ApirBackendCommandType)  # a 0.2 host answers INDEX_INVALID
    assert all(FORWARD[i].id == i for i in FORWARD)
    for function in FORWARD.values():
        names = [f.name for f in function.args + function.reply]
        assert len(set(f.name for f in function.args)) == len(function.args), function.name
        assert len(set(f.name for f in function.reply)) == len(function.reply), names
    newer = [(fn.name, f.name) for fn in FORWARD.values() for f in fn.args + fn.reply if f.since != APIR_PROTOCOL_0_1]
    assert newer == [("device_get_props", "mmap_support")]
    props = FORWARD[ApirBackendCommandType.DEVICE_GET_PROPS]
    assert len(props.reply_in(APIR_PROTOCOL_0_1)) == 4 and len(props.reply_in(APIR_PROTOCOL_0_2)) == 5


@pytest.mark.parametrize("path", C_FILES, ids=[f.stem for f in C_FILES])
def test_the_vectors_cover_every_function(path):
    vf = vectors.load(path)
    assert {fn.name for step, fn in _steps(vf) if not step.name.startswith("error.")} == {
        fn.name for fn in FORWARD.values() if isinstance(fn.id, ApirBackendCommandType)
    }


def test_the_extension_vectors_cover_what_the_c_guest_sends():
    (vf,) = [vectors.load(f) for f in FILES if f not in C_FILES]
    ext = {fn.name for _, fn in _steps(vf) if not isinstance(fn.id, ApirBackendCommandType)}
    assert ext == {"ext_query", "device_select", "graph_compute_keep", "graph_recompute", "synchronize",
                   "buffer_set_tensor_at", "event_new", "event_record", "event_wait", "event_synchronize",
                   "event_free"}
    posted = {fn.name for step, fn in _steps(vf) if step.raw["function_id"] & APIR_FORWARD_POSTED}
    assert posted == {"buffer_set_tensor_at", "buffer_clear"}


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_commands_decode_and_encode_as_the_c_guest_sent_them(path):
    vf = vectors.load(path)
    version = (0, vf.minor)
    checked = 0
    for step, function in _steps(vf):
        if step.name.startswith("error."):
            continue
        command, fields = step.command, step.raw["command"]["fields"]
        expected = _args_from_vector(step, function, version)
        # the host's side: every byte the C sent is read, each value where the vector has it
        dec = Decoder(command, HEADER)
        got = decode_args(dec, function, version, LAYOUTS)
        assert dec.pos == len(command) and not dec.fatal, step.name
        for field, value, want in zip(function.args_in(version), got, expected):
            assert (bytes(value) if field.kind is Kind.RPC_TENSOR else value) == want, (step.name, field.name)
        # the guest's side: the table's encoding is the C guest's command, byte for byte
        buf = bytearray(len(command))
        buf[:HEADER] = command[:HEADER]
        enc = Encoder(buf, HEADER)
        encode_args(enc, function, version, expected)
        assert enc.pos == len(command), step.name
        assert _masked(bytes(buf), fields) == _masked(command, fields), step.name
        checked += 1
    assert checked >= 23


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_replies_decode_and_encode_as_the_c_host_wrote_them(path):
    vf = vectors.load(path)
    version = (0, vf.minor)
    checked = 0
    for step, function in _steps(vf):
        reply = step.raw.get("reply")  # none for a posted command
        if step.name.startswith("error.") or not function.reply or not reply or reply["return_code"] != 4:
            continue  # a failed command's payload means nothing
        raw, fields = bytes.fromhex(reply["hex"]), reply["fields"]
        named = {item[2]: item[4] for item in fields if item[5:] != ["any"] or item[4] is not None}
        # the guest's side: each value the C host wrote, and nothing after the last
        dec = Decoder(raw)
        got = decode_reply(dec, function, version)
        assert dec.pos == len(raw) and not dec.fatal, step.name
        for field, value in zip(function.reply_in(version), got):
            assert value == named[field.name], (step.name, field.name)
        # the host's side: the table's encoding is the C host's reply, and so is what a
        # handler's reply writer (one call, by the function's C name) appends
        buf = bytearray(len(raw))
        encode_reply(Encoder(buf), function, version, got)
        assert _masked(bytes(buf), fields) == _masked(raw, fields), step.name
        written = bytearray(len(raw))
        reply_writers(version, version)[function.name](Encoder(written), *got)
        assert _masked(bytes(written), fields) == _masked(raw, fields), step.name
        checked += 1
    assert checked >= 16


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_a_command_cut_short_is_malformed(path):
    vf = vectors.load(path)
    version = (0, vf.minor)
    if path in C_FILES:
        truncated = [step for step, _ in _steps(vf) if step.name == "error.buffer_get_base.truncated"]
        assert truncated
        get_base = FORWARD[ApirBackendCommandType.BUFFER_GET_BASE]
        with pytest.raises(MalformedMessage, match="buffer_get_base: arguments end before 'buffer'"):
            decode_args(Decoder(truncated[0].command, HEADER), get_base, version, LAYOUTS)
    for step, function in _steps(vf):  # every C command less its last byte
        if function.args_in(version) and not step.name.startswith("error."):
            with pytest.raises(MalformedMessage):
                decode_args(Decoder(step.command[:-1], HEADER), function, version, LAYOUTS)


def test_encoding_checks_the_number_of_values():
    clear = FORWARD[ApirBackendCommandType.BUFFER_CLEAR]
    with pytest.raises(TypeError, match=r"buffer_clear: 1 arguments given, the table has 2 \(buffer, value\)"):
        encode_args(Encoder(bytearray(64)), clear, APIR_PROTOCOL_0_2, [1])
    writers = reply_writers(APIR_PROTOCOL_0_2, APIR_PROTOCOL_0_2)
    with pytest.raises(TypeError, match=r"device_get_memory: 1 reply values given, the table has 2 \(free, total\)"):
        writers["device_get_memory"](Encoder(bytearray(64)), 1)
    with pytest.raises(TypeError):  # one field: the Encoder's own step, which takes one value
        writers["device_get_type"](Encoder(bytearray(64)), 1, 2)


_SCALAR_READS = {
    Kind.I32: Decoder.i32,
    Kind.U32: Decoder.u32,
    Kind.RES_ID: Decoder.u32,
    Kind.U8: Decoder.u8,
    Kind.BOOL: Decoder.bool,
    Kind.SIZE: Decoder.u64,
    Kind.UINTPTR: Decoder.u64,
    Kind.HANDLE: Decoder.u64,
}


def test_fixed_size_layouts_decode_as_field_by_field_reads():
    # the Layouts read all-fixed-size functions as one struct: the values, and the field a short
    # message is refused at, must be those of one Decoder read per field, on any bytes
    rng = np.random.default_rng(7)
    checked = 0
    for function in FORWARD.values():
        for version in (APIR_PROTOCOL_0_1, APIR_PROTOCOL_0_2):
            for layout in function.layouts(version):
                if not layout.fields or any(f.kind not in _SCALAR_READS for f in layout.fields):
                    continue
                for _ in range(20):
                    raw = rng.integers(0, 256, 8 * len(layout.fields) + 8, dtype=np.uint8).tobytes()
                    for size in range(len(raw) + 1):
                        want_dec, short = Decoder(raw, 0, size), None
                        want = []
                        for field in layout.fields:
                            want.append(_SCALAR_READS[field.kind](want_dec))
                            if want_dec.fatal:
                                short = field.name
                                break
                        dec = Decoder(raw, 0, size)
                        if short is None:
                            assert layout.decode(dec) == tuple(want)
                            assert dec.pos == want_dec.pos
                        else:
                            with pytest.raises(MalformedMessage, match=f"before '{short}'"):
                                layout.decode(dec)
                checked += 1
    assert checked >= 20
