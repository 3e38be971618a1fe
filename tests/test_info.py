"""The installed package: CLI entry point, `pykvq info`, libraries found inside the package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pykvq
from pykvq import llama_tools, paths
from pykvq.bindings import native
from pykvq.devtools import upstream


def pykvq_cli(*args: str) -> subprocess.CompletedProcess:
    """The installed console script, as a user runs it."""
    script = shutil.which("pykvq") or str(Path(sys.executable).parent / "pykvq")
    return subprocess.run([script, *args], capture_output=True, text=True)


def test_version() -> None:
    proc = pykvq_cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"pykvq {pykvq.__version__}"
    assert pykvq.__version__ != "0.0.0"


def test_libraries_and_tools_live_inside_the_package() -> None:
    package = paths.package_dir()
    assert paths.library("llama").parent == package / "lib"
    for tool in ("llama-perplexity", "llama-completion", "llama-batched-bench"):
        assert paths.tool(tool).parent == package / "bin"


def test_info_json_reports_the_build(repo: Path) -> None:
    proc = pykvq_cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["upstream"]["package"] == f"llama-cpp-python {upstream.SDIST_VERSION}"
    assert info["upstream"]["llama_cpp_commit"] == upstream.LLAMA_CPP_COMMIT
    assert info["upstream"]["ggml_version"] == "0.25.3"
    series = [f"{p.parent.parent.name}/{p.name}" for p in upstream.patch_series(repo)]
    assert info["patches"] == series and series
    assert "CPU" in info["backends_loaded"] and "CPU" in info["backends_built"]


def test_kv_types_are_those_the_patched_tools_accept() -> None:
    # independent oracle: the help text of the patched llama-perplexity itself
    help_text = llama_tools.run_tool("llama-perplexity", ["--help"])
    allowed = re.search(r"-ctk,\s+--cache-type-k TYPE.*?allowed values: ([\w,\s]+?)\s+\(default", help_text, re.S)
    assert allowed is not None
    names = [t.name for t in native.kv_cache_types()]
    assert names == [n.strip() for n in allowed.group(1).split(",")]
    assert names[-3:] == ["kivi4", "kivi2", "kivi1"]


def test_kv_type_bits_per_element_match_the_block_formats() -> None:
    bpe = {t.name: t.bits_per_element for t in native.kv_cache_types()}
    # ggml's blocks: q8_0 = fp16 d + 32 int8; q4_0 = fp16 d + 16 bytes; q4_1 adds an fp16 m
    assert bpe["f16"] == 16 and bpe["q8_0"] == (2 + 32) * 8 / 32
    assert bpe["q4_0"] == (2 + 16) * 8 / 32 and bpe["q4_1"] == (4 + 16) * 8 / 32


def test_info_text_names_upstream_and_patches() -> None:
    proc = pykvq_cli("info")
    assert proc.returncode == 0, proc.stderr
    assert f"llama.cpp {upstream.LLAMA_CPP_COMMIT}" in proc.stdout
    assert "patches applied" in proc.stdout and "KV cache types" in proc.stdout


def test_unknown_command_fails_cleanly() -> None:
    proc = pykvq_cli("frobnicate")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_info_lists_the_devices_that_take_layers(rpc_server: str, cpu_only: None) -> None:
    """As llama.cpp's --list-devices: none on the CPU, an RPC server's (its machine's whole memory) with --rpc."""
    alone = json.loads(pykvq_cli("info", "--json").stdout)
    assert alone["devices"] == []
    assert "devices            none that take layers" in pykvq_cli("info").stdout
    proc = pykvq_cli("info", "--json", "--rpc", rpc_server)
    assert proc.returncode == 0, proc.stderr
    [device] = json.loads(proc.stdout)["devices"]
    total_mib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
    assert (device["name"], device["description"], device["kind"]) == ("RPC0", rpc_server, "GPU")
    assert device["total_mib"] == total_mib and 0 < device["free_mib"] <= total_mib
    text = pykvq_cli("info", "--rpc", rpc_server).stdout
    assert f"devices            RPC0: {rpc_server} ({total_mib} MiB, " in text
