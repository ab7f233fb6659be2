"""Which ggml version has what: the one table of version-dependent facts.

Theory of operation: most of what differs between ggml builds is read from the build itself
(enums and sizes from its headers, `apir.ggml.header`; type traits from the library). What
cannot be read is written here, once:

- `SERIES`: the ggml API series apir knows (releases whose public API and backend ABI are the
  same: every 0.20.x is "0.20"), with the APIR protocol version that series' C guest
  (ggml-virtgpu) speaks and its GGML_BACKEND_API_VERSION. The guest ABI tables
  (apir.guest.backend.abi) are keyed by series, so a patch release needs no change.
- `SINCE`: behaviour of ggml's CPU kernels the host's shape rules (apir.host.graph.shapes) depend
  on, by the first ggml version that has it (`Feature`). A rule asks
  `Feature.X in enums.features`, never compares versions itself.

Adding a ggml version: add its series to `SERIES` (and its backend structs to
apir.guest.backend.abi if they changed); add a `Feature` for each kernel change a rule must
follow, with the version in `SINCE`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Dict, FrozenSet, Tuple

from apir.codec.constants import APIR_PROTOCOL_0_1, APIR_PROTOCOL_0_2

__all__ = ["Version", "Series", "SERIES", "Feature", "SINCE", "parse_version", "series_name", "features_of"]

Version = Tuple[int, int, int]  # (major, minor, patch) of ggml_version()


@dataclass(frozen=True)
class Series:
    """One ggml API series: `name` "MAJOR.MINOR"; `apir_protocol` the APIR (major, minor) its
    C guest speaks (shapes device_get_props, apir.codec.forward);
    `backend_api_version` its GGML_BACKEND_API_VERSION (ggml-backend-impl.h)."""

    name: str
    apir_protocol: Tuple[int, int]
    backend_api_version: int


SERIES: Dict[str, Series] = {
    "0.10": Series("0.10", APIR_PROTOCOL_0_1, 2),
    "0.20": Series("0.20", APIR_PROTOCOL_0_2, 2),
    "0.25": Series("0.25", APIR_PROTOCOL_0_2, 2),  # llama.cpp's (llama-cpp-python 0.3.36), docs/llama.md
}


class Feature(enum.Enum):
    """A change in ggml's CPU kernels that a host shape rule follows; the value says what."""

    NORM_STRIDED_ROWS = "norm and l2_norm read each element at i00 * nb[0] (rows of any strides)"
    CONCAT_QUANTIZED = "concat walks quantized rows block by block"
    FILL_F16 = "fill has an F16 kernel (before: writes F32 whatever the result type)"
    CONV_F16_KERNELS = "conv kernels read F16 (and BF16) kernels; im2col's F16 result from any src0"
    MUL_MAT_HINT = "mul_mat reads op_params[1] as a hint (GGML_HINT_SRC0_IS_HADAMARD)"
    OUT_PROD_F16 = "out_prod takes F16 src0"
    SET_ROWS_F16 = "set_rows takes F16 rows"
    SSM_SCAN_SNAPSHOTS = "ssm_scan keeps K state snapshots (op_params[0])"
    GATED_DELTA_NET_SNAPSHOTS = "gated_delta_net keeps K snapshot slots (op_params[0]) and a 4d state"
    ROPE_OFFSET = "rope rotates n_dims channels from n_offs (op_params[15])"
    BF16_KERNELS = "BF16 kernels of GELU, GELU_ERF, GELU_QUICK, SILU, the GLUs but SWIGLU_OAI / _CLAMP, SCALE"
    CONCAT_ROWS = "concat of a type without its own kernel copies whole rows (asserts rows contiguous)"
    MUL_MAT_WIDEN = "mul_mat widens F16 / BF16 src1 for an F32 vec_dot_type; fwht reads F16 rows"
    TILED_MATMUL = "the tiled matmul reads a vec_dot_type src1's rows as r * nb[1] (K-quant / IQ src0)"
    HC_GATED = "dsv4_hc_pre takes a gate (op_params[1]); dsv4_hc_post's comb is optional"


# Feature -> the first ggml version that has it.
SINCE: Dict[Feature, Version] = {
    Feature.NORM_STRIDED_ROWS: (0, 20, 0),
    Feature.CONCAT_QUANTIZED: (0, 20, 0),
    Feature.FILL_F16: (0, 20, 0),
    Feature.CONV_F16_KERNELS: (0, 20, 0),
    Feature.MUL_MAT_HINT: (0, 20, 0),
    Feature.OUT_PROD_F16: (0, 20, 0),
    Feature.SET_ROWS_F16: (0, 20, 0),
    Feature.SSM_SCAN_SNAPSHOTS: (0, 20, 0),
    Feature.GATED_DELTA_NET_SNAPSHOTS: (0, 20, 0),
    Feature.ROPE_OFFSET: (0, 25, 0),
    Feature.BF16_KERNELS: (0, 25, 0),
    Feature.CONCAT_ROWS: (0, 25, 0),
    Feature.MUL_MAT_WIDEN: (0, 25, 0),
    Feature.TILED_MATMUL: (0, 25, 0),
    Feature.HC_GATED: (0, 25, 0),
}


def parse_version(text: str) -> Version:
    """`ggml_version()`'s string ("0.20.2", "0.10.1-dirty") as (0, 20, 2); missing parts are 0."""
    major, minor, patch = ([int(x) for x in re.findall(r"\d+", text)[:3]] + [0, 0, 0])[:3]
    return major, minor, patch


def series_name(version: Version) -> str:
    """The API series of `version`: "MAJOR.MINOR" ("0.20" for 0.20.2)."""
    return f"{version[0]}.{version[1]}"


def features_of(version: Version) -> FrozenSet[Feature]:
    """The features ggml `version` has."""
    return frozenset(f for f, since in SINCE.items() if tuple(version) >= since)
