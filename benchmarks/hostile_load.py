"""What a benign client feels while the server is attacked (issue #44).

    .venv/bin/python -m benchmarks.hostile_load [--seconds 4] [--quick]

Starts the stack (scheduler with its HTTP front, one CPU executor, a small random-weight model)
with every process under a soft open-files limit of 1024, as a Linux login starts it. A benign
greedy HTTP completion (a new connection each time, as a new client) and a benign gRPC stream
repeat throughout. First alone (idle), then during each attack in turn:

* ``ids_8mb``, ``stop_8mb``, ``tools_8mb``, ``text_8mb``: 10 concurrent clients each sending 8 MB
  bodies (a prompt of token ids, a list of stop strings, nested tools, prompt text), again and
  again;
* ``at_cap_ids``, ``at_cap_stop``: the same with bodies just under the body cap, of token ids or
  of stop strings (decoded in the front's parse worker, then a 400);
* ``grpc_ids``: 10 concurrent gRPC requests of 3.9 M prompt ids;
* ``grpc_at_cap_stop``: 10 concurrent gRPC requests of stop strings just under the model's
  message cap (parsed in the parse worker, then refused);
* ``held_connections``: 1,000 kept-alive connections, each ``GET /health`` then a CRLF every 2 s;
* ``metrics_flood``: 10 clients scraping the scheduler's ``--metrics-port`` (open to the cluster,
  no key) back to back, each on a new connection, plus 1,000 connections opened there and left silent;
* ``api_metrics_flood``: 10 clients scraping ``/metrics`` on the API's HTTP port (open, like
  ``/health``) back to back on kept-alive connections.

Reports each benign latency (p50, p99, worst) against idle, new clients that failed (reset,
refused, or no answer), the RSS growth of every process, and whether the benign outputs stayed
those of the idle run. The last line is JSON; targets (2 vCPUs): benign worst <= max(0.25 s, 4 x
idle), 0 failed new clients, RSS growth <= 200 MB, outputs unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from pagedserve.fd_limits import raise_open_files_limit
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from testing.stack import Stack, free_port

SOFT_NOFILE = 1024
EIGHT_MB = 8 << 20
BENIGN_PROMPT = "The quick brown fox"
TARGET_MIN_WORST_S = 0.25
TARGET_RSS_MB = 200


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    from benchmarks.proc_stat import cpu_seconds

    out = {}
    for name, pid in pids.items():
        try:
            out[name] = cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):
            out[name] = 0.0
    return out


def _pids(stack: Stack) -> dict[str, int]:
    """Every process of the stack, named by what it runs: the scheduler, its fronts and engine
    cores, each front's parse worker, the executors."""
    from benchmarks.proc_stat import children

    pids = {"scheduler": stack.scheduler.pid, **{n: p.pid for n, p in stack.executors.items()}}
    todo = [stack.scheduler.pid]
    while todo:
        for c in children(todo.pop()):
            todo.append(c)
            try:
                argv = Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            kind = ("front" if b"scheduler_svc.entrypoints.front" in argv else "core"
                    if b"scheduler_svc.entrypoints.core" in argv else "parse-worker"
                    if any(b"parse_worker" in a for a in argv) else "child")
            pids[f"{kind}-{c}"] = c
    return pids


class Benign:
    """The two benign clients, repeating on their own threads; latencies per phase."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.phase = stack, "idle"
        self.http: dict[str, list[float]] = {}
        self.grpc: dict[str, list[float]] = {}
        self.failures: dict[str, int] = {}
        self.outputs: dict[str, set] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(fn,), daemon=True)
                         for fn in (self._http_once, self._grpc_once)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _loop(self, fn: Callable[[], None]) -> None:
        while not self._stop.is_set():
            fn()
            time.sleep(0.05)

    def _http_once(self) -> None:
        phase, start = self.phase, time.perf_counter()
        body = json.dumps({"model": self.stack.model_name, "prompt": BENIGN_PROMPT, "max_tokens": 8,
                           "temperature": 0}).encode()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.stack.http_port, timeout=30)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            if resp.status != 200:
                raise RuntimeError(f"status {resp.status}")
            self.outputs.setdefault("http", set()).add(json.loads(data)["choices"][0]["text"])
            self.http.setdefault(phase, []).append(time.perf_counter() - start)
        except Exception:  # noqa: BLE001  a new client that was reset, refused or failed
            self.failures[phase] = self.failures.get(phase, 0) + 1

    def _grpc_once(self) -> None:
        phase, start = self.phase, time.perf_counter()
        req = pb.GenerateRequest(prompt=BENIGN_PROMPT, sampling=pb.SamplingParams(max_tokens=8, temperature=0.0))
        try:
            toks = [t for r in self.stack.stub.Generate(req, timeout=30) for c in r.choices for t in c.token_ids]
            self.outputs.setdefault("grpc", set()).add(tuple(toks))
            self.grpc.setdefault(phase, []).append(time.perf_counter() - start)
        except grpc.RpcError:
            self.failures[phase] = self.failures.get(phase, 0) + 1


def _send_raw(port: int, head: bytes, body: bytes) -> None:
    """A request sent as an attacker does (the whole body, whatever the server answers meanwhile)."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))
        view = memoryview(body)
        for i in range(0, len(body), 1 << 20):
            s.sendall(view[i:i + (1 << 20)])
        s.recv(4096)


