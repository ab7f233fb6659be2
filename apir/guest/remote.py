"""`Remote`: one APIR context on a virtgpu device, and the remote call over it.

Theory of operation (the C `create_virtgpu` + `remote_call*`, virtgpu.cpp; docs/design.md,
"Guest: remote call and client"): the context is made on the APIR capset when the device
offers it, else on Venus, every command type + 331 (`select_capset`; docs/protocol.md section
3). Two host-visible blobs are made at start and kept: the reply blob, whose first u32 is the
reply notification word, and the data window (`data_size`) for tensor bytes and graphs.

A call encodes the header and the arguments, zeroes the word, sends EXECBUFFER, waits until the
host stores `return code + 1` there (release; acquire loads here) and decodes the reply. The
wait spins a short, adaptive time letting the GIL go (an embedded host in another thread keeps
running), then sleeps, or waits in the device's `watch`, which raises at once when the host is
gone; `ApirTimeout` at its limit. One re-entrant lock covers the call, so concurrent callers
never interleave on the shared blobs. `call(..., meanwhile=fn)` submits without waiting for the
command to run and runs `fn` (a transfer's copy of its next chunk) before the wait: still one
command in flight and one reply each, checked before the next is sent.

`post(...)` queues a posted command (the ASYNC extension, docs/protocol.md 12.7): no reply
word is cleared or waited for. Posted commands gather at the head of the command buffer and go
with the next call's EXECBUFFER (or alone once POST_BATCH_BYTES gather, or at `flush_posts`);
a set's bytes travel in the post window (`post_window`), a blob no waited-for command uses.
`waited` counts the calls (EXECBUFFERs waited for), `posted` the posted commands,
`execbuffers` every EXECBUFFER sent.

A late reply after a timeout can still land in the reply blob, and one arriving during the next
call would be taken for its own: a host that misses a deadline should be treated as lost.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from typing import Callable, Iterator, Optional, Tuple

import numpy as np

from apir.codec.atomics import Word, spins_for
from apir.codec.constants import (
    APIR_HANDSHAKE_MAX_WAIT_S,
    APIR_LOADLIBRARY_MAX_WAIT_S,
    SHMEM_DATA_SIZE,
    SHMEM_REPLY_SIZE,
    VENUS_COMMAND_TYPE_LENGTH,
    ApirBackendCommandType,
    ApirCommandType,
    CapsetApir,
)
from apir.codec.virtgpu import VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS, VirtgpuParam, blob_size
from apir.codec.wire import Decoder, Encoder
from apir.guest.device import Blob, NoWaitDevice, VirtgpuDevice, WatchedDevice
from apir.guest.errors import ApirTimeout, DeviceError, MissingCapability

__all__ = [
    "Remote",
    "select_capset",
    "DEFAULT_FORWARD_TIMEOUT_S",
    "COMMAND_BUFFER_SIZE",
    "TRANSFER_CHUNK",
    "POST_WINDOW_SIZE",
]

log = logging.getLogger(__name__)

# The C guest uses the APIR capset only when this is set (else Venus).
ENV_USE_APIR_CAPSET = "GGML_REMOTING_USE_APIR_CAPSET"
DEFAULT_FORWARD_TIMEOUT_S = 300.0  # a graph may run long; the C has no limit at all
COMMAND_BUFFER_SIZE = 64 * 1024  # the command itself; bulk bytes go through the data window
# A pipelined transfer's chunk: small enough that filling and draining the pipeline (one chunk
# copied alone at each end) is cheap and the two windows stay in the last-level cache, large
# enough that a call's round trip, during which the host's copy waits, is small next to its
# copy (docs/design.md, Measurements).
TRANSFER_CHUNK = 8 << 20
# The post window: bytes of posted set_tensors between two waited-for commands (a larger set,
# or one past a full window, is waited for, which frees the window).
POST_WINDOW_SIZE = 4 << 20
# Posted commands sent in one EXECBUFFER at most (then the batch goes alone): with the call
# after them it still fits the local transport's exec ring.
POST_BATCH_BYTES = 8 << 10

# Wait tuning: spin at least _SPIN_MIN_S, at most _SPIN_MAX_S (twice the recent reply
# latency when that fits), in one call (then chunks of _SPIN_CHUNK acquire loads should the
# load rate have been overestimated); then sleep from _SLEEP_MIN_S doubling to _SLEEP_MAX_S,
# or to _WOKEN_SLEEP_MAX_S on a device whose `watch` returns once the host is done
# (`watch_wakes`, apir.guest.device.WatchedDevice): looking every millisecond through a long
# compute takes a share of the core the host's threads need (docs/design.md, Measurements).
_COMMAND_HEADER = struct.Struct("<iiI")  # command type, flags, reply res_id (remote_call_prepare)
_POST_HEADER = struct.Struct("<iII")  # the same, with a posted function id's top bit
_SPIN_MIN_S = 20e-6
_SPIN_MAX_S = 500e-6
_SPIN_CHUNK = 2048
_SLEEP_MIN_S = 10e-6
_SLEEP_MAX_S = 1e-3
_WOKEN_SLEEP_MAX_S = 50e-3
_NO_DATA = np.zeros(0, dtype=np.uint8)  # a closed Remote's data_view


def select_capset(device: VirtgpuDevice, use_apir_capset: Optional[bool] = None) -> int:
    """The capset id for this device: APIR (10) when forced (`use_apir_capset` True, or
    None and GGML_REMOTING_USE_APIR_CAPSET set) or offered, else Venus (4). Raises
    MissingCapability when the device offers neither (an empty mask means the kernel
    predates the query: Venus is tried, as the C does)."""
    if use_apir_capset is None:
        use_apir_capset = os.environ.get(ENV_USE_APIR_CAPSET) is not None
    if use_apir_capset:
        return VIRTGPU_DRM_CAPSET_APIR
    mask = device.get_param(VirtgpuParam.SUPPORTED_CAPSET_IDS)
    if mask & (1 << VIRTGPU_DRM_CAPSET_APIR):
        return VIRTGPU_DRM_CAPSET_APIR
    if mask == 0 or mask & (1 << VIRTGPU_DRM_CAPSET_VENUS):
        return VIRTGPU_DRM_CAPSET_VENUS
    raise MissingCapability(
        getattr(device, "name", repr(device)), "capset 10 (APIR) or 4 (Venus)", f"offered capsets mask {mask:#x}"
    )


class Remote:
    """One APIR context: capset, context, reply blob, data window, and `call`.

    `device`: a VirtgpuDevice, owned from now on (closed by `close`, or when this
    constructor fails). `transfer_chunk`: the bytes per call of a transfer that overlaps its
    copies (`transfer_windows`; at most the data window). Raises MissingCapability (capset),
    DeviceError (context, blobs)."""

    def __init__(
        self,
        device: VirtgpuDevice,
        *,
        data_size: int = SHMEM_DATA_SIZE,
        use_apir_capset: Optional[bool] = None,
        forward_timeout_s: float = DEFAULT_FORWARD_TIMEOUT_S,
        transfer_chunk: int = TRANSFER_CHUNK,
    ):
        if transfer_chunk <= 0:
            raise ValueError(f"transfer_chunk must be positive, got {transfer_chunk}")
        self.device = device
        self.name = getattr(device, "name", type(device).__name__)
        self.forward_timeout_s = forward_timeout_s
        self.lock = threading.RLock()
        self._command = bytearray(COMMAND_BUFFER_SIZE)
        self._encoder = Encoder(self._command)  # reset for each call
        self._command_view = memoryview(self._command)  # (the bytearray is never resized)
        self._latency_s = _SPIN_MIN_S
        # the wait's sleep
        self._pause: Callable[[float], None] = device.watch if isinstance(device, WatchedDevice) else time.sleep
        woken = isinstance(device, WatchedDevice) and getattr(device, "watch_wakes", False)
        self._sleep_max_s = _WOKEN_SLEEP_MAX_S if woken else _SLEEP_MAX_S
        # submission for a call with work of its own to do before it waits (`meanwhile`)
        self._execbuffer_nowait = device.execbuffer_nowait if isinstance(device, NoWaitDevice) else device.execbuffer
        self._spare: Optional[Blob] = None  # the second transfer window, once made
        self._spare_view = _NO_DATA
        self._spare_refused = False  # the device refused it once: transfers go one chunk at a time
        self._post: Optional[Blob] = None  # the post window, once made
        self.waited = 0  # calls: EXECBUFFERs whose reply was waited for
        self.posted = 0  # posted commands (no reply)
        self._flushes = 0  # EXECBUFFERs of posted commands alone (`flush_posts`)
        self._batched = 0  # bytes of posted commands at the head of the command buffer, not sent yet
        self._reply: Optional[Blob] = None  # None until made, and once closed
        self._data: Optional[Blob] = None
        self.closed = False
        try:
            self.capset_id = select_capset(device, use_apir_capset)
            self.command_type_offset = 0 if self.capset_id == VIRTGPU_DRM_CAPSET_APIR else VENUS_COMMAND_TYPE_LENGTH
            caps = device.get_caps(self.capset_id, CapsetApir.SIZE)
            # Only the APIR capset has this layout (the C reads Venus's into it too, unchecked).
            self.capset = CapsetApir.unpack(caps) if self.capset_id == VIRTGPU_DRM_CAPSET_APIR else None
            if self.capset is not None and not self.capset.supports_blob_resources:
                raise MissingCapability(self.name, "blob resources in capset 10 (APIR)")
            device.context_init(self.capset_id, 1)
            self._reply = reply = device.create_blob(blob_size(SHMEM_REPLY_SIZE))
            self._data = data = device.create_blob(blob_size(data_size))
        except BaseException:
            self.close()  # the device is ours: released on failure too
            raise
        self._reply_res_id = reply.res_id
        self._reply_word: Optional[Word] = Word(reply.memory, 0)  # the reply notification word
        self._reply_decoder: Optional[Decoder] = Decoder(reply.memory, 4, reply.size)  # reset for each call
        self.data_view = np.frombuffer(data.memory, dtype=np.uint8)  # the data window, as bytes
        self.transfer_chunk = min(transfer_chunk, data.size)

    @property
    def reply(self) -> Blob:
        """The reply blob (notification word, then the reply payload). RuntimeError once closed."""
        if self._reply is None:
            raise RuntimeError("the Remote is closed")
        return self._reply

    @property
    def data(self) -> Blob:
        """The data window's blob. RuntimeError once closed."""
        if self._data is None:
            raise RuntimeError("the Remote is closed")
        return self._data

    @property
    def execbuffers(self) -> int:
        """EXECBUFFERs sent: one per call, and one per flush of posted commands alone."""
        return self.waited + self._flushes

    @property
    def data_size(self) -> int:
        return self.data.size

    def default_timeout(self, cmd_type: int) -> float:
        if cmd_type == ApirCommandType.HANDSHAKE:
            return APIR_HANDSHAKE_MAX_WAIT_S
        if cmd_type == ApirCommandType.LOADLIBRARY:
            return APIR_LOADLIBRARY_MAX_WAIT_S
        return self.forward_timeout_s

    def call(
        self,
        cmd_type: int,
        flags: int = 0,
        encode_fn: Optional[Callable[[Encoder], None]] = None,
        timeout_s: Optional[float] = None,
        decode_fn: Optional[Callable[[int, Decoder], object]] = None,
        meanwhile: Optional[Callable[[], None]] = None,
    ) -> Tuple[int, object]:
        """One remote call (`remote_call_prepare` + `remote_call`).

        `cmd_type`: ApirCommandType; `flags`: the backend function id for Forward;
        `encode_fn(enc)` appends the arguments (it may also fill the data window);
        `timeout_s`: the wait limit (default by command type); `decode_fn(ret, dec)` reads
        the reply. `meanwhile()`, when given, runs after the command is submitted and before
        the wait (without waiting for the command to run where the device can: see the
        module's 5.); it must not touch the blobs the command uses, and the wait happens even
        when it raises (its error is then the call's). Returns (return code, decode_fn's
        result, or without one the Remote's reply Decoder itself, which the next call resets:
        read it while holding `lock`).

        Raises ApirTimeout, EncoderOverflow, DeviceError (also while waiting, when the
        device's `watch` finds the host gone)."""
        if timeout_s is None:
            timeout_s = self.default_timeout(cmd_type)
        with self.lock:
            if self.closed or self._reply_decoder is None or self._reply_word is None:
                raise RuntimeError("remote call on a closed Remote")
            enc = self._encoder
            enc.start = self._batched  # after the posted commands that go with it
            enc.reset()
            enc.pack(_COMMAND_HEADER, int(cmd_type) + self.command_type_offset, int(flags), self._reply_res_id)
            if encode_fn is not None:
                encode_fn(enc)
            enc.check()
            self._reply_word.store_release(0)
            command = self._command_view[: enc.pos]  # the posted commands batched, then this one
            self._batched = 0
            self.waited += 1
            if meanwhile is None:
                self.device.execbuffer(command)
                word = self._wait(self._reply_word, timeout_s, cmd_type, flags)
            else:
                self._execbuffer_nowait(command)
                try:
                    meanwhile()
                finally:  # the command is in flight: its reply is waited for in any case
                    word = self._wait(self._reply_word, timeout_s, cmd_type, flags)
            # (taken only now: a local holding it while the wait raised would pin the reply
            # mapping through a kept traceback, as `_wait` explains)
            dec = self._reply_decoder
            dec.reset()
            ret = word - 1
            if decode_fn is None:
                return ret, dec
            return ret, decode_fn(ret, dec)

    def post(self, flags: int, encode_fn: Callable[[Encoder], None]) -> None:
        """Queues a posted Forward (`flags`: the function id with APIR_FORWARD_POSTED):
        header (its third word the command's length) and `encode_fn`'s arguments; sent with
        the next call, or now with those before it once POST_BATCH_BYTES gathered."""
        with self.lock:
            if self.closed or self._reply_word is None:
                raise RuntimeError("remote call on a closed Remote")
            enc = self._encoder
            enc.start = self._batched
            enc.reset()
            enc.pack(_POST_HEADER, int(ApirCommandType.FORWARD) + self.command_type_offset, flags, 0)
            encode_fn(enc)
            enc.check()
            struct.pack_into("<I", self._command, self._batched + 8, enc.written)
            self._batched += enc.written
            self.posted += 1
            if self._batched >= POST_BATCH_BYTES:
                self.flush_posts()

    def flush_posts(self) -> None:
        """Sends the posted commands not sent yet, in one EXECBUFFER, waiting for nothing."""
        with self.lock:
            if self._batched:
                command, self._batched = self._command_view[: self._batched], 0
                self._flushes += 1
                self.device.execbuffer(command)

    def post_window(self) -> Blob:
        """The post window (POST_WINDOW_SIZE bytes), made on first use and kept until `close`."""
        with self.lock:
            if self._post is None:
                self._post = self.device.create_blob(blob_size(POST_WINDOW_SIZE))
            return self._post

    def _wait(self, reply_word: Word, limit_s: float, cmd_type: int, flags: int) -> int:
        """The notification word `reply_word` once non-zero; ApirTimeout after `limit_s`
        seconds, or the device's DeviceError as soon as its `watch` (used in place of sleeping)
        finds the host gone with no reply in the word. (The word is an argument, not a local
        of the caller, so that the `del` below leaves no frame of a kept traceback pinning the
        reply mapping.)"""
        word = reply_word.load_acquire()
        if word:  # already there (a device whose execbuffer waited for the command)
            self._latency_s *= 0.75  # the running mean below, with this reply's ~0 s
            return word
        pause = self._pause
        start = time.perf_counter()
        deadline = start + limit_s
        spin_s = min(max(2 * self._latency_s, _SPIN_MIN_S), _SPIN_MAX_S)
        word = reply_word.spin_until_nonzero(spins_for(spin_s))  # GIL released inside
        while not word and time.perf_counter() - start < spin_s:
            word = reply_word.spin_until_nonzero(_SPIN_CHUNK)
        sleep_s = _SLEEP_MIN_S
        while not word:
            now = time.perf_counter()
            if now >= deadline:
                word = reply_word.load_acquire()
                if word:
                    break
                # a kept traceback must not pin the reply mapping (it could not be unmapped)
                del reply_word
                raise ApirTimeout(_command_name(cmd_type, flags), limit_s)
            try:
                pause(min(sleep_s, deadline - now))
            except DeviceError:
                word = reply_word.load_acquire()  # the reply may have come before the host went
                if word:
                    break
                del reply_word
                raise
            sleep_s = min(sleep_s * 2, self._sleep_max_s)
            word = reply_word.load_acquire()
        # replies slower than the longest spin are not worth spinning for next time
        elapsed = time.perf_counter() - start
        self._latency_s = 0.75 * self._latency_s + 0.25 * min(elapsed, 4 * _SPIN_MAX_S)
        return word

    def transfer_windows(self, size: int) -> list[Tuple[int, np.ndarray]]:
        """The windows, as (res_id, byte view), a transfer of `size` bytes goes through, chunk
        k in window k % len: one (the whole data window) when `size` fits in one
        `transfer_chunk` or the device refused a second window; else two of `transfer_chunk`
        bytes, the head of the data window and a second blob, made on first use and kept
        until `close` (a refusal is logged once, and the transfer then goes one window at a
        time, as before). The caller holds `lock` for the whole transfer."""
        with self.lock:
            whole = [(self.data.res_id, self.data_view)]
            if size <= self.transfer_chunk or self._spare_refused:
                return whole
            if self._spare is None:
                try:
                    self._spare = self.device.create_blob(blob_size(self.transfer_chunk))
                except DeviceError as exc:
                    log.info("%s: no second transfer window (%s): transfers go one window at a time", self.name, exc)
                    self._spare_refused = True
                    return whole
                self._spare_view = np.frombuffer(self._spare.memory, dtype=np.uint8)
            chunk = self.transfer_chunk
            return [(self.data.res_id, self.data_view[:chunk]), (self._spare.res_id, self._spare_view[:chunk])]

    @contextlib.contextmanager
    def temporary_blob(self, size: int) -> Iterator[Blob]:
        """A blob of at least `size` bytes for one transfer larger than the data window
        (the C's temp_shmem); destroyed afterwards."""
        blob = self.device.create_blob(blob_size(size))
        try:
            yield blob
        finally:
            self.device.destroy_blob(blob)

    def close(self) -> None:
        """Destroys both blobs and closes the device. Idempotent; a host already gone is
        no error here (its end of the blobs went with it)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self._reply_word = self._reply_decoder = None
            self.data_view = self._spare_view = _NO_DATA  # drops the views of the mappings
            for blob in (self._reply, self._data, self._spare, self._post):
                if blob is not None:
                    try:
                        self.device.destroy_blob(blob)
                    except BufferError:  # a view of the mapping is still alive somewhere
                        log.warning("%s: blob %d is still in use; left mapped", self.name, blob.res_id)
                    except DeviceError as exc:  # the host is gone, and the blob with it
                        log.info("%s: blob %d not destroyed: %s", self.name, blob.res_id, exc)
            self._reply = self._data = self._spare = self._post = None
            self.device.close()

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _command_name(cmd_type: int, flags: int) -> str:
    try:
        name = ApirCommandType(cmd_type).c_name
    except ValueError:
        return f"command {cmd_type}"
    if cmd_type == ApirCommandType.FORWARD:
        try:
            return f"Forward {ApirBackendCommandType(flags).c_name}"
        except ValueError:
            return f"Forward {flags}"
    return name
