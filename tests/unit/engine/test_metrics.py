"""Prometheus metrics: names, counter deltas from engine totals, per-executor series, HTTP export."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine_api import EngineStats, ExecutorStats, FinishReason
from scheduler_svc.telemetry.metrics import Metrics
from scheduler_svc.telemetry.metrics_server import start_metrics_server
from testing.grpc_fakes import example_stats

REQUIRED = [
    "pagedserve:num_requests_running", "pagedserve:num_requests_waiting", "pagedserve:num_requests_swapped",
    "pagedserve:kv_cache_usage_perc", "pagedserve:prefix_cache_queries_total",
    "pagedserve:prefix_cache_hits_total", "pagedserve:num_preemptions_total", "pagedserve:prompt_tokens_total",
    "pagedserve:generation_tokens_total", "pagedserve:request_migrations_total",
    "pagedserve:time_to_first_token_seconds_bucket", "pagedserve:inter_token_latency_seconds_bucket",
    "pagedserve:e2e_request_latency_seconds_bucket", "pagedserve:request_success_total",
    "pagedserve:kv_blocks_shared", "pagedserve:executor_tensor_parallel_size",
]


def samples(m: Metrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(m.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: Metrics, name: str, **labels) -> float:
    return samples(m)[(name, tuple(sorted(labels.items())))]


def test_registries_are_independent_and_names_follow_the_dashboard_style():
    a, b = Metrics(), Metrics()  # two registries in one process: no duplicate-name error
    a.observe_stats(example_stats())
    a.on_finish(FinishReason.STOP, 1.0, 10, 5)
    names = {name for name, _ in samples(a)}
    for required in REQUIRED:
        assert required in names, required
    assert value(b, "pagedserve:num_requests_running") == 0


def test_observe_stats_sets_gauges_and_advances_counters_by_deltas():
    m = Metrics(CollectorRegistry())
    s = example_stats()
    m.observe_stats(s)
    m.observe_stats(s)  # the same totals again: counters must not double
    assert value(m, "pagedserve:num_requests_running") == 3
    assert value(m, "pagedserve:num_requests_swapped") == 1
    assert value(m, "pagedserve:prefix_cache_queries_total") == 1000
    assert value(m, "pagedserve:prefix_cache_hits_total") == 640
    assert value(m, "pagedserve:num_preemptions_total") == 7
    assert value(m, "pagedserve:request_migrations_total") == 2
    assert value(m, "pagedserve:kv_cache_usage_perc", executor="gpu-0") == 0.4
    assert value(m, "pagedserve:kv_blocks_shared", executor="gpu-0") == 30
    assert value(m, "pagedserve:num_executors", state="draining") == 1
    assert value(m, "pagedserve:executor_tensor_parallel_size", executor="gpu-1") == 4  # one executor, 4 ranks
    assert value(m, "pagedserve:executor_tensor_parallel_size", executor="gpu-0") == 1
    s.num_preemptions, s.prefix_cache_hit_tokens = 10, 700
    s.executors = [s.executors[0]]  # gpu-1 left
    m.observe_stats(s)
    assert value(m, "pagedserve:num_preemptions_total") == 10
    assert value(m, "pagedserve:prefix_cache_hits_total") == 700
    assert ("pagedserve:kv_cache_usage_perc", (("executor", "gpu-1"),)) not in samples(m)
    assert ("pagedserve:executor_tensor_parallel_size", (("executor", "gpu-1"),)) not in samples(m)
    assert value(m, "pagedserve:num_executors", state="draining") == 0


def test_zero_sized_pools_report_zero_usage():
    m = Metrics()
    m.observe_stats(EngineStats(executors=[ExecutorStats("x", "ready", 0, 0, 0, 0, 0, 0)]))
    assert value(m, "pagedserve:kv_cache_usage_perc", executor="x") == 0.0


def test_request_events():
    m = Metrics()
    m.on_prompt_tokens(12)
    m.on_first_token(0.05)
    m.on_step_tokens(3, [0.02, 0.03])
    m.on_scheduled(0.01)
    m.on_finish(FinishReason.EOS, 2.0, 12, 3)
    m.on_finish(FinishReason.LENGTH, 3.0, 12, 3)
    m.on_rejected("INVALID_ARGUMENT")
    assert value(m, "pagedserve:prompt_tokens_total") == 12
    assert value(m, "pagedserve:generation_tokens_total") == 3
    assert value(m, "pagedserve:time_to_first_token_seconds_count") == 1
    assert value(m, "pagedserve:inter_token_latency_seconds_count") == 2
    assert value(m, "pagedserve:e2e_request_latency_seconds_sum") == 5.0
    assert value(m, "pagedserve:request_success_total", finished_reason="eos") == 1
    assert value(m, "pagedserve:request_success_total", finished_reason="length") == 1
    assert value(m, "pagedserve:request_rejected_total", code="INVALID_ARGUMENT") == 1


def test_metrics_served_over_http():
    m = Metrics()
    m.on_step_tokens(5, [])
    srv = start_metrics_server(0, m.registry, host="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
    finally:
        srv.close()
    assert "pagedserve:generation_tokens_total 5.0" in body


def test_a_step_of_tokens_is_observed_at_once_in_the_histogram_format():
    m = Metrics()
    m.on_step_tokens(4, [0.01, 0.01, 0.3, 100.0])
    m.on_step_tokens(0, [0.025])
    assert value(m, "pagedserve:generation_tokens_total") == 4
    assert value(m, "pagedserve:inter_token_latency_seconds_count") == 5
    assert value(m, "pagedserve:inter_token_latency_seconds_sum") == pytest.approx(100.345)
    assert value(m, "pagedserve:inter_token_latency_seconds_bucket", le="0.01") == 2  # le: inclusive
    assert value(m, "pagedserve:inter_token_latency_seconds_bucket", le="0.025") == 3
    assert value(m, "pagedserve:inter_token_latency_seconds_bucket", le="0.3") == 4
    assert value(m, "pagedserve:inter_token_latency_seconds_bucket", le="80.0") == 4
    assert value(m, "pagedserve:inter_token_latency_seconds_bucket", le="+Inf") == 5


def test_head_on_the_metrics_port_has_a_gets_headers_and_no_body():
    """aiperf probes /metrics with HEAD; prometheus_client's own answer (405 with a body) made it give up."""
    import socket

    metrics = Metrics()
    server = start_metrics_server(0, metrics.registry, host="127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"HEAD /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            head = b""
            while chunk := sock.recv(65536):
                head += chunk
        status, _, rest = head.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        assert status.split()[1] == b"200" and body == b""
        length = next(int(line.split(b":")[1]) for line in headers.split(b"\r\n") if line.lower().startswith(b"content-length"))
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        assert abs(len(got.partition(b"\r\n\r\n")[2]) - length) < 200  # (a scrape's timestamps may move)
    finally:
        server.close()


def _tokens_family(n: float) -> list:
    return [("pagedserve:generation_tokens", "counter", "Tokens generated.",
             [("pagedserve:generation_tokens_total", [], n)])]


def _total(families: list) -> float:
    return sum(v for f in families for _, _, v in f[3])


def test_a_front_that_reconnects_is_not_counted_twice_and_one_that_restarted_is_not_forgotten():
    """The core sums its fronts' counters, keeping those of fronts gone. The same front process
    dropped for silence and back (a network blip) goes on from its own totals: they must not be
    added to what was kept of it. One restarted under the same id starts from 0: what it had
    counted stays."""
    from pagedserve.wire import front_messages as fm
    from scheduler_svc.engine.front_link import FrontLink, RemoteFront

    class Core:
        def abort_owned_by(self, front) -> int:
            return 0

    link = FrontLink(Core(), "inproc://metrics-test")  # type: ignore[arg-type]

    def join(identity: bytes, counted: float, incarnation: int = 11) -> RemoteFront:
        front = link.fronts[identity] = RemoteFront(link, identity, "front-a", incarnation)
        link._dispatch(front, fm.FrontMetrics(_tokens_family(counted)))
        return front

    link._drop(join(b"1", 5), "silent")
    assert _total(link.front_families()) == 5  # (gone: its counters kept)
    again = join(b"2", 7)  # the same process, 2 more tokens since
    assert _total(link.front_families()) == 7
    link._drop(again, "exited")
    restarted = join(b"3", 1, incarnation=12)  # restarted under the same id
    assert _total(link.front_families()) == 8
    link._drop(restarted, "exited")
    join(b"4", 9, incarnation=13)  # restarted again, and already past its former totals when first heard
    assert _total(link.front_families()) == 17


def test_sources_keep_a_restarted_sources_counters():
    from scheduler_svc.telemetry.families import CumulativeSources

    s = CumulativeSources()
    s.update(1, _tokens_family(10))
    s.update(2, _tokens_family(3))
    assert _total(s.total()) == 13
    s.update(1, _tokens_family(2))  # core 1 restarted: its counters start again
    assert _total(s.total()) == 15
    s.update(1, _tokens_family(4))
    assert _total(s.total()) == 17


def test_sources_gone_past_the_bound_are_folded_and_one_back_counts_from_its_return():
    from scheduler_svc.telemetry.families import CumulativeSources

    s = CumulativeSources(max_gone=2)
    for key in range(5):  # a rollout: five fronts, each gone after counting 10 + key
        s.update(key, _tokens_family(10 + key))
        s.gone(key)
    assert _total(s.total()) == 60  # nothing lost
    assert len(s._last) == 2  # the three gone longest are in the base, no longer held one by one
    s.update(0, _tokens_family(15))  # folded away, yet back (the same process): 5 more since it went
    assert _total(s.total()) == 60  # counts from its return: never twice
    s.update(0, _tokens_family(18))
    assert _total(s.total()) == 63
    s.gone(0)
    assert _total(s.total()) == 63
    s.update(4, _tokens_family(20))  # still held: goes on from its last totals
    assert _total(s.total()) == 69
    s.update(4, _tokens_family(1))  # restarted
    assert _total(s.total()) == 70


def test_each_hello_carries_its_process_incarnation_and_the_metrics_are_kept_by_it():
    from pagedserve.engine_api import EngineStats
    from pagedserve.wire import front_messages as fm
    from scheduler_svc.engine.front_link import FrontLink
    from scheduler_svc.front.core_link import RemoteCore

    class Core:
        failure = None

        def is_ready(self) -> bool:
            return True

        def model_info(self):
            return None

        def stats(self) -> EngineStats:
            return EngineStats()

        def health_problem(self):
            return None

    sent: list = []
    link = FrontLink(Core(), "inproc://hello-test")  # type: ignore[arg-type]
    link._sock = type("Sock", (), {"send_multipart": lambda self, frames: sent.append(frames)})()
    link._hello(b"1", fm.FrontHello("front-a", fm.TIER_VERSION, 4242))
    reply = fm.TIER.decode(sent[0][1], accept=fm.FROM_CORE)
    assert (reply.accepted, reply.incarnation) == (True, fm.INCARNATION) and fm.INCARNATION > 0
    assert link.fronts[b"1"].metrics_key == ("front-a", 4242)
    remote = RemoteCore("inproc://unused", "front-a")
    remote._dispatch(reply)
    assert remote.incarnation == fm.INCARNATION


def test_the_families_vllms_dashboards_read_are_also_under_vllms_names_with_the_model():
    """with_vllm_names: each of VLLM_NAMES' families is copied under vLLM's name (sample names
    and all, the model_name label added), the rest untouched; before a model is known, nothing."""
    from scheduler_svc.telemetry.families import VLLM_NAMES, families_of, with_vllm_names

    m = Metrics()
    m.on_prompt_tokens(7)
    m.on_finish(FinishReason.STOP, 0.5, 7, 3)
    families = families_of(m.registry)
    assert with_vllm_names(families, None) == families
    named = {f[0]: f for f in with_vllm_names(families, "tiny")}
    assert set(named) == {f[0] for f in families} | set(VLLM_NAMES.values())
    ours, theirs = named["pagedserve:prompt_tokens"], named["vllm:prompt_tokens"]
    assert theirs[1] == ours[1] == "counter"
    assert [(s, [tuple(kv) for kv in labels], v) for s, labels, v in theirs[3]] == [
        ("vllm:prompt_tokens_total", [("model_name", "tiny")], 7.0)]
    e2e = {s: v for s, labels, v in named["vllm:e2e_request_latency_seconds"][3] if s.endswith("_count")}
    assert e2e == {"vllm:e2e_request_latency_seconds_count": 1.0}
    success = [(s, [tuple(kv) for kv in labels], v) for s, labels, v in named["vllm:request_success"][3]]
    assert success == [("vllm:request_success_total", [("model_name", "tiny"), ("finished_reason", "stop")], 1.0)]
