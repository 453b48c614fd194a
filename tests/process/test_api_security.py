"""The public gRPC API's trust boundary, on real processes: API keys, TLS and mutual TLS with a
CA made in the test, malformed messages, and prompts no executor could ever take."""

from __future__ import annotations

import io
import socket
import ssl

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import cli
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from testing.http_fakes import seconds_until_closed
from testing.stack import Stack
from testing.tls_certs import make_pki

pytestmark = pytest.mark.slow
KEY = "key-for-the-tests-0123456789"


def _generate(channel: grpc.Channel) -> list[int]:
    req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(max_tokens=4, temperature=0.0,
                                                                                    ignore_eos=True))
    return [t for r in pb_grpc.GenerationStub(channel).Generate(req, timeout=30) for c in r.choices
            for t in c.token_ids]


def _tls(pki: dict, client: bool = False) -> ssl.SSLContext:
    """What an HTTPS client trusts (the test CA) and, for mutual TLS, presents."""
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    if client:
        ctx.load_cert_chain(str(pki["client_cert"]), str(pki["client_key"]))
    return ctx


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_stack(tiny_llama_dir, tmp_path_factory, pki):
    """TLS and API keys (two keys in the file, with a comment)."""
    logdir = tmp_path_factory.mktemp("tls")
    keys = logdir / "api-keys"
    keys.write_text(f"# keys of the tests\n{KEY}\n\nanother-key-0123456789\n")
    with Stack.running(tiny_llama_dir, logdir, api_key=KEY, tls_ca=pki["ca"], scheduler_args=[
            "--api-key-file", str(keys), "--tls-cert-file", str(pki["server_cert"]),
            "--tls-key-file", str(pki["server_key"]),
            # (the module's tests fail keys on purpose, from one peer; the throttle has its own test)
            "--auth-failure-burst", "1000"]) as s:
        yield s


def test_calls_need_an_api_key_and_health_does_not(tls_stack):
    assert len(_generate(tls_stack.channel)) == 4
    for key in (None, "wrong-key", ""):
        with tls_stack.open_channel(api_key=key) as ch:
            assert _code(lambda: _generate(ch)) == grpc.StatusCode.UNAUTHENTICATED
            assert _code(lambda: pb_grpc.GenerationStub(ch).GetStats(pb.GetStatsRequest(), timeout=5)) \
                == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no key
    with tls_stack.open_channel(api_key="another-key-0123456789") as ch:
        assert len(_generate(ch)) == 4


def test_the_port_speaks_tls_only(tls_stack, pki):
    with grpc.insecure_channel(f"127.0.0.1:{tls_stack.port}") as plain:
        assert _code(lambda: _generate(plain)) == grpc.StatusCode.UNAVAILABLE
    with tls_stack.open_channel(tls_ca=pki["other_ca"]) as untrusted:  # a server we cannot verify
        assert _code(lambda: _generate(untrusted)) == grpc.StatusCode.UNAVAILABLE


def test_the_cli_takes_an_api_key_and_a_ca(tls_stack, pki):
    out, err = io.StringIO(), io.StringIO()
    base = ["--server", f"localhost:{tls_stack.port}", "--tls-ca", str(pki["ca"])]
    assert cli.main([*base, "--api-key", KEY, "generate", "--token-ids", "5,6,7", "--max-tokens", "3",
                     "--ignore-eos"], out, err) == 0, err.getvalue()
    assert "completion_tokens=3" in err.getvalue()
    err = io.StringIO()
    assert cli.main([*base, "stats"], io.StringIO(), err) == 1 and "UNAUTHENTICATED" in err.getvalue()


def test_mutual_tls_requires_a_client_certificate(tiny_llama_dir, tmp_path, pki):
    s = Stack(tiny_llama_dir, tmp_path, tls_ca=pki["ca"], tls_client=(pki["client_cert"], pki["client_key"]),
              scheduler_args=["--tls-cert-file", str(pki["server_cert"]), "--tls-key-file", str(pki["server_key"]),
                              "--tls-client-ca-file", str(pki["ca"])])
    try:
        s.start_scheduler()
        s.start_executor("ex0")
        s.wait_health()
        assert len(_generate(s.channel)) == 4
        with s.open_channel(tls_cert=None, tls_key=None) as anonymous:
            assert _code(lambda: _generate(anonymous)) == grpc.StatusCode.UNAVAILABLE
        import httpx2 as httpx

        url = f"https://localhost:{s.http_port}/health"
        assert httpx.get(url, verify=_tls(pki, client=True), timeout=10).status_code == 200
        with pytest.raises(httpx.HTTPError):  # the HTTP front requires the client certificate too
            httpx.get(url, verify=_tls(pki), timeout=10)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, tmp_path_factory):
    with Stack.running(tiny_llama_dir, tmp_path_factory.mktemp("plain")) as s:
        yield s


