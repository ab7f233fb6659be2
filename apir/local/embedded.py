"""`EmbeddedDevice`: the virtgpu device interface with the host inside this process.

Theory of operation: the same kernel-plus-hypervisor stand-in as the socket server
(apir.host.local.kernel.KernelContext, one HostContext and one shared memory file) runs in this
process. A "host thread" of its own serves device calls as jobs handed over through a
`queue.SimpleQueue`; calls other than execbuffer wait for their job (up to `io_timeout_s`).
Blobs need no fd: the guest's `Blob.memory` is the host's own mapping. This is the default
device, spec ``embedded`` (apir.devices.open_device).

Inline runs: a waited-for execbuffer of a command whose host run time is bounded (its header,
`apir.host.component.context.may_run_long`, and a ggml-cpu backend,
`HostContext.commands_bounded_in_time`) runs in the caller's thread, as virglrenderer runs
submit_cmd inside virgl_renderer_submit_cmd, with no hand-over between threads; only under the
device's lock while no job is queued or running, so commands keep their order. The others run
on the host thread, so the guest's wait keeps its timeout and `close` can cancel a compute.
The host thread spins without the GIL on a doorbell word the guest rings, and stores deferred
reply notifications from that spin; nobody spins on a busy machine (apir.local.spin_policy).
docs/local-transport.md, "Embedded mode", gives the words, their stores and their order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Tuple, cast

import numpy as np

from apir.codec.atomics import Word, spins_for
from apir.codec.virtgpu import (
    VIRTGPU_BLOB_FLAG_USE_MAPPABLE,
    VIRTGPU_BLOB_MEM_HOST3D,
    VIRTGPU_EXECBUF_RING_IDX,
    IoctlName,
)
from apir.guest.device import Blob
from apir.guest.errors import DeviceError, IoctlError
from apir.local.spin_policy import spinning_pays
from apir.host.component.context import may_run_long
from apir.host.component.seams import ApirContext, BoundedInTime, ContextFactory, DeferredNotification, conforms
from apir.host.local.kernel import KernelContext, KernelError, default_context_factory

__all__ = ["EmbeddedDevice"]

log = logging.getLogger(__name__)

_STOP = object()
_SETTLE_S = 10e-6
_ALIVE_CHECK_S = 0.05  # a blocked device call looks whether the host thread still lives this often


class _Job:
    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn: Callable, args: tuple, wait: bool):
        self.fn = fn
        self.args = args
        self.done: Optional[threading.Lock] = None
        if wait:
            self.done = threading.Lock()
            self.done.acquire()
        self.result: Any = None
        self.error: Optional[BaseException] = None


class _ContextSeams:
    """What the device asks of the kernel's context on every command, worked out once per
    context: `bounded`, the context as BoundedInTime if it is one; `deferring`, as
    DeferredNotification if it is one."""

    __slots__ = ("ctx", "bounded", "deferring")

    def __init__(self, ctx: Optional[ApirContext]):
        self.ctx = ctx
        self.bounded = cast(BoundedInTime, ctx) if conforms(ctx, BoundedInTime) else None
        self.deferring = cast(DeferredNotification, ctx) if conforms(ctx, DeferredNotification) else None

    def take_notification(self) -> Optional[Tuple[Word, int]]:
        """The reply notification (Word, value) the context deferred for the command it just
        served (`HostContext.take_notification`), or None (none deferred, or a context
        factory's context without deferral)."""
        return self.deferring.take_notification() if self.deferring is not None else None


class EmbeddedDevice:
    """A virtgpu device whose host (a HostContext) runs in this process: on a thread of its
    own, and the bounded commands of a waited-for execbuffer in the caller's thread (see the
    module).

    `config` is the HostContext configuration (``ggml.library.path``, ``ggml.library.reg``,
    ...); `context_factory(ctx_id, capset_id, config)` builds the context (default:
    `apir.host.component.context.HostContext`). Errors: `IoctlError` for a refused call (the errno the
    kernel would set), `DeviceError` when the device is closed, the host thread is gone or does
    not answer within `io_timeout_s`. `exec_wait_s`: how long execbuffer waits for a command the
    host thread runs (0: never waits, and every command goes to the host thread). `host_spin_s`:
    how long the host thread spins on the doorbell after a job before it blocks (a core busy
    that long after each job; 0 never spins).
    """

    node = name = "embedded"

    def __init__(
        self,
        config: Optional[dict] = None,
        context_factory: ContextFactory = default_context_factory,
        io_timeout_s: float = 60.0,
        exec_wait_s: float = 1.0,
        max_bytes: int = 1 << 36,
        host_spin_s: float = 200e-6,
    ):
        self.io_timeout_s = io_timeout_s
        self.exec_wait_s = exec_wait_s
        self._host_spins = spins_for(host_spin_s) if host_spin_s > 0 else 0
        # a ring of 2 (execbuffer that returns at once) makes the host thread wait this long
        # more without the GIL, so the guest, which still needs the GIL to get to its own
        # wait, does not find it taken and sleep on it
        self._settle_spins = spins_for(_SETTLE_S)
        # the doorbell: non-zero once a job was queued since the host thread last looked
        self._bell = Word(np.zeros(1, dtype=np.uint32).view(np.uint8), 0)
        # non-zero once a waited-for job is done (after its lock is released): execbuffer
        # spins on it for up to `host_spin_s` before it blocks on the job's lock
        self._done = Word(np.zeros(1, dtype=np.uint32).view(np.uint8), 0)
        # how many jobs the host thread has finished (mod 2**32), stored by it alone after the
        # job's other stores; an inline run needs it equal to `_queued`
        self._finished = Word(np.zeros(1, dtype=np.uint32).view(np.uint8), 0)
        self._queued = 0  # how many jobs were queued (mod 2**32), under `_lock`
        # the last value of `_finished` an inline run read (acquire), under `_lock`: while it
        # equals `_queued`, the word need not be read again (it can only grow up to `_queued`)
        self._finished_seen = 0
        self._host_gone = False  # set as the host thread ends, however it ends
        # taken to queue a job and for an inline run: none is queued while one runs
        self._lock = threading.Lock()
        self.kernel = KernelContext("embedded", config, context_factory, max_bytes)
        self._seams = _ContextSeams(None)  # of the kernel's context: see `_context_seams`
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._blobs: dict[int, Blob] = {}  # by bo_handle: the blobs not destroyed yet
        self._closed = False
        self._thread = threading.Thread(target=self._host_main, name="apir-embedded-host", daemon=True)
        self._thread.start()

    # --- the host thread -----------------------------------------------------------------
    def _host_main(self) -> None:
        try:
            self._host_loop()
        finally:
            self._host_gone = True  # a plain flag: is_alive would cost every inline run a call

    def _host_loop(self) -> None:
        jobs, kernel = self._jobs, self.kernel
        # (Word, value) stores not done yet, in order: a reply notification and the count of
        # finished jobs (a job nobody waits for), or the done word, deferred to the doorbell
        # spin (or made before the next job, if one is queued)
        pending: list = []
        finished = 0
        while True:
            if jobs.empty() and self._spin_for_bell(pending):
                continue  # rung: the job is in the queue (or it was taken already)
            job = jobs.get()
            for word, value in pending:
                word.store_release(value)
            pending.clear()
            if job is _STOP:
                break
            try:
                job.result = job.fn(*job.args)
            except BaseException as exc:  # delivered to the waiter, or logged when none waits
                job.error = exc
                if job.done is None:
                    if isinstance(exc, KernelError):
                        log.warning("embedded host: %s", exc)
                    else:
                        log.exception("embedded host: job failed")
            if job.fn == kernel.submit:  # (bound methods: equal, not identical)
                note = self._context_seams().take_notification()
                if note is not None:
                    pending.append(note)
                note = None  # its Word pins the reply mapping: a later GEM_CLOSE must unmap it
            finished = (finished + 1) & 0xFFFFFFFF
            pending.append((self._finished, finished))  # after the reply's store (see _run_inline)
            if job.done is not None:
                # a waiter watches the done word or the job's lock, not the reply word: the
                # stores so far are made now, so the waiter's next call sees this job finished
                for word, value in pending:
                    word.store_release(value)
                pending.clear()
                job.done.release()
                pending.append((self._done, 1))  # for a waiter spinning on it (see _run)
        try:
            self.kernel.close()
        except Exception:
            log.exception("embedded host: close failed")

    def _spin_for_bell(self, pending: list) -> int:
        """Makes the `pending` stores (clearing the list), then spins up to `host_spin_s` on
        the doorbell without the GIL, all in one call; the ring seen (then reset), or 0."""
        bell = self._bell
        spins = self._host_spins if spinning_pays() else 0  # block at once on a busy machine
        if not pending:
            rung = bell.spin_until_nonzero(spins) if spins else 0
            if rung:
                bell.store_release(0)
            return rung
        before = pending[0] if len(pending) > 1 else None  # (two at most: see _host_loop)
        word, value = pending[-1]
        pending.clear()
        return word.store_release_then_spin(value, bell, spins, before=before, clear=True, settle=self._settle_spins)

    def _context_init(self, capset_id: int, num_rings: int) -> None:
        """CONTEXT_INIT on the host thread; the context defers its reply notifications to the
        host loop when it can (HostContext.defer_notification)."""
        self.kernel.context_init(capset_id, num_rings)
        ctx = self.kernel.ctx
        if isinstance(ctx, DeferredNotification):
            ctx.defer_notification = True

    def _run(
        self,
        request: str,
        fn: Callable,
        *args,
        wait: bool = True,
        wait_s: Optional[float] = None,
        late_ok: bool = False,
        spin: bool = False,
    ):
        if self._closed:
            raise DeviceError("embedded: device is closed")
        if not self._thread.is_alive():
            raise DeviceError("embedded: the host thread is gone")
        job = _Job(fn, args, wait)
        spin = spin and wait and self._host_spins > 0 and spinning_pays()
        if spin:
            self._done.store_release(0)
        self._take_lock(request)  # (not while an inline run uses the context)
        try:
            self._queued = (self._queued + 1) & 0xFFFFFFFF
            self._jobs.put(job)
        finally:
            self._lock.release()
        if spin:
            # ring, then spin on the done word, in one call without the GIL: the host thread
            # that answers the ring finds the GIL free (a ring taken back with the GIL held
            # would put it to sleep on the GIL); a hint only, the job's lock says done
            self._bell.store_release_then_spin(1, self._done, self._host_spins)
        else:
            # after the put: the host thread finds the job when rung; 2 when this thread
            # goes on to wait on its own, spinning (the host thread settles first, see above)
            self._bell.store_release(1 if wait else 2)
        if job.done is None:  # not wait: nobody waits for the result
            return None
        limit = self.io_timeout_s if wait_s is None else wait_s
        if not self._acquire_while_alive(job.done, limit):
            if late_ok:
                return None  # still running: the caller learns the outcome some other way
            raise DeviceError(f"embedded: {request} got no answer from the host thread within {limit:g} s")
        if job.error is not None:
            if isinstance(job.error, KernelError):
                raise IoctlError(self.node, request, job.error.err, str(job.error)) from None
            raise DeviceError(f"embedded: {request} failed in the host: {job.error!r}") from job.error
        return job.result

    def _acquire_while_alive(self, done: threading.Lock, limit_s: float) -> bool:
        """`done.acquire(timeout=limit_s)`, in slices of _ALIVE_CHECK_S between which a dead
        host thread (which will never release it) raises DeviceError at once: that the device
        was closed, when it was (the host thread then stops on purpose), else that the host
        thread is gone. A job the host thread finished just before it stopped counts as done."""
        deadline = time.monotonic() + limit_s
        while not done.acquire(timeout=min(_ALIVE_CHECK_S, max(0.0, deadline - time.monotonic()))):
            if not self._thread.is_alive():
                if done.acquire(blocking=False):  # (it finished the job, then stopped)
                    return True
                if self._closed:
                    raise DeviceError("embedded: the device was closed during the call")
                raise DeviceError("embedded: the host thread is gone")
            if time.monotonic() >= deadline:
                return False
        return True

    def _context_seams(self) -> _ContextSeams:
        seams = self._seams
        if seams.ctx is not self.kernel.ctx:  # (a new context, or the first)
            seams = self._seams = _ContextSeams(self.kernel.ctx)
        return seams

    def _take_lock(self, request: str) -> None:
        """Takes the device's lock, which an inline run in another thread holds for the run's
        length, bounded by no one (a backend call that hangs): DeviceError after
        `io_timeout_s`, as for a host-thread job that does not answer."""
        if self._lock.acquire(False):  # (the usual case, without a timed wait)
            return
        limit = self.io_timeout_s
        if not self._lock.acquire(timeout=min(max(limit, 0.0), threading.TIMEOUT_MAX)):
            raise DeviceError(f"embedded: {request}: a command running inline did not end within {limit:g} s")

    def _run_inline(self, command: bytes) -> bool:
        """Runs the EXECBUFFER payload `command` in this thread if its header says it is
        bounded (`may_run_long`), the context's backend bounds it in time too
        (`HostContext.commands_bounded_in_time`: ggml-cpu's) and no job is queued or running;
        True then, once the reply notification is stored. False when it must go to the host
        thread. IoctlError for a KernelError (its errno), DeviceError (logged) for any other
        failure, or when the device is closed or the host thread gone."""
        if may_run_long(command, self.kernel.capset_id):
            return False
        seams = self._seams
        if seams.ctx is not self.kernel.ctx:
            seams = self._context_seams()
        if seams.bounded is not None and not seams.bounded.commands_bounded_in_time:
            return False  # a GPU's or ggml-rpc's copies may never end: the guest's wait has a limit
        if self._closed:  # (before the lock: a closing device may have given up on it)
            raise DeviceError("embedded: device is closed")
        self._take_lock(IoctlName.EXECBUFFER)
        try:
            if self._closed:
                raise DeviceError("embedded: device is closed")
            if self._host_gone:
                raise DeviceError("embedded: the host thread is gone")
            if self._finished_seen != self._queued:
                self._finished_seen = self._finished.load_acquire()
                if self._finished_seen != self._queued:
                    return False  # behind the jobs queued before it, on the host thread
            kernel, error = self.kernel, None
            try:
                try:
                    kernel.submit(command)
                except Exception as exc:  # its reply notification, if any, is still stored
                    error = exc
                note = seams.deferring.take_notification() if seams.deferring is not None else None
                if note is not None:
                    note[0].store_release(note[1])
                note = None  # its Word pins the reply mapping: a later GEM_CLOSE must unmap it
            except Exception as exc:
                error = error or exc
        finally:
            self._lock.release()
        if error is None:
            return True
        if isinstance(error, KernelError):
            raise IoctlError(self.node, IoctlName.EXECBUFFER, error.err, str(error)) from None
        log.error("embedded: EXECBUFFER failed in the host", exc_info=error)
        raise DeviceError(f"embedded: {IoctlName.EXECBUFFER} failed in the host: {error!r}") from error

    def watch(self, timeout_s: float) -> None:
        """For a caller waiting on a reply notification word (apir.guest.remote): sleeps
        `timeout_s`, then raises DeviceError if the device was closed meanwhile (its blobs,
        the reply's among them, are freed) or the host thread is gone (it died: no reply will
        ever come)."""
        time.sleep(max(0.0, timeout_s))
        if self._closed:
            raise DeviceError("embedded: the device was closed during the call")
        if not self._thread.is_alive():
            raise DeviceError("embedded: the host thread is gone")

    # --- VirtgpuDevice -------------------------------------------------------------------
    def get_param(self, param: int) -> int:
        """DRM_IOCTL_VIRTGPU_GETPARAM; 0 for an unknown param."""
        try:
            return self._run(IoctlName.GETPARAM, self.kernel.get_param, param)
        except IoctlError:
            return 0

    def get_caps(self, capset_id: int, size: int) -> bytes:
        """DRM_IOCTL_VIRTGPU_GET_CAPS, version 0: up to `size` bytes."""
        return self._run(IoctlName.GET_CAPS, self.kernel.get_caps, capset_id, 0, size)

    def context_init(self, capset_id: int, num_rings: int = 1) -> None:
        """DRM_IOCTL_VIRTGPU_CONTEXT_INIT: creates the HostContext on the host thread."""
        self._run(IoctlName.CONTEXT_INIT, self._context_init, capset_id, num_rings)

    def create_blob(self, size: int) -> Blob:
        """RESOURCE_CREATE_BLOB (HOST3D, MAPPABLE); the Blob's memory is the host's mapping."""
        res_id, bo_handle, host_blob = self._run(
            IoctlName.RESOURCE_CREATE_BLOB,
            self.kernel.create_blob,
            VIRTGPU_BLOB_MEM_HOST3D,
            VIRTGPU_BLOB_FLAG_USE_MAPPABLE,
            size,
            0,
        )
        blob = Blob(res_id=res_id, bo_handle=bo_handle, size=host_blob.size, memory=host_blob.memory)
        self._blobs[bo_handle] = blob
        return blob

    def destroy_blob(self, blob: Blob) -> None:
        """DRM_IOCTL_GEM_CLOSE: the host drops the resource and unmaps it."""
        self._run(IoctlName.GEM_CLOSE, self.kernel.gem_close, blob.bo_handle)
        self._blobs.pop(blob.bo_handle, None)

    @property
    def blobs(self) -> dict[int, Blob]:
        """The live blobs this device created and has not destroyed, by res_id (a snapshot)."""
        return {b.res_id: b for b in list(self._blobs.values())}

    def execbuffer(self, payload, ring_idx: int = 0) -> None:
        """DRM_IOCTL_VIRTGPU_EXECBUFFER of the APIR command `payload` (bytes-like, copied).

        With `exec_wait_s` > 0: a command whose host run time its payload bounds (all but
        LoadLibrary and Forward backend_graph_compute, `apir.host.component.context.may_run_long`, on
        ggml-cpu: `HostContext.commands_bounded_in_time`) runs in this thread, once no job is
        queued or running on the host thread, and its
        reply notification is stored when this returns. Others are queued for the host
        thread, and this returns once they ran or after `exec_wait_s`, whichever is first
        (spinning up to `host_spin_s` without the GIL, then blocking; a long graph compute
        simply goes on, and the caller waits on the reply notification with its own timeout,
        as over a kernel). With `exec_wait_s` 0, every command is queued and this returns at
        once. Flag and ring checks happen here, as in the ioctl: IoctlError(EINVAL); a
        command that fails in the host: IoctlError (EIO, the kernel stand-in's errno) or
        DeviceError; DeviceError when the device is closed or the host thread is gone."""
        self._submit(payload, ring_idx, self.exec_wait_s > 0)

    def execbuffer_nowait(self, payload, ring_idx: int = 0) -> None:
        """DRM_IOCTL_VIRTGPU_EXECBUFFER that returns once the command is queued (as with
        `exec_wait_s` 0), for a caller with work of its own before it waits on the reply
        word (apir.guest.remote's `meanwhile`); checks and errors as `execbuffer`'s."""
        self._submit(payload, ring_idx, False)

    def _submit(self, payload, ring_idx: int, wait: bool) -> None:
        command = bytes(payload)  # the ioctl copies: the caller may reuse its buffer at once
        try:
            self.kernel.check_execbuffer(VIRTGPU_EXECBUF_RING_IDX, ring_idx, len(command))
        except KernelError as exc:
            raise IoctlError(self.node, IoctlName.EXECBUFFER, exc.err, str(exc)) from None
        if wait and self._run_inline(command):
            return
        self._run(
            IoctlName.EXECBUFFER,
            self.kernel.submit,
            command,
            wait=wait,
            wait_s=self.exec_wait_s if wait else None,
            late_ok=True,
            spin=True,
        )

    def stats(self) -> dict:
        """This device's counts, as the socket host's STAT: contexts, blobs, blob_bytes,
        file_bytes, ggml_buffers (-1 when the HostContext cannot count them)."""

        def count():
            k = self.kernel
            n = k.ggml_buffers
            return {
                "contexts": int(k.ctx is not None and not k.closed),
                "blobs": k.memfile.blob_count,
                "blob_bytes": k.memfile.blob_bytes,
                "file_bytes": k.memfile.file_size,
                "ggml_buffers": -1 if n is None else n,
            }

        return self._run("STAT", count)

    def close(self) -> None:
        """Stops the host thread, which closes the context and frees every blob. A graph
        still computing there is cancelled first (it stops after its current node); a
        command running inline in another thread ends first (waited for up to
        `io_timeout_s`)."""
        if self._closed:
            return
        self._closed = True
        self.kernel.cancel_compute("the embedded device is closed")
        self._blobs.clear()  # the host thread frees them all as it stops
        # after an inline run in another thread (a bounded command) ends: no other starts now
        locked = self._lock.acquire(timeout=self.io_timeout_s)
        if not locked:
            log.warning("embedded: an inline command did not end within %g s", self.io_timeout_s)
        try:
            self._jobs.put(_STOP)
        finally:
            if locked:
                self._lock.release()
        self._bell.store_release(1)
        self._thread.join(self.io_timeout_s)
        if self._thread.is_alive():
            log.warning("embedded: the host thread did not stop within %g s", self.io_timeout_s)

    def __enter__(self) -> "EmbeddedDevice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