def _attack_body(kind: str, model: str, cap: int) -> bytes:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": [[[]] * 64] * 64}}}]
    doc = {"ids_8mb": {"model": model, "prompt": list(range(1_150_000))},
           "stop_8mb": {"model": model, "prompt": "a", "stop": ["ab"] * 1_300_000},
           "tools_8mb": {"model": model, "messages": [{"role": "user", "content": "a"}], "tools": tools * 950},
           "text_8mb": {"model": model, "prompt": "word " * (EIGHT_MB // 5)},
           "at_cap_ids": {"model": model, "prompt": list(range(10_000, 10_000 + cap // 8))},
           "at_cap_stop": {"model": model, "prompt": "a", "stop": ["ab"] * (cap // 6)}}[kind]
    return json.dumps(doc).encode()


def _attacker(kind: str, http_port: int, grpc_target: str, model: str, cap: int, connections: int, stop,
              ready, metrics_port: int = 0) -> None:
    """One attacking process (its own GIL: the benign clients' latencies are the server's alone);
    ``ready`` counts the processes set up to attack."""
    if kind == "held_connections":
        raise_open_files_limit()
        _held_connections(http_port, connections, stop, ready)
    elif kind == "metrics_flood":
        _metrics_flood(metrics_port, connections // 10, stop, ready)
    elif kind == "api_metrics_flood":
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
        _count(ready)
        while not stop.is_set():
            try:
                conn.request("GET", "/metrics")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=30)
    elif kind.startswith("grpc_"):
        if kind == "grpc_ids":  # 3.9 M ids of one byte each: just under gRPC's 4 MiB message limit
            req = pb.GenerateRequest(prompt_token_ids=[i % 100 for i in range(3_900_000)],
                                     sampling=pb.SamplingParams(max_tokens=1))
        else:  # stop strings filling a message just under the model's cap: parsed, then refused
            stops = ["ab"] * ((cap - 1024) // 4)  # 4 bytes each
            req = pb.GenerateRequest(prompt="a", sampling=pb.SamplingParams(max_tokens=1, stop=stops))
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(grpc_target, options=[
            ("grpc.max_send_message_length", 8 << 20)]))
        _count(ready)
        while not stop.is_set():
            with contextlib.suppress(grpc.RpcError):
                list(stub.Generate(req, timeout=30))
    else:
        body = _attack_body(kind, model, cap)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        _count(ready)
        while not stop.is_set():
            _send_raw(http_port, head, body)


def _count(ready) -> None:
    with ready.get_lock():
        ready.value += 1


def _held_connections(port: int, n: int, stop, ready) -> None:
    socks = []
    for _ in range(n):
        with contextlib.suppress(OSError):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(s)
    _count(ready)
    while not stop.wait(2.0):
        for s in socks:
            with contextlib.suppress(OSError):
                s.sendall(b"\r\n")
    for s in socks:
        s.close()


def _metrics_flood(port: int, silent: int, stop, ready) -> None:
    raise_open_files_limit()
    held = []
    for _ in range(silent):
        with contextlib.suppress(OSError):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    _count(ready)
    while not stop.is_set():
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            while s.recv(65536):
                pass
    for s in held:
        s.close()


ATTACKS = ("ids_8mb", "stop_8mb", "tools_8mb", "text_8mb", "at_cap_ids", "at_cap_stop", "grpc_ids",
           "grpc_at_cap_stop", "held_connections", "metrics_flood", "api_metrics_flood")


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "p50_s": round(statistics.median(xs), 4),
            "p99_s": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))], 4), "worst_s": round(xs[-1], 4)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="length of the idle phase and of each attack")
    ap.add_argument("--connections", type=int, default=1000, help="held connections of the last attack")
    ap.add_argument("--quick", action="store_true", help="1 s phases, 300 held connections (run_all --quick)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help="a comma-separated subset of " + ", ".join(ATTACKS))
    a = ap.parse_args(argv)
    attacks = tuple(a.attacks.split(","))
    if not set(attacks) <= set(ATTACKS):
        ap.error(f"--attacks: unknown {sorted(set(attacks) - set(ATTACKS))}")
    if a.quick:
        a.seconds, a.connections = 1.0, 300
    raise_open_files_limit()  # this process holds the attack's sockets; the stack starts under 1024
    from executor_svc.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        model = build_tiny_model(Path(d) / "model", "llama", "small")
        stack = Stack(model, Path(d), secure=False, soft_nofile=SOFT_NOFILE,
                      scheduler_args=["--metrics-port", str(metrics_port := free_port())])
        try:
            stack.start_scheduler()
            stack.start_executor("ex0")
            stack.wait_health()
            info = stack.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            stack.model_name = info.model_name
            print(json.dumps(run_attacks(stack, info.max_model_len, a.seconds, a.connections, attacks, metrics_port)))
        finally:
            stack.stop()


def run_attacks(stack: Stack, max_model_len: int, seconds: float, connections: int,
                attacks: tuple[str, ...] = ATTACKS, metrics_port: int = 0) -> dict:
    import multiprocessing as mp

    from scheduler_svc.front.http.limits import HttpLimits, body_cap

    port, name = stack.http_port, stack.model_name
    cap = body_cap(HttpLimits(), max_model_len)
    ctx = mp.get_context("spawn")  # the parent holds gRPC channels: never fork it
    benign = Benign(stack)
    benign.start()
    time.sleep(seconds)
    pids = _pids(stack)  # (after the first requests: whatever a front starts lazily is running)
    rss0 = {n: _rss_mb(p) for n, p in pids.items()}
    rss_peak = dict(rss0)
    cpu: dict[str, dict[str, float]] = {}  # per attack: each process's CPUs used while it ran
    print(f"after the idle phase: RSS MB {({n: round(_rss_mb(p), 1) for n, p in pids.items()})}", flush=True)
    for attack in attacks:
        benign.phase = "setup"  # (attackers importing and building bodies: not counted)
        stop, ready = ctx.Event(), ctx.Value("i", 0)
        procs = [ctx.Process(target=_attacker, args=(attack, port, f"127.0.0.1:{stack.port}", name, cap, connections,
                                                      stop, ready, metrics_port), daemon=True)
                 for _ in range(1 if attack == "held_connections" else 10)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 60
        while ready.value < len(procs) and time.monotonic() < deadline:  # set up (imports, bodies, sockets)
            time.sleep(0.05)
        benign.phase = attack
        cpu0 = _cpu(pids)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.25)
            for n, p in pids.items():
                with contextlib.suppress(FileNotFoundError):
                    rss_peak[n] = max(rss_peak[n], _rss_mb(p))
        benign.phase = "setup"
        cpu[attack] = {n: round((c - cpu0[n]) / seconds, 3) for n, c in _cpu(pids).items()}
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        print(f"{attack}: http {_stats(benign.http.get(attack, []))} grpc {_stats(benign.grpc.get(attack, []))} "
              f"failed {benign.failures.get(attack, 0)}, peak RSS MB {rss_peak}, CPUs {cpu[attack]}", flush=True)
    benign.phase = "after"
    time.sleep(seconds)
    benign.stop()
    idle_http, idle_grpc = _stats(benign.http.get("idle", [])), _stats(benign.grpc.get("idle", []))
    report: dict = {"idle_http": idle_http, "idle_grpc": idle_grpc, "body_cap": cap}
    ok = True
    for attack in attacks:
        h, g = _stats(benign.http.get(attack, [])), _stats(benign.grpc.get(attack, []))
        fails = benign.failures.get(attack, 0)
        bound_h = max(TARGET_MIN_WORST_S, 4 * idle_http.get("p50_s", 0))
        bound_g = max(TARGET_MIN_WORST_S, 4 * idle_grpc.get("p50_s", 0))
        met = h.get("worst_s", 1e9) <= bound_h and g.get("worst_s", 1e9) <= bound_g and fails == 0
        ok &= met
        report[attack] = {"http": h, "grpc": g, "failed_new_clients": fails, "met": met, "cpus": cpu[attack]}
    growth = {n: round(rss_peak[n] - rss0[n], 1) for n in pids}
    report["rss_growth_mb"] = growth
    report["outputs_unchanged"] = all(len(v) == 1 for v in benign.outputs.values()) and len(benign.outputs) == 2
    report["failed_after"] = benign.failures.get("after", 0)
    report["pass"] = bool(ok and max(growth.values()) <= TARGET_RSS_MB and report["outputs_unchanged"])
    return report


if __name__ == "__main__":
    main()
