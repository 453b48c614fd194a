"""Build, cache and load the C kernels in ``executor_svc/csrc``; call the paged decode attention.

Every ``csrc/*.c`` (paged decode attention, linear layers, the fused decode
stack, a memory-bandwidth probe) is compiled on the machine that runs it, by the
system C compiler (``$CC``, else ``cc``/``gcc``), into one shared library named
by a hash of the sources, the flags and (for ``-march=native`` builds) the CPU. The library
lands in a cache directory: ``$PAGEDSERVE_CACHE_DIR``, else
``$XDG_CACHE_HOME/pagedserve``, else ``~/.cache/pagedserve``, else a directory
under the system temp dir; it is written to a temporary name and renamed, so
processes compiling at the same time never load a half-written file.

Where no compiler exists (the container images), a *portable* build (no
``-march=native``) made at image build time is looked up in
``$PAGEDSERVE_PREBUILT_KERNELS`` (``python -m executor_svc.cpu_kernels --build
--portable --out DIR``). If nothing loads, :func:`load_decode_kernel` logs one
warning and returns None, and the caller keeps the torch path.

The call goes through ctypes, which releases the GIL for its duration: the
executor's heartbeat thread keeps running while a layer's attention does.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from executor_svc.threads import usable_cpus

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
LIB_PREFIX = "pagedserve_cpu"
ABI_VERSION = 5  # ps_abi_version() in paged_decode_cpu.c
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-std=gnu11")
# Never -ffast-math: it would let the compiler assume no NaN/inf, and the softmax must propagate
# them like torch's SDPA does. The source spells out the partial sums it wants vectorised instead.
# portable: no -march, but x86-64 builds carry AVX2/AVX-512 clones of the hot loop (PS_PORTABLE in the source)
VARIANTS = {"native": ("-march=native",), "portable": ("-DPS_PORTABLE",)}
OPENMP_FLAGS = (("-fopenmp",), ("-fopenmp-simd",))  # threads; else single-threaded but vectorised
COMPILE_TIMEOUT_S = 120
_STATUS = {1: "a block id outside the cache", 2: "a seq_len < 1 or longer than its block table",
           3: "out of memory for scratch buffers"}


def default_cache_dir() -> Path:
    explicit = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "pagedserve"
    try:
        return Path.home() / ".cache" / "pagedserve"
    except (RuntimeError, KeyError):  # no $HOME and no passwd entry (some containers)
        return _temp_root()


def _temp_root() -> Path:
    return Path(tempfile.gettempdir()) / f"pagedserve-{os.getuid()}"


def _private(path: Path) -> bool:
    """Ours and writable by nobody else: we load code from here."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _writable_cache_dir(preferred: Path) -> Path:
    """``preferred/cpu_kernels`` if it can be created and written, else a private per-user
    directory under the (shared, world-writable) temp dir."""
    tmp_root = _temp_root()
    for root in (preferred, tmp_root):
        path = root / "cpu_kernels"
        try:
            if root == tmp_root:
                root.mkdir(mode=0o700, exist_ok=True)
                if not _private(root):  # someone else made it first
                    continue
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    raise OSError(f"no writable cache dir (tried {preferred} and {tmp_root})")


def _prebuilt_dirs() -> list[Path]:
    return [Path(p) for p in os.environ.get("PAGEDSERVE_PREBUILT_KERNELS", "").split(os.pathsep) if p]


def _cpu_signature() -> str:
    """What -march=native depends on: a library built for one CPU must not load on another."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def sources() -> list[Path]:
    """The C files compiled into the library, in a fixed order."""
    return sorted(SOURCE_DIR.glob("*.c"))


def _source_text() -> bytes:
    """Every source and header, names included: any edit gives a new library name."""
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in sorted(SOURCE_DIR.glob("*.[ch]")))


def library_key(source: bytes, flags: tuple[str, ...], variant: str) -> str:
    h = hashlib.sha256(source)
    h.update("\0".join((*flags, platform.machine(), sys.platform)).encode())
    if variant == "native":
        h.update(_cpu_signature().encode())
    return h.hexdigest()[:24]


def find_compiler() -> str | None:
    """``$CC`` when set (even if it does not exist: that is an explicit choice), else cc/gcc/clang."""
    cc = os.environ.get("CC")
    if cc:
        return cc
    return next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)


@dataclass(frozen=True, slots=True)
class Build:
    path: Path
    variant: str
    flags: tuple[str, ...]
    compiled: bool  # False: found in a cache or prebuilt dir


def _flags(variant: str, omp: tuple[str, ...]) -> tuple[str, ...]:
    return (*BASE_FLAGS, *VARIANTS[variant], *omp)


def _candidates(variant: str) -> list[tuple[tuple[str, ...], str]]:
    source = _source_text()
    out = []
    for omp in OPENMP_FLAGS:
        flags = _flags(variant, omp)
        out.append((flags, f"{LIB_PREFIX}-{variant}-{library_key(source, flags, variant)}.so"))
    return out


def _compile(compiler: str, flags: tuple[str, ...], dest: Path) -> str | None:
    """Compile the sources to ``dest`` atomically; the compiler's complaint on failure. Each source
    is compiled to an object of its own, as many at once as this process has CPUs (the slowest,
    the block-format kernels with their AVX-512 clones, takes a third of a serial build), then
    linked."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name, suffix=".tmp")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f"{dest.name}.objs-") as objdir:
            srcs = sources()
            objects = [str(Path(objdir) / f"{src.stem}.o") for src in srcs]
            jobs = [[compiler, *flags, "-I", str(SOURCE_DIR), "-c", "-o", obj, str(src)]
                    for src, obj in zip(srcs, objects, strict=True)]
            with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), usable_cpus()))) as pool:
                for err in pool.map(_run_compiler, jobs):
                    if err is not None:
                        return err
            err = _run_compiler([compiler, *flags, "-o", tmp, *objects, "-lm"])
            if err is not None:
                return err
        os.replace(tmp, dest)
        return None
    except OSError as exc:
        return str(exc)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _run_compiler(argv: list[str]) -> str | None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if proc.returncode != 0:
        return (proc.stderr or proc.stdout).strip()[-2000:] or f"exit status {proc.returncode}"
    return None


