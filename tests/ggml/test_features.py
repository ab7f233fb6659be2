"""apir.ggml.features: the one table of version-dependent facts, and the rules use only it."""

import re
from pathlib import Path

import apir
from apir.codec.constants import APIR_PROTOCOL_VERSIONS
from apir.ggml.features import SERIES, SINCE, Feature, features_of, parse_version, series_name
from apir.host.graph.shapes import op_enums

SHAPES = Path(apir.__file__).parent / "host" / "shapes"


def test_every_feature_has_a_version():
    assert set(SINCE) == set(Feature)


def test_features_by_version():
    assert features_of((0, 10, 1)) == frozenset()
    since_025 = {f for f, v in SINCE.items() if v == (0, 25, 0)}
    assert since_025 == {Feature.ROPE_OFFSET, Feature.BF16_KERNELS, Feature.CONCAT_ROWS, Feature.MUL_MAT_WIDEN,
                         Feature.TILED_MATMUL, Feature.HC_GATED}
    assert features_of((0, 20, 0)) == frozenset(Feature) - since_025
    assert features_of((0, 25, 3)) == frozenset(Feature)
    assert features_of((0, 19, 9)) == frozenset()


def test_versions_and_series():
    assert parse_version("0.20.2") == (0, 20, 2)
    assert parse_version("0.10.1-dirty") == (0, 10, 1)
    assert series_name(parse_version("0.20.7")) == "0.20"
    assert all(s.apir_protocol in APIR_PROTOCOL_VERSIONS and SERIES[k].name == k for k, s in SERIES.items())


def test_loaded_build_has_its_series_features(ggml):
    assert ggml.series in SERIES
    assert ggml.features == features_of(parse_version(ggml.version))
    assert op_enums(ggml).features == ggml.features


def test_no_rule_compares_versions():
    """Rules ask `Feature.X in enums.features`; a version constant or comparison outside
    apir.ggml.features would be a second table."""
    bad = [
        f"{p.name}:{n}"
        for p in sorted(SHAPES.glob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"enums\.version\b|_SINCE\b|[<>]=?\s*\(\d+, \d+", line.split("#")[0])
    ]
    assert bad == []
