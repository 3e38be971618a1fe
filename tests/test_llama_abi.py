"""The structs pykvq's cffi bindings copy from llama.h / llama-kvq.h have the compiler's layout."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pykvq.bindings import native
from pykvq.bindings.cdef import MIRRORED_STRUCTS
from pykvq.devtools import upstream


def probe_source(ffi) -> str:
    lines = ['#include <stddef.h>', '#include <stdio.h>', '#include "llama-kvq.h"', "int main(void) {"]
    for struct in MIRRORED_STRUCTS:
        lines.append(f'    printf("{struct} %zu\\n", sizeof(struct {struct}));')
        for name, _ in ffi.typeof(f"struct {struct}").fields:
            lines.append(f'    printf("{struct}.{name} %zu\\n", offsetof(struct {struct}, {name}));')
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


def test_mirrored_structs_match_the_headers(repo: Path, tmp_path: Path, upstream_source: upstream.Source) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    ffi = native.libs().ffi
    tree = upstream_source.root
    src = tmp_path / "probe.c"
    src.write_text(probe_source(ffi))
    exe = tmp_path / "probe"
    subprocess.run([compiler, "-std=c11", "-o", str(exe), str(src), f"-I{repo / 'native' / 'include'}",
                    f"-I{tree / 'include'}", f"-I{tree / 'ggml' / 'include'}"], check=True)
    expected = dict(line.rsplit(" ", 1) for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                                    check=True).stdout.splitlines())
    ours = {}
    for struct in MIRRORED_STRUCTS:
        ours[struct] = str(ffi.sizeof(f"struct {struct}"))
        for name, _ in ffi.typeof(f"struct {struct}").fields:
            ours[f"{struct}.{name}"] = str(ffi.offsetof(f"struct {struct}", name))
    assert ours == expected


def test_default_context_params_read_back_as_upstream_documents() -> None:
    params = native.libs().llama.llama_context_default_params()
    assert (params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max) == (512, 2048, 512, 1)
    assert params.flash_attn_type == -1 and params.type_k == params.type_v == 1 and params.offload_kqv
