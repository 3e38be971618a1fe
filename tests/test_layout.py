"""The tree shows the design: what the wheel installs, no import circles (Python or C), a light `pykvq run`."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import pykvq
from pykvq.bindings import gguf_py

PACKAGE = Path(pykvq.__file__).parent
MAX_TOP_MODULES = 12


def test_the_wheel_installs_no_top_level_package_but_pykvq() -> None:
    files = metadata.distribution("pykvq").files or []
    tops = {f.parts[0] for f in files if not f.parts[0].startswith(("pykvq-", ".."))}
    assert tops == {"pykvq"}
    assert any(f.as_posix().startswith("pykvq/convert/") for f in files)


def test_the_package_top_holds_few_modules() -> None:
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= MAX_TOP_MODULES, modules
    for sub in ("api", "bindings", "calibration", "commands", "convert", "devtools", "llama_cpp"):
        init = PACKAGE / sub / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} says nothing of what lives there"


def test_pypi_gguf_and_the_pinned_one_coexist() -> None:
    """transformers reads GGUF through PyPI's `gguf` (the test extra installs it); pykvq's own copy, the pinned
    llama.cpp's, stays under its private name and never replaces it."""
    import gguf

    pinned = gguf_py.gguf()
    assert not Path(gguf.__file__).is_relative_to(PACKAGE)
    assert Path(pinned.__file__).is_relative_to(PACKAGE / "vendor")
    assert sys.modules["gguf"] is gguf and pinned is not gguf
    assert pinned.GGUFWriter is not gguf.GGUFWriter
    assert hasattr(pinned, "LazyChunkedTensor")


def _imports(path: Path, package: str) -> set[str]:
    """The pykvq modules a module imports, anywhere in it (TYPE_CHECKING and function bodies included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pykvq"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if _module_file(name) else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("pykvq")}
    return {name for name in found if name != package}


def _module_file(name: str) -> Path | None:
    base = PACKAGE.parent.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt, [*stack, nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_python_import_circle() -> None:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        if "vendor" in path.relative_to(PACKAGE).parts:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        # a package's modules may import the package itself (its __init__), which imports none of them
        graph[name] = {m for m in _imports(path, name) if _module_file(m) and m != "pykvq"}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


_C_DEF = re.compile(r"^(?!static\b)[a-z_][\w \*]*?\b(\w+)\s*\([^;{]*\)\s*\{", re.M)


def _c_sources(repo: Path) -> list[Path]:
    return [p for d in ("ggml-kvq/src", "native/src") for p in (repo / d).rglob("*") if p.suffix in
            (".c", ".cpp", ".cu")]


def test_no_c_call_circle(repo: Path) -> None:
    """No two of our C/C++/CUDA files call functions the other defines (a shared header or a third file)."""
    sources = {p: p.read_text() for p in _c_sources(repo)}
    defines = {p: set(_C_DEF.findall(text)) for p, text in sources.items()}
    calls: dict[str, set[str]] = {}
    for p, text in sources.items():
        used = set(re.findall(r"\b(\w+)\s*\(", text))
        calls[p.name] = {q.name for q, names in defines.items() if q != p and used & names}
    assert _cycle(calls) is None, f"call circle: {' -> '.join(_cycle(calls) or [])}"


def test_pykvq_run_imports_no_torch(smollm2: Path, tmp_path: Path) -> None:
    code = ("import sys; from pykvq.commands.cli import main; "
            f"rc = main(['run', '-m', {str(smollm2)!r}, '-p', 'Hi', '-n', '2', '-c', '256', '--temp', '0']); "
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "print('HEAVY', heavy); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "HEAVY []" in proc.stdout


@pytest.mark.parametrize("name", ["Model", "Context", "ContextConfig", "KvConfig", "KvMemory", "ChatMessage",
                                  "LlamaError", "Sampler", "SamplerSettings", "GGML_TYPE_KIVI2"])
def test_the_public_names_stay_at_the_top(name: str) -> None:
    assert getattr(pykvq, name) is not None
