"""A local stand-in for a cluster, for tests/deploy: run a rendered Deployment's pods as local
processes (each port a free loopback port, each volume a directory), with the Secrets the operator
would create, and stream a request through what they serve."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testing.k8s_helpers import Doc, container, container_env, find, pod_spec
from testing.stack import free_port


@dataclass
class LocalPod:
    """One pod of a rendered Deployment, run as local processes: each containerPort of the
    main container gets a free loopback port, each volume a directory."""
    name: str
    workload: Doc
    ports: dict[int, int]  # containerPort -> local port
    volumes: dict[str, Path]  # volume name -> local directory
    proc: subprocess.Popen | None = None
    log: Path | None = None


def _free_run(length: int) -> int:
    """A free port whose next ``length - 1`` ports are free too."""
    while True:
        base, socks = free_port(), []
        try:
            for port in range(base + 1, base + length):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()


class StandIn:
    """Runs rendered pods the way the kubelet would, on loopback: exactly the rendered
    command, args and environment, with these rewrites only: wildcard hosts -> 127.0.0.1,
    containerPorts -> free ports (consecutive ones kept consecutive), `tcp://SERVICE:PORT` -> the local port of the pod behind
    that Service, paths under a volumeMount -> that volume's local directory, and the image's
    console scripts and `python` -> this venv's."""

    def __init__(self, docs: list[Doc], root: Path) -> None:
        self.docs, self.root = docs, root
        self.pods: list[LocalPod] = []
        self.bin = Path(sys.executable).parent

    def pod(self, deployment: str, name: str, shared: dict[str, Path] | None = None) -> LocalPod:
        workload = find(self.docs, "Deployment", deployment)
        wanted = {c["containerPort"] for c in container(workload).get("ports", [])}
        ports: dict[int, int] = {}
        for p in sorted(wanted):
            # Consecutive ports stay consecutive: engine core k listens on the executor port + k.
            if p - 1 in ports:
                ports[p] = ports[p - 1] + 1
            else:
                run = next(k for k in range(1, len(wanted) + 2) if p + k not in wanted)
                ports[p] = _free_run(run)
        volumes = {}
        for v in pod_spec(workload)["volumes"]:
            volumes[v["name"]] = (shared or {}).get(v["name"]) or self.root / name / v["name"]
            volumes[v["name"]].mkdir(parents=True, exist_ok=True)
        pod = LocalPod(name, workload, ports, volumes)
        self.pods.append(pod)
        return pod

    def _path(self, pod: LocalPod, c: Doc, value: str) -> str:
        for m in sorted(c.get("volumeMounts", []), key=lambda m: -len(m["mountPath"])):
            mount = m["mountPath"]
            if value == mount or value.startswith(mount + "/"):
                return str(pod.volumes[m["name"]]) + value[len(mount):]
        return value

    def _service_url(self, match: re.Match) -> str:
        svc = find(self.docs, "Service", match.group(1))
        (port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(match.group(2))]
        for pod in self.pods:
            labels = pod.workload["spec"]["template"]["metadata"]["labels"]
            if svc["spec"]["selector"].items() <= labels.items():
                named = {p["name"]: p["containerPort"] for p in container(pod.workload)["ports"]}
                target = port["targetPort"]
                return f"tcp://127.0.0.1:{pod.ports[named.get(target, target)]}"
        raise AssertionError(f"no local pod behind Service {match.group(1)}")

    def _value(self, pod: LocalPod, c: Doc, value: str, prev: str = "") -> str:
        if value == "0.0.0.0":
            return "127.0.0.1"
        if prev.startswith("--") and value.isdigit() and int(value) in pod.ports:
            return str(pod.ports[int(value)])
        value = re.sub(r"tcp://([a-z0-9-]+):(\d+)", self._service_url, value)
        return self._path(pod, c, value)

    def argv(self, pod: LocalPod, c: Doc, command: list[str] | None = None) -> list[str]:
        raw = command if command is not None else c["command"] + c.get("args", [])
        out = [self._value(pod, c, v, raw[i - 1] if i else "") for i, v in enumerate(raw)]
        if out[0] == "python":
            return [sys.executable, *out[1:]]
        script = self.bin / out[0]
        if not script.exists():
            raise AssertionError(f"{out[0]} is not installed in {self.bin}: run `make setup`")
        return [str(script), *out[1:]]

    def env(self, pod: LocalPod, c: Doc) -> dict[str, str]:
        env = {k: self._value(pod, c, v) for k, v in container_env(self.docs, c, pod.name).items()}
        home = self.root / pod.name / "home"
        home.mkdir(parents=True, exist_ok=True)
        tmp = pod.volumes.get("tmp", self.root / pod.name / "tmp")
        # What the image adds (PATH, its ENV lines); one thread per process on a 2-core machine;
        # PYTHONPATH as given to the tests (to run them against another checkout).
        given = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
        return {"PATH": f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(home),
                "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                "OMP_NUM_THREADS": "1", **given, **env}

    def run_init(self, pod: LocalPod, timeout_s: float = 120, names: tuple[str, ...] | None = None) -> None:
        """Run the pod's init containers in order (only those in ``names``, when given)."""
        for c in pod_spec(pod.workload).get("initContainers", []):
            if names is not None and c["name"] not in names:
                continue
            out = subprocess.run(self.argv(pod, c), env=self.env(pod, c), capture_output=True,
                                 text=True, timeout=timeout_s)
            if out.returncode != 0:
                raise AssertionError(f"init container {c['name']} failed:\n{out.stdout}\n{out.stderr}")

    def start(self, pod: LocalPod, extra_env: dict[str, str] | None = None) -> None:
        c = container(pod.workload)
        pod.log = self.root / f"{pod.name}.log"
        with open(pod.log, "wb") as log:
            pod.proc = subprocess.Popen(self.argv(pod, c), env={**self.env(pod, c), **(extra_env or {})},
                                        stdout=log, stderr=subprocess.STDOUT)

    def probe(self, pod: LocalPod, which: str) -> int:
        """The kubelet's grpc probe: HealthCheck on the probe's port and service."""
        spec = container(pod.workload)[which]["grpc"]
        with grpc.insecure_channel(f"127.0.0.1:{pod.ports[spec['port']]}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=spec.get("service", "")), timeout=2)
        return reply.status

    def wait_probe(self, pod: LocalPod, which: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pod.proc is not None and pod.proc.poll() is not None:
                raise AssertionError(f"{pod.name} exited with {pod.proc.returncode}\n{self.logs()}")
            try:
                if self.probe(pod, which) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"{pod.name} {which} not SERVING after {timeout_s}s\n{self.logs()}")

    def terminate(self, pod: LocalPod) -> tuple[int, bool]:
        """Pod deletion as the kubelet does it: run preStop, then SIGTERM, then SIGKILL when
        terminationGracePeriodSeconds (counted from the start of preStop) runs out.
        Returns (exit code, whether it had to be killed)."""
        assert pod.proc is not None
        c = container(pod.workload)
        deadline = time.monotonic() + pod_spec(pod.workload)["terminationGracePeriodSeconds"]
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        if pre_stop:
            subprocess.run(pre_stop, env=self.env(pod, c), timeout=max(1.0, deadline - time.monotonic()))
        pod.proc.send_signal(signal.SIGTERM)
        try:
            return pod.proc.wait(timeout=max(0.1, deadline - time.monotonic())), False
        except subprocess.TimeoutExpired:
            pod.proc.kill()
            return pod.proc.wait(), True

    def logs(self) -> str:
        return "\n".join(f"----- {p.name}\n" + p.log.read_text(errors="replace")[-4000:]
                         for p in self.pods if p.log is not None and p.log.exists())

    def stop_all(self) -> None:
        for pod in self.pods:
            if pod.proc is not None and pod.proc.poll() is None:
                pod.proc.kill()
                pod.proc.wait()


def operator_objects(root: Path) -> dict[str, Path]:
    """`pagedserve keys kubernetes`'s Secrets and ConfigMaps, each as the directory a volume of it is."""
    out = subprocess.run([str(Path(sys.executable).parent / "pagedserve"), "keys", "kubernetes"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    dirs = {}
    for obj in json.loads(out)["items"]:
        d = dirs[obj["metadata"]["name"]] = root / obj["metadata"]["name"]
        d.mkdir(parents=True)
        for key, value in obj.get("stringData", obj.get("data", {})).items():
            (d / key).write_text(value)
    return dirs


def generate(channel, prompt: str, max_tokens: int) -> tuple[int, int]:
    """One greedy request, streamed to its end: (completion tokens, finish reason)."""
    from pagedserve.v1 import generation_pb2 as pb
    from pagedserve.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens, finish = 0, 0
    for reply in pb_grpc.GenerationStub(channel).Generate(request, timeout=120):
        for choice in reply.choices:
            tokens += len(choice.token_ids)
            finish = choice.finish_reason or finish
    return tokens, finish
