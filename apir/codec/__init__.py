"""apir.codec: the APIR wire format, shared by guest and host (imports neither).

- `constants`: command types, return codes, backend function ids, capset.
- `wire`: `Encoder` / `Decoder`, 4-byte aligned values over any buffer.
- `records`: `apir_rpc_tensor` and `ggml_tensor` as numpy structured dtypes.
- `forward`: the 23 backend functions' arguments and replies, the table both sides encode by.
- `graph`: cgraph serialization (guest) and the validating parse (host).
- `copy`: bounds-checked bulk copies.
- `atomics`: the reply notification word (acquire loads, release stores).
Each is plain Python; with `apir.accel.enabled()` its Numba twin runs (`*_accel`, `_kernels`),
loaded only then.
"""

from apir.codec.constants import *  # noqa: F401,F403 - the constants are the public surface
from apir.codec.constants import __all__ as _constants_all
from apir.codec.records import (
    GGML_TENSOR_DTYPE,
    RPC_TENSOR_DTYPE,
    GgmlLimits,
    ggml_tensor_dtype,
    rpc_tensor_dtype,
)
from apir.codec.wire import Decoder, Encoder, EncoderOverflow, align4

__all__ = list(_constants_all) + [
    "Decoder",
    "Encoder",
    "EncoderOverflow",
    "align4",
    "GgmlLimits",
    "rpc_tensor_dtype",
    "ggml_tensor_dtype",
    "RPC_TENSOR_DTYPE",
    "GGML_TENSOR_DTYPE",
]
