"""llama.cpp, unmodified, as apir's guest: SmolLM2-135M-Instruct Q4_1 generates
the same 64 greedy tokens through apir's host (local transport, the C shim of tests/interop) as on
local ggml CPU of the same build, and the prompt's logits agree within LOGITS_ATOL.

Any host refusal or failure (a WARNING "... refused: ..." in its log) fails the test, as does a
guest that did not run on the virtgpu device."""

from __future__ import annotations

import numpy as np
import pytest

from tests.interop.harness import HostProcess
from tests.llama.runner import HOST_ERROR, LOGITS_ATOL, apir_env, generate, local_env

# One thread on each side: on a shared 2-core machine ggml's spinning worker threads make a
# 2-thread run many times slower (llama.cpp's -t, apir.host.n_threads); the tokens do not depend
# on it (ggml splits rows between threads, not reductions).

# CI (tox py311: -m "not (llama and slow)") runs the first only.
PROMPTS = [
    "The capital of France is",
    pytest.param("<|im_start|>user\nExplain in detail how a steam engine works.<|im_end|>\n<|im_start|>assistant\n",
                 marks=pytest.mark.slow),
    pytest.param("def fibonacci(n):", marks=pytest.mark.slow),
    pytest.param("Once upon a time, in a small village,", marks=pytest.mark.slow),
]


def _through_apir(paths, model, prompt, tmp_path, **kw):
    sock = tmp_path / "apir.sock"
    # presented as a GPU (apir.host.device_type): a remote device of type CPU is taken by
    # llama.cpp for its own CPU, which aborts on its first input (docs/llama.md)
    with HostProcess(paths, sock, n_threads=1, device_type="gpu") as host:
        try:
            gen = generate(paths, model, prompt, apir_env(paths, sock), **kw)
        finally:
            host.stop()
        errors = [line for line in host.log.splitlines() if HOST_ERROR.search(line)]
    assert errors == [], "the host refused or failed commands"
    return gen


@pytest.mark.parametrize("prompt", PROMPTS, ids=[f"prompt{i}" for i in range(len(PROMPTS))])
def test_same_tokens_as_local_cpu(llama_paths, smollm2, prompt, tmp_path):
    local = generate(llama_paths, smollm2, prompt, local_env(llama_paths), logits_file=tmp_path / "local.f32")
    remote = _through_apir(llama_paths, smollm2, prompt, tmp_path, logits_file=tmp_path / "apir.f32")
    # the guest really used the host: llama.cpp names the device it offloaded to
    assert "[virtgpu] CPU" in remote.stderr
    assert "[virtgpu]" not in local.stderr
    assert remote.prompt == local.prompt
    assert len(local.generated) == 64  # no end-of-generation token in the first 64
    assert remote.generated == local.generated, (local.text, remote.text)
    assert remote.logits.shape == local.logits.shape == (len(local.prompt), local.n_vocab)
    diff = np.abs(remote.logits - local.logits).max()
    assert diff <= LOGITS_ATOL
