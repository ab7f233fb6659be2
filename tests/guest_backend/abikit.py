"""Struct layouts of apir.guest.backend.abi next to the C compiler's view of a ggml build's
ggml-backend-impl.h; used by tests/guest_backend/test_abi.py (0.20, 0.10) and
tests/llama/test_abi_ggml025.py (0.25)."""

import ctypes
import shutil
import subprocess

from apir.guest.backend import abi as abi_mod

CC = shutil.which("cc") or shutil.which("gcc")


def c_layout(paths: dict, a: abi_mod.Abi, tmp_path) -> dict:
    """{(struct, field or None): (offset, size)} from a program compiled against the headers."""
    lines = []
    for cname, cls in a.structs.items():
        lines.append(f'printf("%s - 0 %zu\\n", "{cname}", sizeof(struct {cname}));')
        for field, _ in cls._fields_:
            lines.append(f'printf("%s %s %zu %zu\\n", "{cname}", "{field}", '
                         f"offsetof(struct {cname}, {field}), sizeof(((struct {cname} *)0)->{field}));")
    src = tmp_path / "layout.c"
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n#include \"ggml-backend-impl.h\"\n"
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0; }\n")
    exe = tmp_path / "layout"
    subprocess.run([CC, "-std=c11", "-I", paths["GGML_INCLUDE"], "-I", paths["GGML_SRC"] + "/src",
                    str(src), "-o", str(exe)], check=True)
    out = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines():
        struct, field, off, size = line.split()
        out[(struct, None if field == "-" else field)] = (int(off), int(size))
    return out


def py_layout(a: abi_mod.Abi) -> dict:
    out = {}
    for cname, cls in a.structs.items():
        out[(cname, None)] = (0, ctypes.sizeof(cls))
        for field, _ in cls._fields_:
            desc = getattr(cls, field)
            out[(cname, field)] = (desc.offset, desc.size)
    return out
