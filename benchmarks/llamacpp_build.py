"""llama.cpp's ``llama-server`` and GGUF converter, from the source the ``llama-cpp-python`` sdist vendors.

    .venv/bin/python -m benchmarks.llamacpp_build [--cache /work/cache/llamacpp] [--version 0.3.36]

Used by benchmarks/cpu_vs_llamacpp.py, never by ``make test``. Everything lands in a cache
directory outside the repository (``--cache``, else ``$PAGEDSERVE_LLAMACPP_CACHE``, else
``~/.cache/pagedserve/llamacpp``) and is reused by later runs:

* ``llama_cpp_python-VERSION.tar.gz``: fetched with ``pip download --no-binary`` (the ordinary
  client of the package registry);
* ``src-VERSION/``: the sdist unpacked; ``vendor/llama.cpp`` inside it holds llama.cpp itself,
  with ``convert_hf_to_gguf.py`` and its ``gguf-py`` package;
* ``build-VERSION-CPUKEY/bin/llama-server``: a Release build with ``GGML_NATIVE`` (tuned for
  this CPU, as a user building it here would get). CPUKEY hashes the CPU's feature flags, so a
  build made on an AVX-512 machine is never run on an AVX2-only one that shares the cache.

A build takes about 12 minutes on 2 cores; it runs under ``nice`` so a shared machine's other
work keeps its share.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

DEFAULT_VERSION = "0.3.36"


def default_cache() -> Path:
    env = os.environ.get("PAGEDSERVE_LLAMACPP_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "pagedserve" / "llamacpp"


def cpu_key() -> str:
    """A short hash of the CPU's feature flags (what ``-march=native`` depends on)."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((ln.split(":", 1)[1] for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:12]


def sdist(cache: Path, version: str) -> Path:
    """The unpacked sdist's ``vendor/llama.cpp`` directory (downloaded and unpacked once)."""
    src = cache / f"src-{version}"
    vendored = src / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (vendored / "CMakeLists.txt").is_file():
        return vendored
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"llama_cpp_python-{version}.tar.gz"
    if not archive.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(cache)], check=True)
    tmp = cache / f".src-{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    os.replace(tmp, src)
    return vendored


def built_server(cache: Path | None = None, version: str = DEFAULT_VERSION) -> Path | None:
    """Path of the ``llama-server`` built for this CPU when the cache holds one, else None."""
    binary = (cache or default_cache()) / f"build-{version}-{cpu_key()}" / "bin" / "llama-server"
    return binary if binary.is_file() else None


def llama_server(cache: Path | None = None, version: str = DEFAULT_VERSION, jobs: int | None = None) -> Path:
    """Path of a built ``llama-server`` for this CPU, building it first when the cache lacks one."""
    cache = cache or default_cache()
    build = cache / f"build-{version}-{cpu_key()}"
    binary = build / "bin" / "llama-server"
    if binary.is_file():
        return binary
    source = sdist(cache, version)
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    configure = ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                 "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"]
    print("configuring llama.cpp:", " ".join(configure), flush=True)
    subprocess.run(nice + configure, check=True)
    jobs = jobs or len(os.sched_getaffinity(0))
    print(f"building llama-server with {jobs} jobs (about 12 minutes on 2 cores) ...", flush=True)
    subprocess.run(nice + ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], check=True)
    if not binary.is_file():
        raise RuntimeError(f"the llama.cpp build finished but {binary} is missing")
    return binary


def converter(cache: Path | None = None, version: str = DEFAULT_VERSION) -> tuple[Path, Path]:
    """(``convert_hf_to_gguf.py``, the ``gguf-py`` directory to put on ``PYTHONPATH``)."""
    source = sdist(cache or default_cache(), version)
    return source / "convert_hf_to_gguf.py", source / "gguf-py"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=None, help="cache directory (default: %(default)s)")
    ap.add_argument("--version", default=DEFAULT_VERSION, help="llama-cpp-python sdist version")
    ap.add_argument("--jobs", type=int, default=None)
    args = ap.parse_args(argv)
    print(llama_server(args.cache, args.version, args.jobs))


if __name__ == "__main__":
    main()
