"""The fenced mutation fuzzer of apir's host (docs/security.md, "Fuzzing").

Modules, one job each:
    fence.py     guest memory and host buffers fenced by PROT_NONE pages
    corpus.py    the seed graphs: every case of the shape-rule tests (tests/host/shapekit.py)
    mutate.py    seeded mutations of graphs, tensor records, inline tensors and commands
    inputs.py    one fuzz input: a fresh host context, its setup and commands; the
                 reproducer file format and its replay
    child.py     the process that runs inputs (it is the one that crashes)
    driver.py    the parent: workers, deadlines, crash / hang accounting, reproducers
`scripts/fuzz-host.py` is the command line; `tests/fuzz/test_fuzz_corpus.py` the CI corpus.
"""
