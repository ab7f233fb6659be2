"""apir.host: the hypervisor half of APIR.

- `component`: `HostContext`, the APIR component (resources, configuration, HandShake /
  LoadLibrary / Forward, the reply notification).
- `library`: the backend library protocol LoadLibrary loads; `backend_library`: the built-in
  one over ggml, with `dispatcher` and its `dispatch_{device,buffer_type,buffer,backend}`.
- `tensors`, `graph`, `shapes`, `handles`: what keeps guest bytes from reaching ggml unchecked
  (graphs are parsed by `apir.codec.graph.parse_graph` first).
"""

from apir.host.component import COMMAND_MALFORMED, HostContext
from apir.host.library import BackendLibrary, LibraryHost, LibraryLoadError

__all__ = ["HostContext", "COMMAND_MALFORMED", "BackendLibrary", "LibraryHost", "LibraryLoadError"]
