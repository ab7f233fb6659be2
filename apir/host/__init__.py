"""apir.host: the hypervisor half of APIR, laid out as the system it models.

- `component`: virglrenderer's APIR component (`HostContext`: resources, configuration,
  HandShake / LoadLibrary / Forward, the reply notification; the command trace; `seams`:
  what a transport needs of a context).
- `library`: the seam between the component and the backend library LoadLibrary loads;
  `backend`: the built-in one over ggml (dispatcher, handlers, budgets, transfers;
  `seams`: what a handler reads of it).
- `graph`: parse -> check -> build -> compute, with the shape rules (`graph.shapes`;
  `seams`: what the graph path reads of the library).
- `handles`, `tensors`, `resources`: the context's buffers, records checked against them,
  and the guest's shared memory, which every part above uses.
- `config`: the host's configuration keys and their defaults.
- the devices that reach a guest: `local` (the local transport's host side) and `vhost_user`.

A package imports only those below it in vhost_user > local > component > backend > graph,
and the top-level modules (tests/test_layering.py).
"""

from apir.host.component.context import COMMAND_MALFORMED, HostContext
from apir.host.library import BackendLibrary, LibraryHost, LibraryLoadError

__all__ = ["HostContext", "COMMAND_MALFORMED", "BackendLibrary", "LibraryHost", "LibraryLoadError"]
