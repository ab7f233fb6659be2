"""README.md's "From Python" examples, run as written: each ```python block prints exactly the
output block after it, the graph's result is numpy's, and apir.embed's vectors are the local
CPU's. The README cannot drift from the API."""

import ast
import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _examples():
    """(code, the output block after it) of each ```python block of README.md."""
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```\n\n```\n(.*?)```", text, re.S)
    assert len(blocks) == text.count("```python"), "each ```python block is followed by its output block"
    return blocks


def _run(code):
    """Runs `code` as a script; (its namespace, what it printed)."""
    namespace = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), namespace)
    return namespace, out.getvalue()


def _example(call):
    found = [(code, output) for code, output in _examples() if call in code]
    assert len(found) == 1, f"one README example calls {call}"
    return found[0]


def test_the_readme_has_the_two_examples():
    assert len(_examples()) == 2


def test_graph_example_prints_numpys_product():
    code, output = _example("apir.open(")
    namespace, printed = _run(code)
    assert printed == output
    a, b = namespace["a"], namespace["b"]
    assert np.array_equal(namespace["result"], b @ a.T)
    assert namespace["dev"].closed


def test_embed_example_equals_local_cpu():
    from apir.models.assets import ModelNotInstalled
    from apir.models.minilm import embed

    code, output = _example("apir.embed(")
    call = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and ast.unparse(n.func) == "apir.embed")
    sentences = ast.literal_eval(call.args[0])
    try:
        local = embed(sentences)  # ggml CPU in this process, not through APIR
    except ModelNotInstalled as exc:
        pytest.skip(str(exc))
    namespace, printed = _run(code)
    assert printed == output
    np.testing.assert_allclose(namespace["vectors"], local, atol=1e-5)



def test_examples_type_check(tmp_path):
    """The examples pass mypy against apir's annotations (py.typed): the API is typed as used,
    and a call it does not type (a wrong argument) would fail here."""
    api = pytest.importorskip("mypy.api")
    scripts = []
    for i, (code, _) in enumerate(_examples()):
        scripts.append(tmp_path / f"example{i}.py")
        scripts[-1].write_text(code)
    stdout, stderr, status = api.run(["--cache-dir", str(tmp_path / "cache"), *map(str, scripts)])
    assert status == 0, stdout + stderr
