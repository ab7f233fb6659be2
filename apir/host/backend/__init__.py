"""The backend library LoadLibrary loads: `PythonBackendLibrary` over a ggml backend, the
dispatcher and its handlers by C group (`dispatch_device`, `_buffer_type`, `_buffer`,
`_backend`), buffer budgets, transfers, the compute bound, and the adapter for a backend
library written in C (`c_library`)."""
