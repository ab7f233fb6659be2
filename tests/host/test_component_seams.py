"""apir.host.component.seams: `conforms` answers as isinstance does for the optional parts a
transport checks, for contexts that have them and stand-ins that do not."""

from typing import Optional

from apir.host.component.context import HostContext
from apir.host.component.seams import BoundedInTime, BufferCounting, Cancellable, DeferredNotification, conforms


class _StandIn:
    """An ApirContext with none of the optional parts."""

    def add_resource(self, res_id, memory):
        pass

    def remove_resource(self, res_id):
        pass

    def submit(self, command):
        pass

    def close(self):
        pass


class _Counting(_StandIn):
    def buffer_count(self) -> Optional[int]:
        return 3


def test_conforms_answers_as_isinstance():
    host = HostContext(ctx_id=1)
    try:
        contexts = [host, _StandIn(), _Counting()]
        for protocol in (BoundedInTime, BufferCounting, Cancellable, DeferredNotification):
            for ctx in contexts:
                assert conforms(ctx, protocol) is isinstance(ctx, protocol), (type(ctx).__name__, protocol)
        assert all(conforms(host, p) for p in (BoundedInTime, BufferCounting, Cancellable, DeferredNotification))
        assert conforms(_Counting(), BufferCounting) and not conforms(_StandIn(), BufferCounting)
        # asked again, of another instance of the same class: the same answer
        assert not conforms(_StandIn(), Cancellable)
    finally:
        host.close()