@pytest.mark.parametrize("payload", [b"\xff\xff\xff", b"\x0a\x05abc", b"\x12\x80\x80\x80\x80\x10"])
def test_a_malformed_message_is_invalid_argument(plain, payload):
    call = plain.channel.unary_stream("/pagedserve.v1.Generation/Generate")  # raw bytes, no serializer
    with pytest.raises(grpc.RpcError) as e:
        list(call(payload, timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid pagedserve.v1.GenerateRequest" in e.value.details()
    assert len(_generate(plain.channel)) == 4


def test_the_http_front_takes_the_same_keys_and_tls(tls_stack, pki):
    import httpx2 as httpx  # the HTTP client the openai package is built on
    import openai

    url = f"https://localhost:{tls_stack.http_port}"
    with httpx.Client(verify=_tls(pki), timeout=30) as http:
        assert http.get(f"{url}/health").status_code == 200  # probes carry no key
        for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
            r = http.get(f"{url}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        r = http.post(f"{url}/v1/completions", json={"model": "x", "prompt": "hi"})
        assert r.status_code == 401  # refused before the body is read or the model checked
        assert http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0,
                           http_client=httpx.Client(verify=_tls(pki), timeout=60))
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=4, temperature=0)
    assert chat.usage.completion_tokens >= 1
    with httpx.Client(timeout=10) as plain:  # plaintext against the TLS port
        with pytest.raises(httpx.HTTPError):
            plain.get(f"http://127.0.0.1:{tls_stack.http_port}/health")


def test_a_burst_of_maximum_size_prompts_is_refused_unread_and_memory_comes_back(plain):
    """20 prompts just under gRPC's 4 MiB message limit, at once: each is larger than the tiny
    model's config allows a request to need (max_position_embeddings x 16 + 1 MiB), so grpc core
    refuses it RESOURCE_EXHAUSTED from its length prefix (never read whole, parsed or tokenized),
    and the scheduler's memory returns to its baseline."""
    from concurrent.futures import ThreadPoolExecutor

    def rss_mib() -> float:
        with open(f"/proc/{plain.scheduler.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    baseline = rss_mib()
    stub = pb_grpc.GenerationStub(plain.channel)
    prompt = "All work and no play makes Jack a dull boy. " * (3_900_000 // 44)

    def send(i: int) -> grpc.StatusCode:
        req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=4))
        return _code(lambda: list(stub.Generate(req, timeout=60)))

    with ThreadPoolExecutor(max_workers=20) as pool:
        codes = list(pool.map(send, range(20)))
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 20
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(prompt=prompt), timeout=60))
    assert "larger than max" in e.value.details()  # (grpc core's words: grpc/limits.max_receive_bytes)
    assert rss_mib() - baseline < 64, (baseline, rss_mib())
    assert len(_generate(plain.channel)) == 4


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir, tmp_path_factory):
    """API keys, a small allowance of failed keys, two calls at once, short idle bounds."""
    logdir = tmp_path_factory.mktemp("guarded")
    keys = logdir / "api-keys"
    keys.write_text(f"{KEY}\n")
    with Stack.running(tiny_llama_dir, logdir, api_key=KEY, scheduler_args=[
            "--api-key-file", str(keys), "--auth-failure-burst", "3", "--auth-failure-refill-s", "60",
            "--max-concurrent-calls", "2", "--http-keep-alive-timeout-s", "1", "--grpc-idle-timeout-s", "1"]) as s:
        yield s


def _keyed_generate(channel: grpc.Channel, key: str, max_tokens: int = 4):
    req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return pb_grpc.GenerationStub(channel).Generate(req, metadata=[("authorization", f"Bearer {key}")], timeout=60)


def test_key_guesses_are_throttled_per_peer_across_both_fronts(guarded):
    """One peer (127.0.0.3, through a relay: grpc's client cannot pick its address) guesses keys on
    the gRPC front: 3 failures, then RESOURCE_EXHAUSTED, and its HTTP calls get 429 too (one table),
    even with the right key; health stays open to it, and 127.0.0.1 is served on both fronts."""
    import httpx2 as httpx

    from testing.tcp_relay import Relay

    relay = Relay(guarded.port, "127.0.0.3")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{relay.port}") as guesser:
            codes = [_code(lambda i=i: list(_keyed_generate(guesser, f"wrong-key-{i}"))) for i in range(4)]
            assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED]
            assert _code(lambda: list(_keyed_generate(guesser, KEY))) == grpc.StatusCode.RESOURCE_EXHAUSTED
            health = health_pb2_grpc.HealthStub(guesser).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        relay.close()
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.3"), timeout=30) as http:
        r = http.get(f"{guarded.http_url}/v1/models", headers=headers)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_failed_api_keys"
        assert int(r.headers["retry-after"]) > 50
        assert http.get(f"{guarded.http_url}/health").status_code == 200
    with httpx.Client(timeout=30) as http:
        assert http.get(f"{guarded.http_url}/v1/models", headers=headers).status_code == 200
    assert len(_generate(guarded.channel)) == 4


def test_calls_are_capped_and_idle_connections_closed_in_the_process(guarded):
    import httpx2 as httpx

    from testing import h2_raw

    streams = [_keyed_generate(guarded.channel, KEY, max_tokens=4000) for _ in range(2)]
    try:
        for s in streams:
            next(s)  # two calls in progress: the cap
        assert _code(lambda: list(_keyed_generate(guarded.channel, KEY))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        with httpx.Client(timeout=30) as http:
            r = http.post(f"{guarded.http_url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["code"] == "max_concurrent_calls"
            assert http.get(f"{guarded.http_url}/health").status_code == 200
    finally:
        for s in streams:
            s.cancel()
    with socket.create_connection(("127.0.0.1", guarded.http_port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert seconds_until_closed(sock, 8, b"\r\n") < 3  # a CRLF every 0.3 s does not keep it
    with h2_raw.connect(guarded.port) as sock:
        assert h2_raw.seconds_until_closed(sock, 8, h2_raw.window_update(), every_s=0.2) < 3
    assert len(_generate(guarded.channel)) == 4  # the calls' slots came back
