"""Running llama.cpp (tests/llama/llama_tokens.cpp, llama-simple, llama-bench) locally on ggml CPU
and through apir's host, with the C shim of tests/interop as its DRM device.

Local: the same binaries without the shim; ggml-virtgpu then finds no DRM render node and
registers no device, so llama.cpp computes on ggml CPU in-process (same build, same kernels).
Through apir: the shim preloaded, `tests.interop.serve_host` (apir's Python dispatcher) on the
same build's ggml (APIR_GGML_LIB_DIR: its libggml-base / -cpu / -ggml), all layers offloaded
(-ngl 99) to the `[virtgpu] CPU` device.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from tests.interop.harness import build_shim, guest_env
from tests.llama.build import build_dir

HERE = Path(__file__).resolve().parent

# How far the prompt's logits through apir may be from local ggml CPU's. Both sides run the same
# ggml-cpu kernels of one build on the same data, so the logits are expected bit-identical (and
# were, for all four prompts of test_generate); the tolerance only allows for a different split
# of the graph between the guest's CPU backend and the host reordering an F32 reduction.
LOGITS_ATOL = 1e-3

# host log lines that mean the host refused or failed a command (apir.host.backend.dispatcher): any is
# a failure of a llama.cpp run, whatever the guest printed
HOST_ERROR = re.compile(r" (refused|failed): | ERROR | CRITICAL |Traceback")


def build_tokens_program(paths: Dict[str, str]) -> Path:
    """tests/llama/llama_tokens.cpp against the build's libllama (rpath set), cached by the hash
    of its source under <build_dir>/programs/."""
    src = HERE / "llama_tokens.cpp"
    lib_dir = paths["GGML_LIB_DIR"]
    args = ["-O2", "-std=c++17", f"-I{paths['LLAMA_INCLUDE']}", f"-I{paths['GGML_INCLUDE']}", str(src),
            f"-L{lib_dir}", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib_dir}"]
    digest = hashlib.sha256(src.read_bytes() + " ".join(args).encode()).hexdigest()[:16]
    out = build_dir() / "programs" / digest / "llama_tokens"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".llama_tokens.{os.getpid()}")
        subprocess.run(["g++", "-o", str(tmp), *args], check=True, capture_output=True, text=True)
        tmp.replace(out)
    return out


def local_env(paths: Dict[str, str]) -> dict:
    """Environment of a local run: no shim, the build's libraries first."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["LD_LIBRARY_PATH"] = paths["GGML_LIB_DIR"]
    return env


def apir_env(paths: Dict[str, str], socket_path: Path) -> dict:
    """Environment of a run through the apir host listening at `socket_path`."""
    env = guest_env(paths, build_shim(paths), str(socket_path))
    env["LD_LIBRARY_PATH"] = paths["GGML_LIB_DIR"]
    return env


@dataclass
class Generation:
    prompt: List[int]
    generated: List[int]
    text: str
    n_vocab: int
    logits: Optional[np.ndarray]  # [n_prompt, n_vocab] float32
    stderr: str


def tokens_command(paths: Dict[str, str], model: Path, prompt: str, n_predict: int = 64,
                   logits_file: Optional[Path] = None, threads: int = 1) -> List[str]:
    """The llama_tokens command line (argv) of a greedy generation of `n_predict` tokens, all
    layers offloaded (-ngl 99: to the virtgpu device when there is one, else local ggml CPU)."""
    cmd = [str(build_tokens_program(paths)), "-m", str(model), "-ngl", "99", "-n", str(n_predict), "-t", str(threads)]
    if logits_file is not None:
        cmd += ["--logits", str(logits_file)]
    return [*cmd, prompt]


def parse_tokens(stdout: str, stderr: str = "", logits_file: Optional[Path] = None) -> Generation:
    """A Generation from llama_tokens' stdout (and its --logits file, if one was asked for)."""
    fields = dict(line.split(":", 1) for line in stdout.splitlines() if ":" in line)
    n_vocab = int(fields["vocab"])
    prompt_ids = [int(x) for x in fields["prompt"].split()]
    logits = None
    if logits_file is not None:
        logits = np.fromfile(logits_file, dtype=np.float32).reshape(len(prompt_ids), n_vocab)
    return Generation(prompt_ids, [int(x) for x in fields["generated"].split()], fields["text"].strip(), n_vocab,
                      logits, stderr)


def generate(paths: Dict[str, str], model: Path, prompt: str, env: dict, n_predict: int = 64,
             logits_file: Optional[Path] = None, threads: int = 1, timeout: float = 600) -> Generation:
    """Greedy generation of `n_predict` tokens with llama_tokens; raises CalledProcessError
    (stderr in its message) when it fails."""
    cmd = tokens_command(paths, model, prompt, n_predict, logits_file, threads)
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise subprocess.CalledProcessError(run.returncode, cmd, run.stdout, run.stderr[-4000:])
    return parse_tokens(run.stdout, run.stderr, logits_file)
