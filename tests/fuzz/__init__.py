"""The fenced mutation fuzzer of apir's host (docs/security.md, "Fuzzing").

Modules, one job each:
    fence.py     guest memory and host buffers fenced by PROT_NONE pages
    corpus.py    the seed graphs: every case of the shape-rule tests (tests/host/shapekit.py)
    mutate.py    seeded mutations of graphs, tensor records, inline tensors and commands
    inputs.py    one fuzz input: a fresh host context, its setup and commands; the
                 reproducer file format and its replay
    child.py     the process that runs inputs (it is the one that crashes)
    driver.py    the parent: workers, deadlines, crash / hang accounting, reproducers
The protocol fuzzers (socket framing, vhost-user, guests racing), on the same driver:
    protokit.py     their target interface, oracle checks and reproducer format
    wire_child.py   the process that hosts their target and runs inputs
    wire_socket.py, wire_vhost.py, guests.py    the three targets
`scripts/fuzz-host.py` is the command line; `tests/fuzz/test_fuzz_corpus.py` and
`test_fuzz_protocols.py` the CI corpora.
"""
