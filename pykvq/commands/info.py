"""`pykvq info`: what this installation was built from and what it can do."""

from __future__ import annotations

import argparse
import json

from pykvq import build_info
from pykvq.api.fit import MIB
from pykvq.api.llama import add_rpc_servers
from pykvq.bindings import devices, native


def collect() -> dict:
    info = build_info.load()
    return {
        "pykvq": info.pykvq_version,
        "extension_api": native.extension_version(),
        "upstream": {
            "package": f"{info.upstream_package} {info.upstream_version}",
            "llama_cpp_commit": info.llama_cpp_commit,
            "ggml_version": info.ggml_version,
            "source": info.upstream_source,
            "sha256": info.upstream_sha256,
        },
        "patches": info.patches,
        "backends_built": info.backends,
        "backends_loaded": native.backends(),
        "cuda_architectures": info.cuda_architectures,
        "cpu_features": info.cpu_features,
        "kv_cache_types": [
            {"name": t.name, "bits_per_element": round(t.bits_per_element, 3)} for t in native.kv_cache_types()
        ],
        "build_type": info.build_type,
        "devices": [{"name": d.name, "description": d.description, "kind": d.kind, "total_mib": d.total // MIB,
                     "free_mib": d.free // MIB} for d in devices.offload_devices()],
    }


def format_text(info: dict) -> str:
    up = info["upstream"]
    lines = [
        f"pykvq              {info['pykvq']} (C API extension {info['extension_api']})",
        f"upstream           {up['package']}, llama.cpp {up['llama_cpp_commit']}, ggml {up['ggml_version']}",
        f"upstream source    {up['source']}" + (f" (sha256 {up['sha256']})" if up["sha256"] else " (not verified)"),
        f"patches applied    {len(info['patches'])}",
        *[f"  {p}" for p in info["patches"]],
        f"backends           {', '.join(info['backends_loaded'])} (built: {', '.join(info['backends_built'])})",
    ]
    if info["cuda_architectures"]:
        lines.append(f"CUDA architectures {', '.join(info['cuda_architectures'])}")
    lines += [
        f"CPU features       {', '.join(info['cpu_features'])}",
        "KV cache types     "
        + ", ".join(f"{t['name']} ({t['bits_per_element']:g} bpe)" for t in info["kv_cache_types"]),
        f"build type         {info['build_type']}",
    ]
    # llama.cpp's --list-devices, the devices that take layers (-ngl)
    found = [f"{d['name']}: {d['description']} ({d['total_mib']} MiB, {d['free_mib']} MiB free)"
             for d in info["devices"]]
    lines.append(f"devices            {'; '.join(found) or 'none that take layers: the CPU runs every layer'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.rpc:
        add_rpc_servers(args.rpc)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 0


def add_info_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("info", help="show the build: upstream, patches, backends, KV cache types, devices")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--rpc", metavar="SERVERS",
                        help="list these RPC servers' devices too, HOST:PORT[,HOST:PORT...] (as llama.cpp's "
                             "--list-devices with --rpc)")
    parser.set_defaults(handler=run)
