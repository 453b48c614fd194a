"""Real processes for end-to-end tests: a scheduler and executors on loopback.

Each service runs as ``python -m scheduler_svc`` / ``python -m executor_svc``
exactly as deployed, talking real gRPC and real ZeroMQ. Logs go to files in
the test's tmp dir and are printed when a test fails to start a stack.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.channel import open_channel
from pagedserve.demo import terminate
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from pagedserve.wire.enrollment import new_token
from pagedserve.wire.key_files import write_key_pair

# How long a stack may take to come up: each process imports torch and loads the model, and with
# a compiler (or `make test-busy`'s burners) on the same two cores that took over a minute.
START_TIMEOUT_S = 180.0


# make test runs the suite in pytest-xdist workers. A port picked here is free only until its server
# binds it, so each worker picks from its own slices of PORT_SLICE ports (worker k of n: slices
# k, k + n, ...), never within RUN_ROOM of a slice's end: two workers never pick the same port, nor
# one inside the other's runs (an engine core k listens on --executor-port + k).
PORT_SLICE, RUN_ROOM = 128, 64


def _worker_slot() -> tuple[int, int]:
    """(this worker's index, the number of workers); (0, 1) outside xdist."""
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not count.isdigit() or not name.startswith("gw") or not name[2:].isdigit():
        return 0, 1
    return int(name[2:]), max(1, int(count))


def port_is_ours(port: int) -> bool:
    """Whether this worker may pick ``port`` (see PORT_SLICE)."""
    k, n = _worker_slot()
    return n == 1 or ((port // PORT_SLICE) % n == k and port % PORT_SLICE < PORT_SLICE - RUN_ROOM)


def free_port(attempts: int = 10_000) -> int:
    for _ in range(attempts):  # (a quarter of the OS's picks are ours under two workers)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port_is_ours(port):
            return port
    k, n = _worker_slot()
    raise RuntimeError(f"no free port in worker {k} of {n}'s slices after {attempts} picks")


def free_ports(n: int, apart: int = 8) -> list[int]:
    """``n`` free ports at least ``apart`` from each other, ascending: an engine core k listens on
    --executor-port + k, so a neighbour of another port is taken too (and a port picked twice is
    caught by the same rule)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if all(abs(port - p) >= apart for p in ports):
            ports.append(port)
    return sorted(ports)


def stream_tokens(stub, request: pb.GenerateRequest, timeout_s: float, progress: list[int] | None = None,
                  i: int = 0) -> list[int] | grpc.RpcError:
    """One Generate streamed to its end: its token ids (every choice's, as they came) or the
    RpcError it ended with; ``progress[i]``, when given, holds the count so far."""
    toks: list[int] = []
    try:
        for resp in stub.Generate(request, timeout=timeout_s):
            for c in resp.choices:
                toks.extend(c.token_ids)
            if progress is not None:
                progress[i] = len(toks)
    except grpc.RpcError as exc:
        return exc
    return toks


class Stack:
    """One scheduler plus any number of executors, started and stopped by a test."""

    def __init__(self, model: Path, logdir: Path, scheduler_args: list[str] | None = None,
                 secure: bool = True, api_key: str | None = None, tls_ca: Path | None = None,
                 tls_client: tuple[Path, Path] | None = None, enrollment: bool = False,
                 soft_nofile: int | None = None, tree: Path | None = None) -> None:
        """``soft_nofile``: start every process under this soft open-files limit (a login's 1024).
        ``tree``: run the services of another checkout of this repository (an older build)."""
        self.model, self.logdir, self.tree = model, logdir, tree
        self.soft_nofile = soft_nofile
        self.port, self.executor_port, self.http_port = free_ports(3)
        self.scheduler_args = scheduler_args or []
        # The executor link runs CurveZMQ as deployed: the scheduler's own key pair, one key pair per
        # executor, listed in the trusted directory or (enrollment=True) enrolled with a token; the
        # revocation list starts empty.
        self.keys = logdir / "keys"
        self.trusted, self.revoked = self.keys / "trusted", self.keys / "revoked-keys"
        self.token_file: Path | None = self.keys / "enrollment-token" if enrollment else None
        self.scheduler_key_args: list[str] = []
        if secure:
            self.scheduler_key = write_key_pair(self.keys, "scheduler")
            self.trusted.mkdir()
            self.revoked.write_text("# revoked executor keys\n")
            self.scheduler_key_args = ["--curve-secret-key-file", str(self.keys / "scheduler.key_secret"),
                                "--trusted-executor-keys", str(self.trusted), "--revoked-executor-keys", str(self.revoked)]
            if self.token_file is not None:
                self.token_file.write_text(new_token() + "\n")
                self.token_file.chmod(0o600)
                self.scheduler_key_args += ["--enrollment-token-file", str(self.token_file)]
        # How this stack's own client reaches the API (when the scheduler requires keys or TLS).
        self.api_key, self.tls_ca, self.tls_client = api_key, tls_ca, tls_client
        self.scheduler: subprocess.Popen | None = None
        self.executors: dict[str, subprocess.Popen] = {}
        self.channel: grpc.Channel | None = None

    @classmethod
    @contextlib.contextmanager
    def running(cls, model: Path, logdir: Path, scheduler_args: list[str] | None = None,
                executors: tuple[str, ...] = ("ex0",), **options) -> Iterator[Stack]:
        """A ready stack (scheduler + ``executors``), stopped on exit: a module fixture's body.
        ``options``: the constructor's (``secure``, ``api_key``, ``tls_ca``, ``tls_client``)."""
        s = cls(model, logdir, scheduler_args, **options)
        try:
            s.start_scheduler()
            for name in executors:
                s.start_executor(name)
            s.wait_health()
            yield s
        finally:
            s.stop()

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        if self.tree is not None:  # (python -m imports from the working directory first)
            env["PYTHONPATH"] = str(self.tree)
        return subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.tree,
                                preexec_fn=self._limit_files if self.soft_nofile else None)

    def _limit_files(self) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (self.soft_nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    def start_scheduler(self) -> None:
        self.scheduler = self._spawn("scheduler", [
            "-m", "scheduler_svc", "--model", str(self.model), "--host", "127.0.0.1",
            "--port", str(self.port), "--executor-host", "127.0.0.1",
            "--executor-port", str(self.executor_port), "--metrics-port", "0",
            "--heartbeat-interval", "0.5", "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
            *self.scheduler_key_args, *self.scheduler_args])
        self.channel = self.open_channel()
        self.wait_health(liveness=True)

    def executor_key_args(self, name: str) -> list[str]:
        """The key flags of an executor named ``name``: its own key pair (made on first use, kept after),
        trusted by the scheduler unless the stack enrolls executors with its token."""
        if not self.scheduler_key_args:
            return []
        write_key_pair(self.keys / "executors", name, keep_existing=True)
        if self.token_file is None:
            (self.trusted / f"{name}.key").write_bytes((self.keys / "executors" / f"{name}.key").read_bytes())
        args = ["--curve-key-file", str(self.keys / "executors" / f"{name}.key_secret"),
                "--scheduler-public-key-file", str(self.keys / "scheduler.key")]
        return args + (["--enrollment-token-file", str(self.token_file)] if self.token_file is not None else [])

    def start_executor(self, name: str, *extra: str) -> subprocess.Popen:
        proc = self._spawn(name, [
            "-m", "executor_svc", "--model", str(self.model), "--scheduler",
            f"tcp://127.0.0.1:{self.executor_port}", "--device", "cpu", "--executor-id", name,
            "--kv-cache-memory", "64MiB", "--health-port", "0", *self.executor_key_args(name), *extra])
        self.executors[name] = proc
        return proc

    def open_channel(self, **overrides) -> grpc.Channel:
        """A channel to the API with this stack's client credentials (``overrides`` replace them)."""
        args = dict(api_key=self.api_key, tls_ca=self.tls_ca, tls_cert=self.tls_client and self.tls_client[0],
                    tls_key=self.tls_client and self.tls_client[1])
        args.update(overrides)
        return open_channel(f"{'localhost' if args['tls_ca'] else '127.0.0.1'}:{self.port}", **args)

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API (``.../v1`` is what the openai client takes)."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def stub(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(self.channel)

    def health(self, service: str = "pagedserve.v1.Generation") -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status

    def wait_health(self, liveness: bool = False, timeout_s: float = START_TIMEOUT_S) -> None:
        service = "liveness" if liveness else "pagedserve.v1.Generation"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if self.health(service) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{service} not SERVING after {timeout_s}s\n{self.logs()}")

    def wait_executors(self, n: int, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2).num_executors == n:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{n} executors not registered after {timeout_s}s\n{self.logs()}")

    def stats(self) -> pb.Stats:
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=5)

    def stream_all(self, requests: list[pb.GenerateRequest], on_progress: Callable[[list[int]], None] | None = None,
                   timeout_s: float = 180.0) -> list[list[int] | grpc.RpcError]:
        """Each request streamed on a thread of its own: its token ids (every choice's, as they
        came) or the RpcError it ended with. ``on_progress`` runs while they stream, given each
        stream's token count so far (a list the threads keep updating)."""
        results: list = [None] * len(requests)
        progress = [0] * len(requests)

        def run(i: int) -> None:
            results[i] = stream_tokens(self.stub, requests[i], timeout_s, progress, i)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        if on_progress is not None:
            on_progress(progress)
        for t in threads:
            t.join()
        return results

    def wait_blocks_free(self, timeout_s: float = 20.0) -> float:
        """Seconds until no executor holds a block (device or CPU swap) and nothing runs, waits or is
        swapped out (AssertionError after timeout_s). A stream can end at its client before the engine
        has freed the request (a stop string found by the front is aborted at the core after the
        client has its last token)."""
        t0 = time.monotonic()
        while True:
            st = self.stats()
            if (all(e.kv_blocks_used == 0 and e.cpu_blocks_used == 0 for e in st.executors)
                    and st.num_running == st.num_waiting == st.num_swapped == 0):
                return time.monotonic() - t0
            assert time.monotonic() - t0 < timeout_s, f"blocks still held: {st}"
            time.sleep(0.05)

    def _check_alive(self) -> None:
        if self.scheduler is not None and self.scheduler.poll() is not None:
            raise RuntimeError(f"scheduler exited with {self.scheduler.returncode}\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for f in sorted(self.logdir.glob("*.log")):
            out.append(f"----- {f.name}\n" + f.read_text(errors="replace")[-4000:])
        return "\n".join(out)

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        terminate(list(self.executors.values()) + ([self.scheduler] if self.scheduler else []), timeout_s=15)