def build_library(variant: str = "native", cache_dir: Path | None = None,
                  compiler: str | None = None) -> Build:
    """The library for ``variant``: found in the cache or prebuilt dirs, else compiled into the cache.

    ``cache_dir`` is used as given (created if missing); by default it is ``cpu_kernels/`` under
    :func:`default_cache_dir`, or under the temp dir when that is not writable. Raises RuntimeError
    (with the compiler's output) when nothing is found and nothing compiles.
    """
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache = cache_dir
    else:
        cache = _writable_cache_dir(default_cache_dir())
    candidates = _candidates(variant)
    for flags, name in candidates:
        for d in (cache, *_prebuilt_dirs()):
            if (d / name).is_file():
                return Build(d / name, variant, flags, compiled=False)
    compiler = compiler or find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set $CC, or install cc/gcc)")
    errors = []
    for flags, name in candidates:
        err = _compile(compiler, flags, cache / name)
        if err is None:
            _prune_stale(cache, variant, keep=name)
            return Build(cache / name, variant, flags, compiled=True)
        errors.append(f"{compiler} {' '.join(flags)}: {err}")
    raise RuntimeError(f"compiling {SOURCE_DIR}/*.c failed:\n" + "\n".join(errors))


def build_with_flags(extra_flags: list[str], dest: Path) -> Build:
    """The native OpenMP build with ``extra_flags`` added (a build-time choice such as
    ``-DPS_PF_HINT=...``), compiled to ``dest`` uncached: benchmarks time it against the default."""
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set $CC, or install cc/gcc)")
    flags = (*_flags("native", OPENMP_FLAGS[0]), *extra_flags)
    err = _compile(compiler, flags, dest)
    if err is not None:
        raise RuntimeError(f"{compiler} {' '.join(flags)}: {err}")
    return Build(dest, "native", flags, compiled=True)


def _prune_stale(cache: Path, variant: str, keep: str) -> None:
    """Remove this variant's builds of older sources (one per upgrade would pile up otherwise).
    A process still running one keeps its mapping: unlinking a loaded library is safe."""
    for old in (*cache.glob(f"{LIB_PREFIX}-{variant}-*.so"), *cache.glob(f"paged_decode_cpu-{variant}-*.so")):
        if old.name != keep:
            try:
                old.unlink()
            except OSError:
                pass


KV_TYPES = {torch.float32: 0, torch.bfloat16: 1}  # PS_KV_* in csrc/ps_cpu.h


def open_library(build: Build) -> ctypes.CDLL:
    """The library of ``build``, its ABI checked."""
    lib = ctypes.CDLL(str(build.path))
    if lib.ps_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{build.path}: ABI {lib.ps_abi_version()}, expected {ABI_VERSION}")
    return lib


