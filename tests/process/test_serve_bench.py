"""pagedserve-bench: its statistics, its workloads, and one short run against a real stack."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pagedserve.bench.loadgen import build_trace, main, parse_range, parse_rate
from pagedserve.bench.stats import RequestResult, distribution, format_report, json_safe, summarize
from pagedserve.v1 import generation_pb2 as pb
from testing.stack import Stack


def _result(rid: str, send: float, chunks: list[tuple[float, int]], prompt_len: int = 10,
            max_tokens: int | None = None, error: str | None = None) -> RequestResult:
    r = RequestResult(rid, prompt_len, max_tokens if max_tokens is not None else sum(k for _, k in chunks),
                      send_time=send, end_time=chunks[-1][0] if chunks else send + 1.0, error=error)
    r.chunk_times = [t for t, _ in chunks]
    r.chunk_tokens = [k for _, k in chunks]
    return r


def test_summarize_throughput_and_normalized_latency():
    a = _result("a", 0.0, [(1.0, 1), (2.0, 1), (3.0, 2)])  # 4 tokens, latency 3 s
    b = _result("b", 1.0, [(1.5, 1), (3.0, 1)], prompt_len=20)  # 2 tokens, latency 2 s
    s = summarize([a, b], duration_s=4.0)
    assert s["completed"] == 2 and s["failed"] == 0
    assert s["total_output_tokens"] == 6 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(1.5)
    assert s["total_token_throughput"] == pytest.approx(9.0)
    # The paper's normalized latency: mean of latency / output length, per request.
    assert s["normalized_latency_s_per_token"] == pytest.approx((3 / 4 + 2 / 2) / 2)
    assert s["ttft_ms"]["mean"] == pytest.approx(1000 * (1.0 + 0.5) / 2)
    assert s["e2e_latency_ms"]["p50"] == pytest.approx(2500.0)


def test_itl_splits_a_multi_token_message_evenly_and_tpot_spans_first_to_last():
    r = _result("a", 0.0, [(1.0, 1), (1.2, 1), (2.0, 4)])
    assert r.itls() == pytest.approx([0.2, 0.2, 0.2, 0.2, 0.2])
    assert r.tpot() == pytest.approx(1.0 / 5)
    assert _result("b", 0.0, [(1.0, 1)]).tpot() is None  # one token: no time per output token


def test_failed_and_empty_requests_are_counted_but_left_out_of_the_statistics():
    ok = _result("ok", 0.0, [(0.5, 2)])
    failed = _result("bad", 0.0, [(0.2, 1)], error="UNAVAILABLE: no executor")
    empty = _result("empty", 0.0, [])
    s = summarize([ok, failed, empty], duration_s=1.0)
    assert (s["completed"], s["failed"]) == (1, 2)
    assert s["total_output_tokens"] == 2 and s["ttft_ms"]["p99"] == pytest.approx(500.0)
    assert s["errors"] == ["UNAVAILABLE: no executor"]
    assert "UNAVAILABLE" in format_report(s)


def test_short_outputs_are_flagged():
    s = summarize([_result("a", 0.0, [(1.0, 3)], max_tokens=8)], duration_s=1.0)
    assert s["short_outputs"] == 1
    assert "ended before max_tokens" in format_report(s)


def test_distribution_percentiles_and_empty_input_serializes_as_null():
    d = distribution([float(i) for i in range(1, 101)], scale=1.0)
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(np.percentile(np.arange(1, 101), 50))
    assert d["p99"] > d["p90"] > d["p50"]
    s = summarize([_result("x", 0.0, [], error="boom")], duration_s=1.0)
    assert math.isnan(s["ttft_ms"]["p50"])
    decoded = json.loads(json.dumps(json_safe(s), allow_nan=False))
    assert decoded["ttft_ms"]["p50"] is None
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], duration_s=0.0)


@pytest.mark.parametrize("text,want", [("7", (7, 7)), ("32:256", (32, 256))])
def test_parse_range(text, want):
    assert parse_range(text, "--input-len") == want


@pytest.mark.parametrize("text", ["0", "9:3", "a:b", "1:2:3", ""])
def test_parse_range_rejects_bad_ranges_naming_the_flag(text):
    with pytest.raises(ValueError, match="--output-len"):
        parse_range(text, "--output-len")


def test_parse_rate():
    assert math.isinf(parse_rate("inf")) and parse_rate("2.5") == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError, match="--rate"):
            parse_rate(bad)


def test_fixed_trace_lengths_tokens_and_arrivals():
    trace = build_trace("fixed", 200, math.inf, seed=3, vocab_size=100, max_model_len=4096,
                        input_len=(5, 9), output_len=(2, 4))
    assert {r.prompt_len for r in trace} == set(range(5, 10))
    assert {r.output_len for r in trace} == {2, 3, 4}
    assert all(1 <= t < 100 for r in trace for t in r.prompt_token_ids)
    assert all(r.arrival_time == 0.0 for r in trace)
    again = build_trace("fixed", 200, math.inf, seed=3, vocab_size=100, max_model_len=4096,
                        input_len=(5, 9), output_len=(2, 4))
    assert again == trace


def test_poisson_arrivals_have_the_asked_rate():
    trace = build_trace("fixed", 2000, 10.0, seed=0, vocab_size=1000, max_model_len=4096)
    arrivals = np.array([r.arrival_time for r in trace])
    assert np.all(np.diff(arrivals) >= 0)
    assert len(trace) / arrivals[-1] == pytest.approx(10.0, rel=0.1)


@pytest.mark.parametrize("workload", ["sharegpt", "alpaca", "shared-prefix"])
def test_traces_fit_the_served_model_length(workload):
    trace = build_trace(workload, 300, math.inf, seed=1, vocab_size=512, max_model_len=256, prefix_len=200)
    assert all(r.prompt_len + r.output_len <= 256 and r.output_len >= 1 for r in trace)
    assert all(max(r.prompt_token_ids) < 512 for r in trace)


def test_build_trace_rejects_unknown_workload_and_empty_runs():
    with pytest.raises(ValueError, match="workload"):
        build_trace("lmsys", 3, math.inf, 0, 100, 100)
    with pytest.raises(ValueError, match="num_requests"):
        build_trace("fixed", 0, math.inf, 0, 100, 100)


@pytest.mark.slow
def test_bench_against_a_real_stack(tiny_llama_dir, tmp_path, capsys):
    stack = Stack(tiny_llama_dir, tmp_path)
    try:
        stack.start_scheduler()
        stack.start_executor("ex0")
        stack.wait_health()
        out = tmp_path / "bench.json"
        rc = main(["--server", f"127.0.0.1:{stack.port}", "--workload", "fixed", "--input-len", "8:40",
                   "--output-len", "4:12", "--num-requests", "12", "--rate", "50", "--max-concurrency", "6",
                   "--seed", "5", "--no-progress", "--out", str(out)])
        info = stack.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    finally:
        stack.stop()
    assert rc == 0
    report = json.loads(out.read_text())
    s = report["summary"]
    want = build_trace("fixed", 12, 50.0, 5, info.vocab_size, info.max_model_len, (8, 40), (4, 12))
    assert s["completed"] == 12 and s["failed"] == 0 and s["short_outputs"] == 0
    # --ignore-eos is on by default, so exactly the requested lengths come back.
    assert s["total_output_tokens"] == sum(r.output_len for r in want)
    assert s["total_input_tokens"] == sum(r.prompt_len for r in want)
    assert 0 < s["ttft_ms"]["p50"] <= s["e2e_latency_ms"]["p50"]
    assert s["output_throughput"] > 0 and s["normalized_latency_s_per_token"] > 0
    assert report["settings"]["rate"] == "50.0"
    assert "Output token throughput" in capsys.readouterr().out


def test_left_padding_puts_prompts_at_the_right_edge():
    from testing.hf_baselines import _left_padded

    ids, mask = _left_padded([(5, 6, 7), (9,)], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_hf_baselines_generate_exactly_the_requested_tokens(tiny_llama_dir):
    """Both transformers baselines run on CPU (the continuous-batching cache sized explicitly) and
    produce the requested lengths, so their tokens/s compare with pagedserve's."""
    from testing import hf_baselines

    model = hf_baselines.load_model(tiny_llama_dir)
    trace = build_trace("fixed", 3, math.inf, seed=2, vocab_size=model.config.vocab_size,
                        max_model_len=4096, input_len=(4, 12), output_len=(2, 6))
    want = sum(r.output_len for r in trace)
    static = hf_baselines.run_static(model, trace, batch_size=2, pad_id=0)
    assert static.useful_tokens == want
    # Two batches, each run to its longest output: the padding waste is counted apart.
    assert static.generated_tokens == 2 * max(r.output_len for r in trace[:2]) + trace[2].output_len
    cb = hf_baselines.run_continuous(model, trace, max_batch_tokens=64)
    assert cb.useful_tokens == want and cb.tokens_per_s > 0


