"""Handles and virtual base addresses (apir.host.handles) are per context: what one guest sees
says nothing of what another did."""

from apir.host import HostContext
from tests.host.hostkit import Guest


def test_two_guests_interleaving_allocations_see_independent_handles_and_bases(ggml):
    guests = [Guest(HostContext(70)), Guest(HostContext(71))]
    seen: list[list[tuple[int, int]]] = [[], []]
    try:
        for step in range(6):
            i = 0 if step % 3 else 1  # b, a, a, b, a, a
            handle = guests[i].alloc(8192)
            seen[i].append((handle, guests[i].base(handle)))
        alone = Guest(HostContext(72))
        guests.append(alone)
        handles = [alone.alloc(8192) for _ in range(4)]
        ids = [(h, alone.base(h)) for h in handles]
    finally:
        for g in guests:
            g.close()
    assert seen == [ids, ids[:2]]  # what a guest alone on the host would have seen