class DecodeKernel:
    """ctypes binding of ``ps_paged_decode`` with the checks that keep it memory-safe."""

    def __init__(self, build: Build) -> None:
        self.build = build
        lib = open_library(build)
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        fn = lib.ps_paged_decode
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i32, ptr, i64, i32, ptr, ptr, ptr, i32,
                       i32, i32, i32, i32, i64, ctypes.c_float, i32]
        fn.restype = i32
        self._fn, self.lib = fn, lib

    def __call__(self, out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor, seqs: torch.Tensor,
                 scale: float, num_threads: int | None = None, check_indices: bool = True) -> None:
        """``out[rows[i]] = attention(query[rows[i]], sequence seqs[i]'s cached K/V)`` for each i.

        ``check_indices=False`` skips the bounds check of ``rows``/``seqs`` (two reductions, ~10 us):
        only for callers that built them in range. Block ids and lengths are always checked (in C).
        """
        _check(out, query, k_cache, v_cache, block_tables, seq_lens, rows, seqs)
        if check_indices and rows.numel():
            lo_r, hi_r, lo_s, hi_s = torch.stack([*torch.aminmax(rows), *torch.aminmax(seqs)]).tolist()
            if lo_r < 0 or hi_r >= query.shape[0]:
                _fail("a row index outside query")
            if lo_s < 0 or hi_s >= seq_lens.shape[0]:
                _fail("a sequence index outside seq_lens")
        nb, bs, kvh, d = k_cache.shape
        status = self._fn(
            out.data_ptr(), out.stride(0), out.stride(1), query.data_ptr(), query.stride(0), query.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(), KV_TYPES[k_cache.dtype], block_tables.data_ptr(),
            block_tables.stride(0),
            block_tables.shape[1], seq_lens.data_ptr(), rows.data_ptr(), seqs.data_ptr(), rows.shape[0],
            query.shape[1], kvh, d, bs, nb, float(scale), num_threads or torch.get_num_threads())
        if status:
            raise ValueError(f"paged decode kernel: {_STATUS.get(status, f'status {status}')}")


def _check(out, query, k_cache, v_cache, block_tables, seq_lens, rows, seqs) -> None:
    """What the C code trusts, except the index bounds. Plain conditions, messages only on failure:
    this runs once per layer per step."""
    f32, i32, i64, cpu = torch.float32, torch.int32, torch.int64, torch.device("cpu")
    tensors = (out, query, k_cache, v_cache, block_tables, seq_lens, rows, seqs)
    if any(t.device != cpu for t in tensors):
        _fail("every tensor must be on the CPU, got " + ", ".join(str(t.device) for t in tensors))
    if not (out.dtype == query.dtype == f32 and k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_TYPES):
        _fail(f"out/query must be float32 and k_cache/v_cache both float32 or both bfloat16, got "
              f"{out.dtype}/{query.dtype}/{k_cache.dtype}/{v_cache.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        _fail(f"k/v caches must be [blocks, block_size, kv_heads, head] and alike, got "
              f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        _fail("k/v caches must be contiguous")
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    if query.dim() != 3 or query.shape[2] != d or query.shape[1] % kvh:
        _fail(f"query must be [tokens, q_heads, {d}] with q_heads a multiple of {kvh}, got {tuple(query.shape)}")
    if out.shape != query.shape:
        _fail(f"out {tuple(out.shape)} must match query {tuple(query.shape)}")
    if query.stride(2) != 1 or out.stride(2) != 1:
        _fail("query/out head_size axis must be contiguous")
    if block_tables.dtype != i32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        _fail("block_tables must be int32 [seqs, max_blocks] with contiguous rows")
    if seq_lens.dtype != i32 or not seq_lens.is_contiguous() or seq_lens.shape[0] != block_tables.shape[0]:
        _fail("seq_lens must be contiguous int32 with one entry per block table row")
    if not (rows.dtype == seqs.dtype == i64 and rows.dim() == 1 and rows.shape == seqs.shape
            and rows.is_contiguous() and seqs.is_contiguous()):
        _fail("rows/seqs must be contiguous equal-length 1-D int64")


def _fail(what: str) -> None:
    raise ValueError(f"paged decode kernel: {what}")


@functools.cache
def load_decode_kernel() -> DecodeKernel | None:
    """The kernel, built or found on first use; None (and one warning) when neither works."""
    errors = []
    for variant in VARIANTS:
        try:
            kernel = DecodeKernel(build_library(variant))
        except (OSError, RuntimeError) as exc:
            log.debug("CPU paged decode kernel, %s build: %s", variant, exc)
            errors.append(f"{variant}: {exc}")
            continue
        log.info("CPU paged decode kernel: %s %s (%s)", "compiled" if kernel.build.compiled else "found",
                 kernel.build.path, " ".join(kernel.build.flags))
        return kernel
    log.warning("CPU paged decode kernel unavailable, using the torch attention path: %s", "; ".join(errors))
    return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Build the CPU attention kernel into a cache dir.")
    ap.add_argument("--build", action="store_true", help="compile now (default: just report what loads)")
    ap.add_argument("--portable", action="store_true", help="no -march=native (for images run elsewhere)")
    ap.add_argument("--out", type=Path, help="directory (default: the cache dir)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.build:
        start = time.perf_counter()
        b = build_library("portable" if args.portable else "native", args.out)
        took = f" in {time.perf_counter() - start:.2f} s" if b.compiled else ""
        print(f"{'compiled' if b.compiled else 'found'} {b.path}{took} ({' '.join(b.flags)})")
        DecodeKernel(b)  # it loads
        return
    kernel = load_decode_kernel()
    print(kernel.build if kernel else "unavailable")
    sys.exit(0 if kernel else 1)


if __name__ == "__main__":
    main()
