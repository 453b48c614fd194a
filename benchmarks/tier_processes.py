"""The processes of ``benchmarks/tier_capacity.py`` and what is measured of them in a window.

:func:`deployment` starts ``python -m scheduler_svc`` (the engine core, which starts its own
fronts) and one simulated executor process; :func:`run_streams` runs one load generator
(``benchmarks/tier_load.py``) from start to end, :func:`plan_delays` the plan-delay windows,
:func:`run_floor` the same load generator against :func:`floor_server` (the frameworks alone). Each
process's CPU comes from ``/proc`` (``benchmarks/proc_stat.py``), the executor's busy time and
plan delays from its shared counters (``benchmarks/engine_harness.py``).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from benchmarks import engine_harness as h
from benchmarks.proc_stat import MachineTimes, children, cpu_seconds
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from testing.tokenizers import small_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SEQS = 256  # --max-num-seqs
HTTP_MAX_BODY = 8 << 20  # the server's default --http-max-body-bytes, given explicitly
# KV blocks of the simulated executor: an 8B model's KV cache on one H200 (~1M tokens), which also
# holds every request of a phase (a request at max_model_len takes 8K blocks).
NUM_BLOCKS = 1 << 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Deployment:
    """The running processes and what the benchmark reads of them."""

    scheduler: subprocess.Popen
    executor: mp.Process
    stats: object  # the executor's shared counters (engine_harness.STATS_LEN)
    step_time: object  # the executor's step time in seconds (shared; set between phases)
    grpc_target: str
    http_target: str
    model_dir: Path
    vocab: int

    @property
    def fronts(self) -> list[int]:
        return children(self.scheduler.pid, "scheduler_svc.entrypoints.front")

    def snapshot(self) -> dict:
        # (the scheduler process is the first engine core; this benchmark runs one)
        return {"core": cpu_seconds(self.scheduler.pid), "fronts": {p: cpu_seconds(p) for p in self.fronts},
                "executor": cpu_seconds(self.executor.pid), "machine": MachineTimes.now(),
                "wall": time.perf_counter()}

    def zero_stats(self) -> None:
        with self.stats.get_lock():
            self.stats[:] = [0.0] * h.STATS_LEN

    def read_stats(self) -> list[float]:
        with self.stats.get_lock():
            return list(self.stats)


def corpus_ids(tok) -> list[int]:
    """The tiny model's English-like corpus as tokens: what the simulated sequences generate, so
    that the fronts detokenize text (most tokens from the token-text table), not random ids."""
    from executor_svc.tiny_model import CORPUS

    return tok.encode(CORPUS.read_text(), add_special_tokens=False).ids


@contextlib.contextmanager
def deployment(workdir: Path, fronts: int, max_model_len: int, num_blocks: int,
               stream_interval: int = 1) -> Iterator[Deployment]:
    tok, eos = small_tokenizer()
    model = workdir / "model"
    model.mkdir()
    tok.save(str(model / "tokenizer.json"))  # no weights: the first executor fixes the served model
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "eos_token_id": eos}))
    grpc_port, http_port, executor_port = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "scheduler_svc", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(grpc_port), "--http-host", "127.0.0.1", "--http-port", str(http_port),
           "--executor-port", str(executor_port), "--metrics-port", "0", "--api-server-count", str(fronts),
           "--max-num-seqs", str(SEQS), "--max-queued-requests", "100000",
           "--stream-interval", str(stream_interval),
           "--http-max-body-bytes", str(HTTP_MAX_BODY), "--log-level", "WARNING"]
    with open(workdir / "scheduler.log", "wb") as log:
        scheduler = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    ctx = mp.get_context("spawn")
    stats, step_time = ctx.Array("d", h.STATS_LEN), ctx.Value("d", 0.005)
    executor = ctx.Process(target=h.executor_process, daemon=True,
                           args=(f"tcp://127.0.0.1:{executor_port}", "sim0", tok.get_vocab_size(), eos),
                           kwargs={"stats": stats, "step_time": step_time, "max_model_len": max_model_len,
                                   "num_blocks": num_blocks, "text_ids": corpus_ids(tok)})
    executor.start()
    dep = Deployment(scheduler, executor, stats, step_time, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}",
                     model, tok.get_vocab_size())
    try:
        _wait_ready(dep, fronts, workdir / "scheduler.log")
        yield dep
    finally:
        scheduler.terminate()
        try:
            scheduler.wait(30)
        except subprocess.TimeoutExpired:
            scheduler.kill()
        executor.terminate()
        executor.join(5)


def _wait_ready(dep: Deployment, fronts: int, log: Path, timeout_s: float = 60.0) -> None:
    """Until every front serves both APIs and the executor has registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if dep.scheduler.poll() is not None:
            raise SystemExit(f"the scheduler exited ({dep.scheduler.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with grpc.insecure_channel(dep.grpc_target) as ch:
                info = pb_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
            with urllib.request.urlopen(f"http://{dep.http_target}/v1/models", timeout=2) as resp:
                http_ok = resp.status == 200
            if info.num_executors >= 1 and http_ok and len(dep.fronts) == fronts:
                return
        except (grpc.RpcError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"the deployment was not ready within {timeout_s:.0f}s:\n{log.read_text()[-3000:]}")


# ---------------------------------------------------------------------------- one measured window


def stats_between(a: list[float], b: list[float]) -> list[float]:
    """The executor's counters of the steps between two readings of them (no maximum delay)."""
    d = [y - x for x, y in zip(a, b, strict=True)]
    d[h.FIRST_START], d[h.LAST_END], d[h.MAX_DELAY_S], d[h.LAST_SAMPLED] = a[h.LAST_END], b[h.LAST_END], 0.0, 0.0
    return d


@dataclass
class Window:
    """What each process did between two snapshots, and the executor's counters of its steps."""

    before: dict
    after: dict
    stats: list[float]
    client: dict = field(default_factory=dict)
    label: str = ""

    @property
    def wall(self) -> float:
        return self.after["wall"] - self.before["wall"]

    def cpu(self, role: str) -> float:
        if role == "fronts":
            return sum(c - self.before["fronts"].get(p, 0.0) for p, c in self.after["fronts"].items())
        return self.after[role] - self.before[role]

    def summary(self, tokens: float | None = None) -> dict:
        """``tokens``: what the fronts' CPU is divided by (default: what the clients received)."""
        st = self.stats
        tokens = self.client.get("tokens", 0) if tokens is None else tokens
        steps = max(1.0, st[h.STEPS])
        busy_cpus, steal = self.after["machine"].cpus_since(self.before["machine"])
        ours = (self.cpu("core") + self.cpu("fronts") + self.cpu("executor")) / self.wall
        client_cpus = self.client.get("cpu_s", 0.0) / self.wall
        per_token = (lambda cpu: 1e6 * cpu / tokens) if tokens else (lambda cpu: float("nan"))
        return {
            "label": self.label, "wall_s": self.wall, "steps": int(st[h.STEPS]),
            "seqs_per_step": st[h.TOKENS] / steps,
            "busy": st[h.BUSY_S] / max(1e-9, st[h.LAST_END] - st[h.FIRST_START]),
            "max_delay_ms": 1e3 * st[h.MAX_DELAY_S], "mean_delay_ms": 1e3 * st[h.DELAY_SUM_S] / steps,
            "delays_over_1ms": int(st[h.DELAYS_OVER_1MS]), "delays_over_5ms": int(st[h.DELAYS_OVER_5MS]),
            "core_ms_per_step": 1e3 * self.cpu("core") / steps,
            "front_us_per_token": per_token(self.cpu("fronts")),
            "client_us_per_token": per_token(self.client.get("cpu_s", 0.0)),
            "tokens_per_message": tokens / max(1, self.client.get("messages", 0)),
            "tokens": tokens, "failed": self.client.get("failed", 0),
            "cpus_core": self.cpu("core") / self.wall, "cpus_fronts": self.cpu("fronts") / self.wall,
            "cpus_executor": self.cpu("executor") / self.wall, "cpus_client": client_cpus,
            "cpus_machine": busy_cpus, "cpus_others": max(0.0, busy_cpus - ours - client_cpus), "cpus_stolen": steal,
        }


def _client(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.tier_load", *args]


def _stream_args(dep: Deployment, api: str, streams: int, tokens: int, seed: int) -> list[str]:
    return ["stream", "--api", api, "--target", dep.grpc_target if api == "grpc" else dep.http_target,
            "--vocab", str(dep.vocab), "--streams", str(streams), "--tokens", str(tokens), "--seed", str(seed)]


def _result(out: str, err: str) -> dict:
    lines = (out or "").strip().splitlines()
    if not lines:
        raise RuntimeError(f"the load generator printed nothing:\n{(err or '')[-3000:]}")
    return json.loads(lines[-1])


def run_streams(dep: Deployment, api: str, streams: int, tokens: int, step_s: float, label: str,
                seed: int = 0, nice: int = 0) -> dict:
    """One load generator's streams from start to end. The fronts' CPU per token and the client's
    are the whole run's (admission included); the core's CPU per step is its steady state's: from
    the first step that samples every stream to the first that does not (or half the tokens).
    ``nice``: the fronts and the client run at this niceness meanwhile, so that the core and the
    executor have the CPU first, as on machines where they do not share it."""
    dep.step_time.value = step_s
    _wait_idle(dep)
    dep.zero_stats()
    with _niceness(dep.fronts, nice):
        start = dep.snapshot()
        proc = subprocess.Popen(_client(_stream_args(dep, api, streams, tokens, seed)), cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=(lambda: os.nice(nice)) if nice else None)
        steady = _steady_window(dep, proc, streams, tokens // 2)
        out, err = proc.communicate(timeout=1800)
    whole = Window(start, dep.snapshot(), dep.read_stats(), _result(out, err), label)
    if whole.client["failed"] or whole.client["tokens"] != streams * tokens:
        raise RuntimeError(f"{label}: {whole.client}")
    row = whole.summary()
    row["core_ms_per_step_run"] = row["core_ms_per_step"]
    if steady is not None:
        s = steady.summary(tokens=steady.stats[h.TOKENS])
        row |= {"core_ms_per_step": s["core_ms_per_step"], "steady_steps": s["steps"],
                "front_us_per_token_steady": s["front_us_per_token"], "busy_steady": s["busy"]}
    else:
        row["core_ms_per_step"] = float("nan")
    return row


@dataclass
class Floor:
    """``benchmarks/front_floor.py``: the frameworks alone, serving the same calls as the fronts."""

    proc: subprocess.Popen
    grpc_target: str
    http_target: str


@contextlib.contextmanager
def floor_server(step_s: float) -> Iterator[Floor]:
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.front_floor", "--step-ms", str(step_s * 1e3)],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(proc.stdout.readline() or "null")
        if not ports:
            raise RuntimeError(f"benchmarks.front_floor did not start (exit status {proc.wait(10)})")
        yield Floor(proc, f"127.0.0.1:{ports['grpc']}", f"127.0.0.1:{ports['http']}")
    finally:
        proc.stdin.close()  # its signal to stop
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_floor(floor: Floor, api: str, streams: int, tokens: int, vocab: int, label: str, seed: int = 0) -> dict:
    """The same load generator as :func:`run_streams`, against the floor: its CPU per token."""
    cpu0, t0 = cpu_seconds(floor.proc.pid), time.perf_counter()
    target = floor.grpc_target if api == "grpc" else floor.http_target
    out = subprocess.run(_client(["stream", "--api", api, "--target", target, "--vocab", str(vocab), "--streams",
                                  str(streams), "--tokens", str(tokens), "--seed", str(seed)]),
                         cwd=ROOT, capture_output=True, text=True, timeout=1800)
    client = _result(out.stdout, out.stderr)
    if client["failed"] or client["tokens"] != streams * tokens:
        raise RuntimeError(f"{label}: {client}")
    wall = time.perf_counter() - t0
    return {"label": label, "wall_s": wall, "front_us_per_token": 1e6 * (cpu_seconds(floor.proc.pid) - cpu0) / client["tokens"],
            "tokens_per_message": client["tokens"] / max(1, client["messages"]),
            "client_us_per_token": 1e6 * client["cpu_s"] / client["tokens"]}


@contextlib.contextmanager
def _niceness(pids: list[int], nice: int) -> Iterator[None]:
    """``pids`` at niceness ``nice`` for the block (restored after: lowering it needs CAP_SYS_NICE)."""
    before = {p: os.getpriority(os.PRIO_PROCESS, p) for p in pids}
    for p in pids:
        os.setpriority(os.PRIO_PROCESS, p, nice)
    try:
        yield
    finally:
        for p, prio in before.items():
            try:
                os.setpriority(os.PRIO_PROCESS, p, prio)
            except PermissionError:
                raise SystemExit("cannot restore the fronts' niceness (needs CAP_SYS_NICE): run the busy phase "
                                 "last, or leave out --busy-nice") from None


def _steady_window(dep: Deployment, proc: subprocess.Popen, streams: int, most_steps: int) -> Window | None:
    """The window in which every step samples all ``streams`` (None if there was none)."""
    while (st := dep.read_stats())[h.LAST_SAMPLED] != streams:
        if proc.poll() is not None:
            return None
        time.sleep(0.02)
    before, a = dep.snapshot(), st
    while proc.poll() is None:
        time.sleep(0.02)
        st = dep.read_stats()
        if st[h.LAST_SAMPLED] != streams or st[h.STEPS] - a[h.STEPS] >= most_steps:
            break
    return Window(before, dep.snapshot(), stats_between(a, st), label="steady")


def _wait_idle(dep: Deployment, quiet_s: float = 0.3, timeout_s: float = 30.0) -> None:
    """Until the executor has run no step for ``quiet_s`` (the last run's requests are gone)."""
    deadline = time.monotonic() + timeout_s
    last, since = dep.read_stats()[h.STEPS], time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        steps = dep.read_stats()[h.STEPS]
        if steps != last:
            last, since = steps, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
    raise RuntimeError("the executor kept stepping: requests of an earlier run are still running")


def _max_size_window(dep: Deployment, repeats: int, only: str | None = None, nice: int = 0) -> Window:
    """The window in which ``tier_load max-size`` sends its requests (built before it opens;
    ``only``: just the request of that name; ``nice``: the client's niceness)."""
    proc = subprocess.Popen(_client(["max-size", "--grpc", dep.grpc_target, "--http", dep.http_target,
                                     "--tokenizer", str(dep.model_dir / "tokenizer.json"),
                                     "--http-max-body-bytes", str(HTTP_MAX_BODY), "--kv-blocks", str(NUM_BLOCKS),
                                     "--repeats", str(repeats), *(["--only", only] if only else [])]),
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"tier_load max-size did not start: {proc.communicate()}")
    dep.zero_stats()
    before = dep.snapshot()
    out, err = proc.communicate("go\n", timeout=1800)
    return Window(before, dep.snapshot(), dep.read_stats(), _result(out, err), only or "maximum-size requests")


def plan_delays(dep: Deployment, streams: int, step_s: float, baseline_s: float, repeats: int,
                seed: int, each: tuple[str, ...] = (), nice: int = 0) -> tuple[dict, dict, list[dict]]:
    """(baseline window, window of the maximum-size requests, a window of each request named in
    ``each`` alone), under ``streams`` background streams. ``nice``: the fronts and both clients
    run at this niceness, so that the core and the executor have the CPU first (as on machines
    where they do not share it): what is left of a delay is the core's own."""
    dep.step_time.value = step_s
    _wait_idle(dep)
    dep.zero_stats()
    tokens = 8_000  # more than the phase lasts: the background is stopped at its end
    with _niceness(dep.fronts, nice):
        bg = subprocess.Popen(_client(_stream_args(dep, "grpc", streams, tokens, seed)), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=(lambda: os.nice(nice)) if nice else None)
        return _delay_windows(dep, bg, streams, baseline_s, repeats, each, nice)


def _delay_windows(dep: Deployment, bg: subprocess.Popen, streams: int, baseline_s: float, repeats: int,
                   each: tuple[str, ...], nice: int) -> tuple[dict, dict, list[dict]]:
    try:
        while dep.read_stats()[h.TOKENS] < 50 * streams:  # all admitted and decoding
            if bg.poll() is not None:
                raise RuntimeError(f"the background streams ended: {bg.communicate()}")
            time.sleep(0.05)
        dep.zero_stats()
        before = dep.snapshot()
        time.sleep(baseline_s)
        base = Window(before, dep.snapshot(), dep.read_stats(), label="no other requests")
        big = _max_size_window(dep, repeats, nice=nice)
        alone = [_max_size_window(dep, repeats, name, nice) for name in each]
    finally:
        bg.kill()
        bg.wait()
    return (base.summary() | {"seqs": streams}, big.summary() | {"seqs": streams, "sent": big.client["requests"]},
            [w.summary() | {"seqs": streams, "sent": w.client["requests"]} for w in alone])
