"""Fence order: fenced responses leave in fence order on each timeline.

Theory of operation: the guest kernel treats the response to a fenced command as that fence
signalled, and every earlier fence of the same timeline with it (linux virtio_gpu's
`virtio_gpu_fence_event_process`). Commands run on several threads here (a context's SUBMIT_3D
on its worker, everything else at once), so a later fenced command can finish first. Each
fenced command takes a `ticket` on its timeline when it is read off the queue; `finish(ticket,
send)` sends its response once every earlier ticket of that timeline has been sent (earlier
ones waiting are sent first). Unfenced commands send at once.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Deque, Dict, Hashable, Optional

__all__ = ["FenceOrder", "Ticket"]


class Ticket:
    __slots__ = ("timeline", "send")

    def __init__(self, timeline: Hashable):
        self.timeline = timeline
        self.send: Optional[Callable[[], None]] = None


class FenceOrder:
    """Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: Dict[Hashable, Deque[Ticket]] = {}

    def ticket(self, timeline: Hashable) -> Ticket:
        t = Ticket(timeline)
        with self._lock:
            self._queues.setdefault(timeline, collections.deque()).append(t)
        return t

    def finish(self, ticket: Optional[Ticket], send: Callable[[], None]) -> None:
        """Sends now (no ticket), or when `ticket` reaches the front of its timeline."""
        if ticket is None:
            send()
            return
        # Sent under the lock: two threads each sending what they took could swap the order.
        # A send is a few bytes into the used ring and an eventfd write.
        with self._lock:
            ticket.send = send
            queue = self._queues[ticket.timeline]
            while queue and queue[0].send is not None:
                fn = queue.popleft().send
                assert fn is not None
                fn()
            if not queue:
                del self._queues[ticket.timeline]

    @property
    def waiting(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())
