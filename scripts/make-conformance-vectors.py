#!/usr/bin/env python3
"""Generates apir/conformance/data/*.json, the APIR conformance vectors, from ggml's C implementation.

    scripts/make-conformance-vectors.py [--version 0.20|0.10|ext ...] [--out apir/conformance/data/]

For each C reference build (tests/cref.py: APIR 0.2 / ggml 0.20.2 and APIR 0.1 / ggml 0.10.1):

1. builds scripts/conformance/capture_guest.cpp against ggml's C guest (libggml-virtgpu.so);
   its commands are encoded by the C guest's own functions (or its remote_call_prepare and
   apir_cs.h helpers for the commands it has no function for, and the wrong commands that draw
   the error replies);
2. runs it through the apir DRM shim (tests/interop/shim/apir_drm_shim.c) against
   scripts/conformance/record_host.py, a host whose backend library is the C host library
   (libggml-virtgpu-backend.so, through apir.host.backend.c_library), which records every command, the
   bytes in shared memory, the return code and the reply payload; once with the APIR capset and
   once with the Venus capset (a short session);
3. annotates every command and reply field by field (scripts/conformance/annotate.py: offset,
   size, field, the C encode helper, value, and the comparison rule where the bytes are
   uninitialised or run-dependent) and writes apir/conformance/data/apir-<apir>-ggml-<ggml>.json.

apir's own encoder is not involved: the bytes are the C's. HandShake and LoadLibrary replies come
from apir's APIR component (the part virglrenderer plays; no C build of it exists here), and the
C host crashes on buffer_free_buffer of buffer_from_ptr buffers, so apir's adapter serves that
function with the C's return codes (docs/interop.md); the vectors say so per reply.

`--version ext` captures the extensions beyond APIR 0.2 (docs/protocol.md section 12) from the
C guest of patches/ggml-virtgpu-extensions.patch (ggml 0.25.3, scripts/get-llama-cpp.sh
extensions; built on first use), whose replies can only come from apir's host: the driver's
"ext" session against apir's host with its extensions, then against it with
apir.host.extensions=off (the 0.2 fallback), then its "devices" session against apir's host
with two devices (apir.host.backend=cpu,cpu), all on the llama.cpp build's ggml CPU backend.
Written to apir-0.2-ext-ggml-0.25.3.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.conformance import annotate  # noqa: E402
from tests import cref  # noqa: E402
from tests.interop.harness import build_shim, c_build_env  # noqa: E402

DRIVER = REPO / "scripts" / "conformance" / "capture_guest.cpp"
RECORDER = REPO / "scripts" / "conformance" / "record_host.py"
GGML_VERSIONS = {"0.20": "0.20.2", "0.10": "0.10.1"}
EXT_GGML = "0.25.3"
# the extension sessions: name, host configuration (a session's "host_config"), driver mode
EXT_SESSIONS = (("apir-capset-extensions", {}, "ext"),
                ("apir-capset-0.2-fallback", {"apir.host.extensions": "off"}, "ext"),
                ("apir-capset-devices", {"apir.host.backend": "cpu,cpu"}, "devices"))


def build_driver(paths: dict, out_dir: Path) -> Path:
    """capture_guest.cpp compiled against the C guest of `paths` (its internal headers too)."""
    src = Path(paths["GGML_SRC"]) / "src"
    virtgpu = src / "ggml-virtgpu"
    exe = out_dir / "capture_guest"
    libdirs = sorted({str(Path(paths["LIBGGML_VIRTGPU"]).parent), str(Path(paths["LIBGGML_BASE"]).parent)})
    drm = subprocess.run(["pkg-config", "--cflags", "libdrm"], check=True, capture_output=True,
                         text=True).stdout.split()
    minor = "-DAPIR_MINOR_0_1" if "0.10" in paths["GGML_BUILD"] else "-DAPIR_MINOR_0_2"
    cmd = ["g++", "-O1", "-std=gnu++17", "-include", "mutex", "-D_GNU_SOURCE", minor,
           "-isystem", paths["VIRTGPU_DRM_INCLUDE"], f"-I{virtgpu}", f"-I{src}", f"-I{virtgpu / 'include'}",
           f"-I{paths['GGML_INCLUDE']}", *drm, "-o", str(exe), str(DRIVER),
           *[f"-L{d}" for d in libdirs], "-lggml-virtgpu", "-lggml-base", f"-Wl,-rpath,{':'.join(libdirs)}"]
    subprocess.run(cmd, check=True)
    return exe


def capture(paths: dict, driver: Path, work: Path, apir_capset: bool, short: bool, ext_config=None,
            guest_lib_dir=None, ext_mode="ext"):
    """Runs the driver against a recording host; returns (driver stdout, recorded contexts).
    The host is the C host library of `paths`, or with `ext_config` (a dict, maybe empty) apir's
    own host so configured, on the ggml of `paths`, and the driver runs in `ext_mode`;
    `guest_lib_dir` goes first in the driver's LD_LIBRARY_PATH (the extended C guest's folder)."""
    sock, out = work / "host.sock", work / f"capture-{int(apir_capset)}.json"
    if ext_config is None:
        host_args = ["--c-library", paths["LIBGGML_VIRTGPU_BACKEND"], "--ggml-library", paths["LIBGGML_CPU"],
                     "--ggml-reg", "ggml_backend_cpu_reg"]
    else:
        host_args = [arg for k, v in ext_config.items() for arg in ("--config", f"{k}={v}")]
    with open(work / "host.log", "a") as log:
        host = subprocess.Popen([sys.executable, str(RECORDER), "--socket", str(sock), "--out", str(out),
                                 *host_args],
                                env=c_build_env(paths), stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
        try:
            if host.stdout.readline().strip() != "ready":
                raise RuntimeError(f"recording host did not start; see {work / 'host.log'}")
            env = dict(os.environ)
            lib_dirs = [str(d) for d in (guest_lib_dir, Path(paths["LIBGGML"]).parent) if d]
            env.update(LD_PRELOAD=str(build_shim(paths)), APIR_SHIM_SOCKET=str(sock),
                       LD_LIBRARY_PATH=os.pathsep.join(lib_dirs))
            for name in ("GGML_REMOTING_USE_APIR_CAPSET", "APIR_EXTENSIONS"):
                env.pop(name, None)
            if apir_capset:
                env["GGML_REMOTING_USE_APIR_CAPSET"] = "1"
            mode = [ext_mode] if ext_config is not None else ["short"] if short else []
            run = subprocess.run([str(driver)] + mode, env=env, check=False,
                                 capture_output=True, text=True, timeout=300)
            if run.returncode != 0:
                raise RuntimeError(f"capture driver failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
        finally:
            host.terminate()
            host.wait(60)
    return run.stdout, json.loads(out.read_text())


def generate(version: str, out_dir: Path) -> Path:
    paths = cref.build(version)
    with tempfile.TemporaryDirectory(prefix="apir-conformance-") as tmp:
        work = Path(tmp)
        driver = build_driver(paths, work)
        sessions = []
        for name, apir_capset, short in (("apir-capset", True, False), ("venus-capset", False, True)):
            stdout, contexts = capture(paths, driver, work, apir_capset, short)
            if len(contexts) != 1:
                raise RuntimeError(f"expected one guest context, the host saw {len(contexts)}")
            sessions.append(annotate.session(name, stdout, contexts[0]))
    doc = annotate.document(version, GGML_VERSIONS[version], stdout, sessions)
    path = out_dir / f"apir-{doc['apir']}-ggml-{doc['ggml']}.json"
    path.write_text(annotate.dumps(doc))
    return path


def extension_paths() -> tuple:
    """(paths of the llama.cpp build, paths of its extended C guest): get-llama-cpp.sh's cpu and
    extensions builds (tests/llama/build.py), built on first use."""
    from tests.llama import build as llama_build

    return llama_build.build(), llama_build.build_extensions()


def generate_ext(out_dir: Path) -> Path:
    """The extension vectors (module docstring): the patched C guest's headers and library,
    the llama.cpp build's ggml for apir's host."""
    host_paths, guest_paths = extension_paths()
    driver_paths = {**host_paths, **{k: guest_paths[k] for k in ("GGML_SRC", "LIBGGML_VIRTGPU", "LIBGGML_BASE")}}
    guest_lib_dir = Path(guest_paths["LIBGGML_VIRTGPU"]).parent
    with tempfile.TemporaryDirectory(prefix="apir-conformance-ext-") as tmp:
        work = Path(tmp)
        driver = build_driver(driver_paths, work)
        sessions, outputs = [], []
        for name, config, mode in EXT_SESSIONS:
            stdout, contexts = capture(host_paths, driver, work, True, False, config, guest_lib_dir, mode)
            if len(contexts) != 1:
                raise RuntimeError(f"expected one guest context, the host saw {len(contexts)}")
            sessions.append(annotate.session(name, stdout, contexts[0], host_config=config, ext=True))
            outputs.append(stdout)
    doc = annotate.document("ext", EXT_GGML, "\n".join(outputs), sessions, ext=True)
    path = out_dir / f"apir-{doc['apir']}-ext-ggml-{doc['ggml']}.json"
    path.write_text(annotate.dumps(doc))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="append", choices=sorted(GGML_VERSIONS) + ["ext"],
                    help="C reference to capture (repeatable; default 0.20 and 0.10; ext: the extensions)")
    ap.add_argument("--out", default=str(REPO / "apir" / "conformance" / "data"))
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for version in args.version or ["0.20", "0.10"]:
        path = generate_ext(out_dir) if version == "ext" else generate(version, out_dir)
        doc = json.loads(path.read_text())
        n = sum(len(s["steps"]) for s in doc["sessions"])
        print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: {n} vectors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
