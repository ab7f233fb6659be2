"""One front-end (one VM's QEMU) on the vhost-user socket: negotiation, set-up, queues, teardown.

Theory of operation: `FrontendSession.run` serves the front-end's messages on the calling
thread (the control channel) and runs the virtqueues on a second thread (the queue thread),
which waits on the kick eventfds and serves every chain the guest made available: control
commands go to the `GpuDevice` (which runs SUBMIT_3D on the context's own worker), cursor
commands are consumed. Neither thread waits for the other: a memory table change arrives while
a RESOURCE_MAP_BLOB waits for QEMU's ack, and a graph compute runs while both go on.

Negotiation follows QEMU 11.1 (features and protocol features: docs/vm.md, "What the device
does"); two queues, control (0) and cursor (1). A message the back-end cannot carry out is
refused with a non-zero REPLY_ACK status where the front-end asked for one, and logged; a
broken framing ends the session. When the session ends for any reason (QEMU quits, the VM is
killed, a protocol error) every context, blob and mapping of that VM is freed
(`GpuDevice.close`).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
from typing import Callable, Dict, List, Optional, Tuple

from apir.errors import ApirError
from apir.codec.virtgpu import VIRTIO_GPU_SHM_ID_HOST_VISIBLE, VirtioGpuCtrlType, VirtioGpuFeature
from apir.host.config import (
    CONFIG_KEY_VHOST_BACKEND_TIMEOUT,
    CONFIG_KEY_VHOST_MESSAGE_TIMEOUT,
    DEFAULT_VHOST_BACKEND_TIMEOUT_S,
    DEFAULT_VHOST_MESSAGE_TIMEOUT_S,
    config_limit,
)
from apir.host.vhost_user.backend_channel import BackendChannel
from apir.host.vhost_user.gpu_device import GpuDevice, Send
from apir.host.vhost_user.gpu_wire import NO_HEADER, response
from apir.host.vhost_user.memory import GuestMemory, GuestMemoryError
from apir.host.vhost_user.protocol import (
    CONFIG_HEADER,
    F_PROTOCOL_FEATURES,
    F_VERSION_1,
    FLAG_REPLY,
    MAX_SHMEM_REGIONS,
    MEMORY_REGION,
    U64,
    VRING_ADDR,
    VRING_INDEX_MASK,
    VRING_NOFD,
    VRING_STATE,
    Message,
    PeerClosed,
    ProtocolError,
    ProtocolFeature,
    Request,
    close_quietly,
    recv_message,
    send_message,
    set_send_timeout,
)
from apir.host.vhost_user.process_limits import Share
from apir.host.vhost_user.virtqueue import Chain, QueueError, Virtqueue

__all__ = ["FrontendSession", "DEVICE_FEATURES", "PROTOCOL_FEATURES", "NUM_QUEUES", "CONFIG_SIZE"]

log = logging.getLogger(__name__)

DEVICE_FEATURES = (
    (1 << F_VERSION_1)
    | (1 << F_PROTOCOL_FEATURES)
    | (1 << VirtioGpuFeature.VIRGL)
    | (1 << VirtioGpuFeature.RESOURCE_BLOB)
    | (1 << VirtioGpuFeature.CONTEXT_INIT)
)
PROTOCOL_FEATURES = sum(
    1 << bit
    for bit in (
        ProtocolFeature.MQ,
        ProtocolFeature.REPLY_ACK,
        ProtocolFeature.BACKEND_REQ,
        ProtocolFeature.CONFIG,
        ProtocolFeature.CONFIGURE_MEM_SLOTS,
        ProtocolFeature.SHMEM,
    )
)
NUM_QUEUES = 2  # control, cursor
CONTROL_QUEUE, CURSOR_QUEUE = 0, 1
CONFIG_SIZE = 16  # struct virtio_gpu_config: events_read, events_clear, num_scanouts, num_capsets
MAX_CONFIG_ACCESS = 256  # GET_CONFIG's largest size (VHOST_USER_MAX_CONFIG_SIZE)
MAX_SET_MEM_TABLE_REGIONS = 8  # VHOST_MEMORY_BASELINE_NREGIONS
# A control chain: the largest command is a GUEST blob's page list (apir.host.vhost_user.
# gpu_device.MAX_GUEST_ENTRIES entries of 16 bytes); SUBMIT_3D is at most 64 KiB.
MAX_CONTROL_CHAIN = 2 << 20
MAX_CURSOR_CHAIN = 4096

_FAILED = 1  # a REPLY_ACK status other than 0


class _Refused(ApirError):
    """A front-end message the back-end does not carry out (acked as failed)."""


class FrontendSession:
    """One connected front-end. `run()` blocks until it goes away, then frees everything."""

    def __init__(
        self,
        sock: socket.socket,
        device_factory: Callable[[GuestMemory], GpuDevice],
        config: Optional[dict] = None,
        name: str = "vhost-user",
    ):
        self.sock = sock
        self.name = name
        self.memory = GuestMemory(Share(config))
        self.device = device_factory(self.memory)
        self.queues = [
            Virtqueue(CONTROL_QUEUE, self.memory, MAX_CONTROL_CHAIN),
            Virtqueue(CURSOR_QUEUE, self.memory, MAX_CURSOR_CHAIN),
        ]
        self.backend_timeout_s = float(
            config_limit(config, CONFIG_KEY_VHOST_BACKEND_TIMEOUT, DEFAULT_VHOST_BACKEND_TIMEOUT_S)
        )
        self.message_timeout_s = float(
            config_limit(config, CONFIG_KEY_VHOST_MESSAGE_TIMEOUT, DEFAULT_VHOST_MESSAGE_TIMEOUT_S)
        )
        # a front-end that stops reading our replies ends its session, not the thread serving it
        set_send_timeout(sock, self.message_timeout_s)
        self.features = 0
        self.protocol_features = 0
        self.shmem_config_sent = False
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self._reset_pending = False
        self._queue_thread = threading.Thread(target=self._serve_queues, name=f"{name}-queues", daemon=True)
        self._handlers: Dict[int, Callable[[Message], Optional[bytes]]] = {
            Request.GET_FEATURES: lambda m: U64.pack(DEVICE_FEATURES),
            Request.SET_FEATURES: self._set_features,
            Request.SET_OWNER: lambda m: None,
            Request.RESET_OWNER: lambda m: None,
            Request.GET_PROTOCOL_FEATURES: lambda m: U64.pack(PROTOCOL_FEATURES),
            Request.SET_PROTOCOL_FEATURES: self._set_protocol_features,
            Request.GET_QUEUE_NUM: lambda m: U64.pack(NUM_QUEUES),
            Request.GET_MAX_MEM_SLOTS: lambda m: U64.pack(self.memory.max_regions),
            Request.SET_MEM_TABLE: self._set_mem_table,
            Request.ADD_MEM_REG: self._add_mem_reg,
            Request.REM_MEM_REG: self._rem_mem_reg,
            Request.SET_VRING_NUM: self._set_vring_num,
            Request.SET_VRING_BASE: self._set_vring_base,
            Request.SET_VRING_ADDR: self._set_vring_addr,
            Request.GET_VRING_BASE: self._get_vring_base,
            Request.SET_VRING_KICK: self._set_vring_kick,
            Request.SET_VRING_CALL: self._set_vring_call,
            Request.SET_VRING_ERR: self._set_vring_err,
            Request.SET_VRING_ENABLE: self._set_vring_enable,
            Request.SET_BACKEND_REQ_FD: self._set_backend_req_fd,
            Request.GET_CONFIG: self._get_config,
            Request.SET_CONFIG: lambda m: None,  # events_clear: no events are ever raised
            Request.GET_SHMEM_CONFIG: self._get_shmem_config,
            Request.RESET_DEVICE: lambda m: None,
        }
        # requests whose answer is their own reply (no REPLY_ACK for them)
        self._replying = {
            Request.GET_FEATURES,
            Request.GET_PROTOCOL_FEATURES,
            Request.GET_QUEUE_NUM,
            Request.GET_MAX_MEM_SLOTS,
            Request.GET_VRING_BASE,
            Request.GET_CONFIG,
            Request.GET_SHMEM_CONFIG,
        }

    # --- the session ------------------------------------------------------------------------
    def run(self) -> None:
        """Serves the front-end until it closes the socket or breaks the protocol; then
        tears everything down. Never raises for front-end or guest input."""
        try:
            self._queue_thread.start()
            while True:
                msg = recv_message(self.sock, self.message_timeout_s)
                try:
                    self._dispatch(msg)
                finally:
                    msg.close_fds()
        except PeerClosed:
            log.info("%s: front-end disconnected", self.name)
        except (ProtocolError, OSError) as exc:
            log.warning("%s: front-end dropped: %s", self.name, exc)
        except Exception:  # noqa: BLE001 - a back-end bug must not take the host down
            log.exception("%s: internal error; dropping the front-end", self.name)
        finally:
            self.close()

    def stop(self) -> None:
        """Ends `run` from another thread (the socket is shut down)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Stops the queue thread and frees the VM's contexts, blobs, memory and descriptors."""
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        if self._queue_thread.is_alive():
            self._queue_thread.join(self.backend_timeout_s + 5)
        self.device.close()
        for vq in self.queues:
            vq.close()
        if self.device.backend is not None:
            self.device.backend.close()
        self.memory.close()
        close_quietly(self._wake_r)
        close_quietly(self._wake_w)
        try:
            self.sock.close()
        except OSError:
            pass
        if not self.shmem_config_sent:
            log.warning(
                "%s: the front-end never asked GET_SHMEM_CONFIG: no host-visible region, so no "
                "blob could be mapped (QEMU 11.1 with protocol feature %d is needed)",
                self.name,
                ProtocolFeature.SHMEM,
            )

    def _dispatch(self, msg: Message) -> None:
        handler = self._handlers.get(msg.request)
        status = 0
        answer: Optional[bytes] = None
        if handler is None:
            log.warning("%s: unsupported vhost-user request %d", self.name, msg.request)
            status = _FAILED
        else:
            try:
                answer = handler(msg)
            except (_Refused, QueueError, GuestMemoryError, struct.error, OSError, ValueError) as exc:
                log.error("%s: %s refused: %s", self.name, _request_name(msg.request), exc)
                status = _FAILED
        if msg.request in self._replying:
            if answer is None:  # a query refused still gets an answer of its shape, zeroed
                answer = self._empty_answer(msg)
            send_message(self.sock, msg.request, FLAG_REPLY, answer)
        elif msg.need_reply and self.protocol_features & (1 << ProtocolFeature.REPLY_ACK):
            send_message(self.sock, msg.request, FLAG_REPLY, U64.pack(status))

    def _empty_answer(self, msg: Message) -> bytes:
        if msg.request == Request.GET_VRING_BASE:
            return VRING_STATE.pack(0, 0)
        if msg.request == Request.GET_CONFIG:
            return CONFIG_HEADER.pack(0, 0, 0)
        if msg.request == Request.GET_SHMEM_CONFIG:
            return struct.pack(f"<II{MAX_SHMEM_REGIONS}Q", 0, 0, *([0] * MAX_SHMEM_REGIONS))
        return U64.pack(0)

    # --- features ---------------------------------------------------------------------------
    def _set_features(self, msg: Message) -> None:
        features = _u64(msg)
        if features & ~DEVICE_FEATURES:
            raise _Refused(f"features {features:#x} not offered")
        self.features = features

    def _set_protocol_features(self, msg: Message) -> None:
        features = _u64(msg)
        if features & ~PROTOCOL_FEATURES:
            raise _Refused(f"protocol features {features:#x} not offered")
        self.protocol_features = features

    # --- memory table -----------------------------------------------------------------------
    def _set_mem_table(self, msg: Message) -> None:
        if len(msg.payload) < 8:
            raise _Refused("SET_MEM_TABLE without a region count")
        (count,) = struct.unpack_from("<I", msg.payload)
        if count > MAX_SET_MEM_TABLE_REGIONS or count != len(msg.fds):
            raise _Refused(f"{count} regions with {len(msg.fds)} descriptors")
        if len(msg.payload) < 8 + count * MEMORY_REGION.size:
            raise _Refused(f"{count} regions in {len(msg.payload)} bytes")
        regions = []
        try:
            for i in range(count):
                gpa, size, uva, offset = MEMORY_REGION.unpack_from(msg.payload, 8 + i * MEMORY_REGION.size)
                regions.append(self.memory.map_region(msg.fds[i], gpa, size, uva, offset, replacing=True))
        except BaseException:
            for r in regions:
                r.close()
            raise
        self.memory.set_table(regions)
        log.info("%s: memory table of %d regions", self.name, count)

    def _region(self, msg: Message) -> Tuple[int, int, int, int]:
        if len(msg.payload) < 8 + MEMORY_REGION.size:
            raise _Refused(f"memory region message of {len(msg.payload)} bytes")
        return MEMORY_REGION.unpack_from(msg.payload, 8)

    def _add_mem_reg(self, msg: Message) -> None:
        gpa, size, uva, offset = self._region(msg)
        fd = msg.take_fd()
        if fd is None:
            raise _Refused("ADD_MEM_REG without a descriptor")
        try:
            region = self.memory.map_region(fd, gpa, size, uva, offset)
        finally:
            close_quietly(fd)
        self.memory.add(region)
        log.debug("%s: + memory gpa=%#x size=%#x", self.name, gpa, size)

    def _rem_mem_reg(self, msg: Message) -> None:
        gpa, size, _, _ = self._region(msg)
        if not self.memory.remove(gpa, size):
            raise _Refused(f"no memory region gpa={gpa:#x} size={size:#x}")
        log.debug("%s: - memory gpa=%#x size=%#x", self.name, gpa, size)

    # --- vrings -----------------------------------------------------------------------------
    def _queue(self, index: int) -> Virtqueue:
        if index >= NUM_QUEUES:
            raise _Refused(f"queue {index} (the device has {NUM_QUEUES})")
        return self.queues[index]

    def _state(self, msg: Message) -> Tuple[Virtqueue, int]:
        if len(msg.payload) < VRING_STATE.size:
            raise _Refused("vring state message too short")
        index, num = VRING_STATE.unpack_from(msg.payload)
        return self._queue(index), num

    def _set_vring_num(self, msg: Message) -> None:
        vq, num = self._state(msg)
        vq.set_num(num)

    def _set_vring_base(self, msg: Message) -> None:
        vq, base = self._state(msg)
        vq.set_base(base)

    def _get_vring_base(self, msg: Message) -> bytes:
        vq, _ = self._state(msg)
        base = vq.stop()
        self._wake()
        return VRING_STATE.pack(vq.index, base)

    def _set_vring_addr(self, msg: Message) -> None:
        if len(msg.payload) < VRING_ADDR.size:
            raise _Refused("SET_VRING_ADDR too short")
        index, _flags, desc, used, avail, _log = VRING_ADDR.unpack_from(msg.payload)
        vq = self._queue(index)
        to_gpa = self.memory.uva_to_gpa
        vq.set_addresses(to_gpa(desc), to_gpa(used), to_gpa(avail))

    def _vring_file(self, msg: Message) -> Tuple[Virtqueue, Optional[int]]:
        value = _u64(msg)
        vq = self._queue(value & VRING_INDEX_MASK)
        return vq, None if value & VRING_NOFD else msg.take_fd()

    def _set_vring_kick(self, msg: Message) -> None:
        vq, fd = self._vring_file(msg)
        if vq.index == CONTROL_QUEUE and vq.restarts_fresh():
            # A new driver (the guest rebooted): the old guest's contexts and blobs go, on
            # the queue thread before it serves the new ring's first command.
            log.info("%s: the control queue restarts at 0: the guest reset the device", self.name)
            self._reset_pending = True
        vq.set_kick(fd)
        self._wake()  # serve what is already available, and poll the new descriptor

    def _set_vring_call(self, msg: Message) -> None:
        vq, fd = self._vring_file(msg)
        vq.set_call(fd)

    def _set_vring_err(self, msg: Message) -> None:
        _, fd = self._vring_file(msg)
        close_quietly(fd)  # errors are logged here, not signalled

    def _set_vring_enable(self, msg: Message) -> None:
        self._state(msg)  # checked; rings run once kicked (the device has no per-ring state)

    # --- back-end channel, config, shared memory --------------------------------------------
    def _set_backend_req_fd(self, msg: Message) -> None:
        fd = msg.take_fd()
        if fd is None:
            raise _Refused("SET_BACKEND_REQ_FD without a descriptor")
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket: refused, and closed (else each one leaks a descriptor)
            close_quietly(fd)
            raise
        old = self.device.backend
        self.device.backend = BackendChannel(sock, self.backend_timeout_s)
        if old is not None:
            old.close()

    def _get_config(self, msg: Message) -> bytes:
        if len(msg.payload) < CONFIG_HEADER.size:
            raise _Refused("GET_CONFIG too short")
        offset, size, flags = CONFIG_HEADER.unpack_from(msg.payload)
        if size > MAX_CONFIG_ACCESS:
            raise _Refused(f"GET_CONFIG of {size} bytes")
        config = struct.pack("<IIII", 0, 0, 1, len(self.device.capsets))
        data = config[offset : offset + size] if offset < len(config) else b""
        return CONFIG_HEADER.pack(offset, size, flags) + data + bytes(size - len(data))

    def _get_shmem_config(self, msg: Message) -> bytes:
        sizes = [0] * MAX_SHMEM_REGIONS
        sizes[VIRTIO_GPU_SHM_ID_HOST_VISIBLE] = self.device.shm_size
        self.shmem_config_sent = True
        log.info(
            "%s: host-visible region %d: %d bytes", self.name, VIRTIO_GPU_SHM_ID_HOST_VISIBLE, self.device.shm_size
        )
        return struct.pack(f"<II{MAX_SHMEM_REGIONS}Q", 1, 0, *sizes)

    # --- the queue thread -------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass  # full: a wake-up is pending anyway; closed: the session is over

    def _serve_queues(self) -> None:
        try:
            for vq in self.queues:
                self._serve(vq)
            while not self._stopping:
                kicks: List[Tuple[int, Virtqueue]] = []
                for vq in self.queues:
                    with vq.lock:
                        if vq.kick_fd is not None:
                            kicks.append((vq.kick_fd, vq))
                # poll, not select: a descriptor numbered past FD_SETSIZE (1024; a guest's blobs
                # hold two each) is refused by select, and the queues would stop for good.
                poller = select.poll()
                for fd in [self._wake_r] + [fd for fd, _ in kicks]:
                    poller.register(fd, select.POLLIN)
                ready = {fd for fd, _ in poller.poll()}
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except OSError:
                        pass
                for fd, vq in kicks:
                    if fd in ready and not _read_kick(fd):
                        # Ready and yet no kick (a pipe whose writer is gone, a file at its
                        # end): polled again it would spin this thread for the session's life.
                        log.warning("%s: queue %d: kick descriptor gives no kicks; dropped", self.name, vq.index)
                        vq.drop_kick(fd)
                for vq in self.queues:
                    vq.close_retired()
                if self._stopping:
                    return
                for vq in self.queues:  # a wake-up may stand for a kick missed while set up
                    self._serve(vq)
        except Exception:  # noqa: BLE001 - the session goes on; its teardown frees everything
            log.exception("%s: queue thread failed", self.name)

    def _serve(self, vq: Virtqueue) -> None:
        while not self._stopping:
            if self._reset_pending:
                self._reset_pending = False
                self.device.reset(self.backend_timeout_s)
            try:
                chain = vq.pop()
            except QueueError as exc:
                log.warning("%s: %s", self.name, exc)
                if exc.chain is not None:
                    vq.complete(exc.chain, response(NO_HEADER, VirtioGpuCtrlType.RESP_ERR_UNSPEC))
                    continue
                return
            if chain is None:
                return
            if vq.index == CURSOR_QUEUE:
                vq.push(chain, 0)  # no cursor plane: consumed, nothing to answer
                continue
            try:
                request = vq.read_request(chain, MAX_CONTROL_CHAIN)
            except GuestMemoryError as exc:
                log.warning("%s: control request unreadable: %s", self.name, exc)
                vq.complete(chain, response(NO_HEADER, VirtioGpuCtrlType.RESP_ERR_INVALID_PARAMETER))
                continue
            self.device.handle(request, _reply_to(vq, chain))


def _read_kick(fd: int) -> bool:
    """Consumes a kick; False when the descriptor is ready but can give none (end of file, an
    error other than having nothing to read)."""
    try:
        return bool(os.read(fd, 8))
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False


def _reply_to(vq: Virtqueue, chain: Chain) -> Send:
    """`send(data)` for the control command in `chain`: its response, written back on `vq`."""

    def send(data: bytes) -> None:
        vq.complete(chain, data)

    return send


def _u64(msg: Message) -> int:
    if len(msg.payload) < U64.size:
        raise _Refused(f"request {msg.request}: {len(msg.payload)}-byte payload, expected a u64")
    return U64.unpack_from(msg.payload)[0]


def _request_name(request: int) -> str:
    try:
        return Request(request).name
    except ValueError:
        return f"request {request}"
