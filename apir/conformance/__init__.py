"""Conformance vectors from ggml's C implementation (apir/conformance/data/*.json) and their runner:
`vectors` (loading, comparison rules), `host` (replay to a host), `guest` (apir's guest encoder
against them), `cli` (`apir conformance`). The vectors are made by
scripts/make-conformance-vectors.py; their format is in conformance/README.md."""
