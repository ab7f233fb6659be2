"""The backend devices (`ggml_backend_device`), twin of the C guest's ggml-backend-device.cpp.

Theory of operation: one device struct per remote device, all sharing one iface whose
callbacks find their device by the struct's address. Names, description, type and memory
come from the registry's cache (`RemoteInfo`). As in the C:

- `supports_op` answers true without asking the host (the C's USE_ALWAYS_TRUE_SUPPORTS_OP,
  since the host checks each graph anyway); `ApirBackend(remote_supports_op=True)` asks the
  host with `device_supports_op` instead.
- `get_props` reports buffer_from_host_ptr as false whatever the host says, and async and
  events true exactly when the ASYNC extension was agreed (then event_new / event_free are
  the host's, ggml_backend_event structs owned here, and event_synchronize, like the stream's
  record and wait, sends nothing: see stream.py). The zero-copy path the host may offer is
  used inside `alloc_buffer` (see buffer_type.py), not here.
- `supports_buft` accepts exactly the buffer types whose device is this device.
- `buffer_from_host_ptr` stays NULL. (The C fills it with a function that asks the host for a
  new shared blob but then uses the caller's pointer as base, so the two sides see different
  memory; ggml never calls it since the capability is reported false.)
"""

from __future__ import annotations

import ctypes

from apir.guest.backend.buffer import tensor_field

__all__ = ["build_device_iface", "build_device"]


def build_device_iface(owner):
    """The `ggml_backend_device_i` shared by `owner`'s devices."""
    abi, cb, info = owner.abi, owner.callbacks, owner.info
    name = cb.cstring(info.name)
    description = cb.cstring(info.description)

    def get_memory(dev, free_ptr, total_ptr):
        ctypes.c_size_t.from_address(free_ptr).value = info.memory_free
        ctypes.c_size_t.from_address(total_ptr).value = info.memory_total

    def get_props(dev, props_ptr):
        props = abi.DevProps.from_address(props_ptr)
        props.name = name
        props.description = description
        props.memory_free = info.memory_free
        props.memory_total = info.memory_total
        props.type = info.type
        props.device_id = None
        caps = props.caps
        caps.host_buffer = bool(info.props.host_buffer)
        setattr(caps, "async", posting)  # a keyword in Python; see the module docstring
        caps.buffer_from_host_ptr = False
        caps.events = posting
        if "mmap_support" in dict(type(caps)._fields_):
            caps.mmap_support = bool(getattr(info.props, "mmap_support", False))

    def supports_op(dev, op):
        if not owner.remote_supports_op:
            return True
        buf = tensor_field(owner.g, op, "buffer")
        handle = owner.buffer(buf).host_handle if buf and owner.has_buffer(buf) else 0
        return bool(owner.client.device_supports_op(op, buffer_handle=handle))

    def supports_buft(dev, buft):
        return abi.BufferType.from_address(buft).device == dev

    posting = bool(getattr(owner.client, "posting", False))
    impls = {
        "get_name": (lambda dev: name, None),
        "get_description": (lambda dev: description, None),
        "get_memory": (get_memory, None),
        "get_type": (lambda dev: info.type, 0),
        "get_props": (get_props, None),
        "init_backend": (lambda dev, params: owner.init_backend(dev), None),
        "get_buffer_type": (lambda dev: owner.device_record(dev).buffer_type_ptr, None),
        "supports_op": (supports_op, False),
        "supports_buft": (supports_buft, False),
        "offload_op": (lambda dev, op: False, False),
    }
    if posting:
        impls.update(_event_impls(owner))
    return cb.iface(abi.DeviceI, abi.protos["ggml_backend_device_i"], impls, "device")


def _event_impls(owner):
    """event_new / event_free / event_synchronize over the host's events (ASYNC)."""
    client, events = owner.client, {}  # event struct address -> struct, while not freed

    def event_new(dev):
        event = owner.abi.Event(device=dev, context=client.event_new())
        address = ctypes.addressof(event)
        events[address] = event
        return address

    def event_free(dev, event):
        struct = events.pop(event)
        client.event_free(struct.context)

    def event_synchronize(dev, event):
        pass  # (in order, and every compute and read waited for: nothing to wait for)

    return {
        "event_new": (event_new, None),
        "event_free": (event_free, None),
        "event_synchronize": (event_synchronize, None),
    }


def build_device(owner, iface, reg_ptr: int):
    """A `ggml_backend_device` struct (Python-owned, never freed by ggml)."""
    return owner.callbacks.keep(owner.abi.Device(iface=iface, reg=reg_ptr, context=None))