def test_serve_vs_hf_report_ratios_and_best_batch():
    import argparse

    from testing.hf_baselines import format_table, report

    args = argparse.Namespace(model="m", input_len="1:2", output_len="3:4", reps=3, threads=1)
    trace = build_trace("fixed", 4, math.inf, 0, 50, 100, (1, 2), (3, 4))
    runs = {"pagedserve": [300.0, 100.0, 200.0], "hf_cb": [50.0, 100.0, 150.0],
            "hf_static": {8: [40.0], 16: [70.0, 60.0, 80.0]}}  # 16 won repetition 1, so it ran 3 times
    r = report(args, trace, runs)
    assert r["pagedserve_tok_s"] == 200.0 and r["hf_cb_tok_s"] == 100.0
    assert r["hf_static_best_batch"] == 16 and r["hf_static_tok_s"] == 70.0
    assert r["speedup_vs_cb"] == pytest.approx(2.0) and r["speedup_vs_static"] == pytest.approx(200 / 70)
    assert r["meets_targets"] is False  # 2.86x < 3x static
    table = format_table(r)
    assert "static batch 16 (best)" in table and "2.86" in table
    json.dumps(r)  # the last line of the benchmark is this dict as JSON


def test_api_choice_and_the_side_by_side_comparison():
    from pagedserve.bench.loadgen import parse_apis
    from pagedserve.bench.stats import compare_runs, format_comparison

    assert parse_apis("grpc") == ("grpc",) and parse_apis("grpc,http") == ("grpc", "http")
    for bad in ("rest", "grpc,grpc", ""):
        with pytest.raises(ValueError, match="--api"):
            parse_apis(bad)
    fast = [_result("a", 0.0, [(0.1, 1), (0.2, 1)])]
    slow = [_result("a", 0.0, [(0.3, 1), (0.6, 1)])]
    runs = {"grpc": [summarize(fast, 1.0), summarize(fast, 2.0), summarize(fast, 4.0)],
            "http": [summarize(slow, 1.0), summarize(slow, 1.0), summarize(slow, 1.0)]}
    c = compare_runs(runs)
    assert c["grpc"]["output_throughput"] == pytest.approx(1.0)  # median of 2, 1, 0.5 tok/s
    assert c["http"]["ttft_ms.p50"] == pytest.approx(300.0) and c["grpc"]["failed"] == 0
    assert c["grpc"]["output_throughput_runs"] == pytest.approx([2.0, 1.0, 0.5])
    table = format_comparison(c)
    assert "http output throughput = 2.000 x grpc's" in table and "300.0" in table


def test_http_requests_carry_what_the_grpc_ones_do():
    from pagedserve.bench.http_client import completion_body
    from pagedserve.bench.workloads import TraceRequest

    req = TraceRequest("r", 0.0, (5, 6, 7), 9)
    body = completion_body(req, pb.SamplingParams(temperature=0.0, ignore_eos=True, top_p=0.5))
    assert body == {"prompt": [5, 6, 7], "max_tokens": 9, "stream": True, "return_token_ids": True,
                    "ignore_eos": True, "temperature": 0.0, "top_p": 0.5}
    assert "top_p" not in completion_body(req, pb.SamplingParams(temperature=1.0))
