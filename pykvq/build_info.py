"""What the installed native build was made from (written by CMake at build time)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pykvq import paths


@dataclass(frozen=True)
class BuildInfo:
    pykvq_version: str
    build_type: str
    backends: list[str]
    cpu_features: list[str]
    cuda_architectures: list[str]
    upstream_package: str
    upstream_version: str
    llama_cpp_commit: str
    ggml_version: str
    upstream_source: str
    upstream_sha256: str | None
    patches: list[str]


def load() -> BuildInfo:
    raw = json.loads(paths.build_info_file().read_text())
    up = raw["upstream"]
    return BuildInfo(
        pykvq_version=raw["pykvq_version"], build_type=raw["build_type"], backends=raw["backends"],
        cpu_features=raw["cpu_features"], cuda_architectures=raw["cuda_architectures"],
        upstream_package=up["package"], upstream_version=up["version"],
        llama_cpp_commit=up["llama_cpp_commit"], ggml_version=up["ggml_version"],
        upstream_source=up["source"], upstream_sha256=up["sha256"], patches=up["patches"],
    )
