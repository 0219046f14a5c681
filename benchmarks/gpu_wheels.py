"""Fetch, here (with the registry), the small wheels the GPU lane installs offline on a lent GPU machine.

    python benchmarks/gpu_wheels.py                      # -> .gpu-wheels/ (git-ignored), for `carry`
    python benchmarks/gpu_wheels.py --cuda 130 --python 3.12

The lent machine (see the device tool's README: an image with its own Python 3.12 and a CUDA build of torch,
no network, a 64 MiB limit on what travels with the working tree) has torch, pytest, numpy, psutil, packaging,
protobuf, requests, ninja, einops, msgpack, py-cpuinfo, tqdm and nvidia-ml-py, but none of the GPU plugins'
dependencies. This script downloads, for that Python and x86-64 Linux and without their dependencies (torch is
never fetched):

* bitsandbytes (the pin of plugins/bnb), **repacked with only the CPU library and the CUDA library of ``--cuda``**
  (the wheel holds one per CUDA release: 43 MB; the repacked one about 2 MB);
* torchao (plugins/ao) and torchft (plugins/ft), with torchft's OpenTelemetry packages;
* DeepSpeed (plugins/deepspeed; an sdist, built here into a pure-Python wheel) and the packages of its own that the
  image lacks (hjson, pydantic and its three);
* setuptools, so that the lane can build our own distributions there without build isolation.

It writes ``.gpu-wheels/MANIFEST.json`` (name, size, sha256, and the CUDA release the bitsandbytes library is for)
and fails if the folder exceeds ``--max-mib`` (default 40, leaving room for the working tree in the 64 MiB).
Ray and Transformer Engine are not fetched: the lane gives them a dry check only (Ray's wheel alone is ~70 MB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".gpu-wheels"
#: the platforms pip may match for the lent machine (x86-64 Linux, glibc 2.35+)
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "linux_x86_64", "any")  # fmt: skip
#: packages the plugins need at run time that the lent machine's image lacks (dependencies of the pinned ones)
EXTRA = (
    # torchft 0.2.0 imports OpenTelemetry
    "opentelemetry-api", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-exporter-otlp-proto-common", "opentelemetry-proto", "opentelemetry-semantic-conventions",
    "googleapis-common-protos", "importlib-metadata",
    # deepspeed 0.19.8
    "hjson", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    # the build backend of our own distributions (PEP 639 license fields need 77+)
    "setuptools>=77",
)  # fmt: skip


def pins() -> dict[str, str]:
    """The exact versions CI installs of the GPU plugins' libraries (their pyproject.toml files ask for ranges)."""
    text = (REPO / "constraints.txt").read_text()
    found = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M))
    return {name: found[name] for name in ("bitsandbytes", "torchao", "torchft", "deepspeed")}


def download(requirement: str, python: str, dest: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "--dest", str(dest), requirement]  # fmt: skip
    for platform in PLATFORMS:
        command[-1:-1] = ["--platform", platform]
    subprocess.run(command, check=True)


def build_deepspeed(version: str, dest: Path) -> None:
    """DeepSpeed is published as an sdist: build its pure-Python wheel (no ops compiled) as `make setup` does."""
    env = {"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
               str(dest), f"deepspeed=={version}"]  # fmt: skip
    subprocess.run(command, check=True, env={**__import__("os").environ, **env})


def repack_bitsandbytes(wheel: Path, cuda: str) -> Path:
    """The bitsandbytes wheel with only ``libbitsandbytes_cpu.so`` and ``libbitsandbytes_cuda<cuda>.so`` kept (its
    RECORD lists what is left, so pip installs it cleanly)."""
    keep = {"libbitsandbytes_cpu.so", f"libbitsandbytes_cuda{cuda}.so"}
    names = zipfile.ZipFile(wheel).namelist()
    if f"bitsandbytes/libbitsandbytes_cuda{cuda}.so" not in names:
        have = sorted(n.split("cuda")[1].split(".")[0] for n in names if "libbitsandbytes_cuda" in n)
        raise SystemExit(f"{wheel.name} has no library for CUDA {cuda}; it has {have}")
    out = wheel.with_suffix(".repacked")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            base = item.filename.rsplit("/", 1)[-1]
            if base.startswith("libbitsandbytes_") and base not in keep:
                continue
            data = src.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(ln for ln in lines if not re.search(r"libbitsandbytes_", ln)
                                  or any(k in ln for k in keep)) + "\n").encode()  # fmt: skip
            dst.writestr(item, data)
    out.replace(wheel)
    return wheel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda", default="130", help="CUDA release of the lent machine's torch, as in torch.version.cuda "
                   "without the dot (the device README: torch 2.11.0+cu130 -> 130)")  # fmt: skip
    p.add_argument("--python", default="3.12", help="the lent machine's Python (default 3.12)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--max-mib", type=float, default=40.0)
    args = p.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    versions = pins()
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("bitsandbytes", "torchao", "torchft"):
            download(f"{name}=={versions[name]}", args.python, Path(tmp))
        for requirement in EXTRA:
            download(requirement, args.python, Path(tmp))
        build_deepspeed(versions["deepspeed"], Path(tmp))
        for wheel in Path(tmp).glob("*.whl"):
            shutil.move(str(wheel), args.out / wheel.name)
    repack_bitsandbytes(next(args.out.glob("bitsandbytes-*.whl")), args.cuda)
    wheels = sorted(args.out.glob("*.whl"))
    manifest = {
        "cuda": args.cuda, "python": args.python, "pins": versions,
        "wheels": [{"name": w.name, "bytes": w.stat().st_size, "sha256": hashlib.sha256(w.read_bytes()).hexdigest()}
                   for w in wheels],
    }  # fmt: skip
    (args.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(w.stat().st_size for w in wheels) / 2**20
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    print(f"{len(wheels)} wheels, {total:.1f} MiB in {args.out} (CUDA {args.cuda}, Python {args.python})")
    if total > args.max_mib:
        print(f"more than --max-mib {args.max_mib:g}: the working tree must stay under 64 MiB with them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
