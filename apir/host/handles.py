"""Opaque handles and virtual base addresses: what the guest holds instead of host pointers.

Theory of operation: the C host hands the guest its raw `ggml_backend_buffer_t` and
`ggml_backend_buffer_type_t` pointers and turns the guest's handles back into pointers. Here
every handle is a small id drawn from one counter per context, never reused, looked up in
that context's table; an id the table does not hold is refused. Buffer and buffer-type ids
come from the same counter, so one can never be mistaken for the other.

A buffer's base address, as `buffer_get_base` reports it, is virtual too: each buffer gets a
range of a made-up address space, aligned like the real base (the buffer type's alignment,
at least a page), with a guard page between buffers. The guest only ever subtracts that base
from its tensor pointers, so serialized `data` fields arrive as offsets into the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Generic, Iterator, Optional, Tuple, TypeVar

__all__ = ["HandleTable", "VirtualAddressSpace", "HostBuffer", "HostBufferType"]

T = TypeVar("T")

# Where the made-up address space starts: far from 0 (a null-ish base would look like an
# error to a guest) and unrelated to any real mapping of this process.
VIRTUAL_BASE_START = 1 << 40
PAGE = 4096


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


class HandleTable(Generic[T]):
    """id -> object for one context. Ids are positive, 64-bit, never 0, never reused."""

    def __init__(self, counter: "_Counter"):
        self._counter = counter
        self._items: Dict[int, T] = {}

    def sibling(self) -> "HandleTable[Any]":
        """An empty table drawing ids from the same counter (another device of the context,
        or another kind of handle: events)."""
        return HandleTable(self._counter)

    def add(self, item: T) -> int:
        handle = self._counter.next()
        self._items[handle] = item
        return handle

    def get(self, handle: int) -> Optional[T]:
        return self._items.get(handle)

    def pop(self, handle: int) -> Optional[T]:
        return self._items.pop(handle, None)

    def items(self) -> Iterator[Tuple[int, T]]:
        return iter(list(self._items.items()))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, handle: int) -> bool:
        return handle in self._items


class _Counter:
    def __init__(self, start: int = 1):
        self._next = start

    def next(self) -> int:
        value = self._next
        self._next += 1
        return value


class VirtualAddressSpace:
    """Hands out non-overlapping virtual ranges, `align`-aligned, with a guard page between."""

    def __init__(self, start: int = VIRTUAL_BASE_START):
        self._next = start

    def reserve(self, size: int, align: int) -> int:
        base = _align_up(self._next, max(align, PAGE))
        self._next = base + _align_up(max(size, 1), PAGE) + PAGE
        return base


@dataclass
class HostBufferType:
    """A buffer type this context has shown the guest (`ggml_backend_buffer_type_t`)."""

    ptr: int
    allocatable: bool  # whether the guest may call alloc_buffer on it


@dataclass
class HostBuffer:
    """A buffer this context owns (`ggml_backend_buffer_t`), with its real and virtual base.
    `res_id` is the shared-memory resource it wraps (buffer_from_ptr), else None; `charge`
    the bytes it costs the context's budget (apir.host.backend.budget)."""

    ptr: int
    base: int  # real base address: never sent to the guest
    size: int
    virtual_base: int
    buft_handle: int
    res_id: Optional[int] = None
    charge: int = 0


def new_tables() -> Tuple[HandleTable[HostBufferType], HandleTable[HostBuffer]]:
    """The buffer-type and buffer tables of one context, sharing one id counter."""
    counter = _Counter()
    return HandleTable(counter), HandleTable(counter)
