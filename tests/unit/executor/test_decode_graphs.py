"""CUDA-graph decode (executor_svc/decode_graphs.py), everything but the capture itself, on CPU:
bucket choice, the static inputs and their one copy per step, padding, the fixed metadata, the
eager fallback, capture only at start. The CPU twin runs the graphs' buffers eagerly; its tokens
and logits must equal the plain runner's bit for bit (padding rows never touch a real row)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from executor_svc.decode_graphs import DecodeGraphs
from executor_svc.graph_buckets import DEFAULT_SIZES, bucket_for, parse_sizes
from executor_svc.model import load_model
from pagedserve.wire import SamplingParams
from testing.executor_plans import make_runner
from testing.plan_driver import GREEDY, PlanDriver


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _runner(tiny_llama_dir, model, sizes=(1, 2, 4, 8), cpu_attention="fused"):
    runner = make_runner(tiny_llama_dir, num_blocks=48, model=model, cpu_attention=cpu_attention)
    runner.keep_logits = True
    if sizes is not None:
        runner.graphs = DecodeGraphs(runner.model, runner.kv, runner.backend, 256, sizes, capture=False)
        runner.graphs.capture_all()
    return runner


def test_buckets_are_the_smallest_size_that_holds_the_batch():
    assert DEFAULT_SIZES[:6] == (1, 2, 4, 8, 16, 24) and DEFAULT_SIZES[-1] == 256
    assert [bucket_for(n, DEFAULT_SIZES) for n in (1, 3, 8, 9, 17, 255, 256)] == [1, 4, 8, 16, 24, 256, 256]
    assert bucket_for(257, DEFAULT_SIZES) is None  # above the largest: eager
    assert parse_sizes("8, 1,4,4") == (1, 4, 8)
    for bad in ("", "0,4", "1,x", "2000"):
        with pytest.raises(ValueError, match="--cuda-graph-sizes"):
            parse_sizes(bad)


def _serve(runner, prompts, max_new, sampling=GREEDY, stagger=False):
    """Prefill each prompt, then decode them together (staggered: one finishes every few steps,
    so the batch walks down through the buckets). Returns outputs and every step's logits."""
    drv = PlanDriver(runner)
    for sid, p in enumerate(prompts):
        drv.add(sid, p, sampling)
    logits = []
    while True:
        todo = {sid: 1 << 30 for sid in drv.seqs
                if len(drv.seqs[sid].outputs) < max_new - (sid if stagger else 0)}
        if not todo:
            return [drv.seqs[s].outputs for s in sorted(drv.seqs)], logits
        drv.step(todo)
        logits.append(runner.last_logits)


PROMPTS = [[5 + i, 17, 3 * i + 1, 40, 2, 9 + i][: 3 + i % 4] for i in range(7)]


# The fused C decode stack (served on CPU) reduces every row alone: bit for bit. The torch reference
# backend's SDPA over a batch of 8 padded rows may block its reductions unlike over 7: equal tokens,
# logits within float32 rounding.
@pytest.mark.parametrize("cpu_attention,exact", [("fused", True), ("torch", False)])
def test_replayed_decode_equals_eager(tiny_llama_dir, model, cpu_attention, exact):
    eager = _runner(tiny_llama_dir, model, sizes=None, cpu_attention=cpu_attention)
    graphed = _runner(tiny_llama_dir, model, cpu_attention=cpu_attention)
    out_e, logits_e = _serve(eager, PROMPTS, 8, stagger=True)
    out_g, logits_g = _serve(graphed, PROMPTS, 8, stagger=True)
    assert out_g == out_e
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-5)
    assert all(same(a, b) for a, b in zip(logits_g, logits_e, strict=True))
    g = graphed.graphs
    # 7 sequences prefilled in one step (eager), then decode steps of 7, 6, ... 1 sequences.
    assert g.replays == len(logits_g) - 1 and g.inputs.copies == g.replays + len(g.sizes)
    assert g.padded_rows > 0  # 7 -> bucket 8, 5 -> 8, 3 -> 4


def test_every_bucket_writes_its_logits_into_one_buffer(tiny_llama_dir, model, monkeypatch):
    """What a graph returns outlives its capture: one [largest bucket, vocab] buffer for all of them,
    not one per bucket (35 of them by default, sized after the KV budget was)."""
    graphed = _runner(tiny_llama_dir, model)
    g = graphed.graphs
    assert g.logits.shape == (8, model.cfg.vocab_size) and g.logits.dtype == torch.float32
    returned = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, *a, **k: returned.append(run(self, *a, **k)) or returned[-1])
    _serve(graphed, PROMPTS, 6, stagger=True)
    assert len({len(x) for x in returned}) > 2  # several buckets replayed
    assert all(x.data_ptr() == g.logits.data_ptr() for x in returned)


def test_a_replayed_step_copies_only_its_static_inputs(tiny_llama_dir, model, monkeypatch):
    """A step's layout is built on the host; only an eager forward places it on the device (one
    copy per tensor): the steps the graphs replay move nothing but their one static-input copy."""
    from executor_svc.batch import Batch

    placed = []
    place = Batch.place
    monkeypatch.setattr(Batch, "place", lambda self: (placed.append(self.meta.num_seqs), place(self))[1])
    graphed = _runner(tiny_llama_dir, model)
    _, logits = _serve(graphed, PROMPTS, 5)
    assert placed == [len(PROMPTS)]  # the one prefill step
    assert graphed.graphs.replays == len(logits) - 1
    placed.clear()
    _, logits = _serve(_runner(tiny_llama_dir, model, sizes=None), PROMPTS, 5)
    assert placed == [len(PROMPTS)] * len(logits)


def test_seeded_sampling_is_unchanged_by_replay(tiny_llama_dir, model):
    sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    out_e, _ = _serve(_runner(tiny_llama_dir, model, sizes=None), PROMPTS[:3], 6, sampling)
    out_g, _ = _serve(_runner(tiny_llama_dir, model), PROMPTS[:3], 6, sampling)
    assert out_g == out_e


def test_a_batch_above_the_largest_bucket_runs_eagerly(tiny_llama_dir, model):
    eager = _runner(tiny_llama_dir, model, sizes=None)
    graphed = _runner(tiny_llama_dir, model, sizes=(1, 2))
    out_e, _ = _serve(eager, PROMPTS[:4], 4)
    out_g, _ = _serve(graphed, PROMPTS[:4], 4)
    assert out_g == out_e and graphed.graphs.replays == 0


def test_padding_rows_write_no_kv_and_capture_only_at_start(tiny_llama_dir, model):
    runner = _runner(tiny_llama_dir, model, sizes=None)
    before = [(k.clone(), v.clone()) for k, v in runner.kv.layers]
    graphs = DecodeGraphs(runner.model, runner.kv, runner.backend, 256, (1, 4), capture=False)
    graphs.capture_all()  # runs every bucket over padding rows only
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(runner.kv.layers, before, strict=True))
    with pytest.raises(RuntimeError, match="already captured"):
        graphs.capture_all()
    fresh = DecodeGraphs(runner.model, runner.kv, runner.backend, 256, (1, 4), capture=False)
    runner.graphs = fresh  # never captured: a step must not capture in the middle of serving
    drv = PlanDriver(runner)
    drv.add(0, [5, 6, 7])
    drv.step({0: 3})  # the prefill is eager
    with pytest.raises(AssertionError, match="no captured bucket"):
        drv.step({0: 1})


def test_static_inputs_hold_the_batch_then_padding(tiny_llama_dir, model):
    runner = _runner(tiny_llama_dir, model, sizes=(1, 4))
    drv = PlanDriver(runner)
    for sid in range(3):
        drv.add(sid, [5 + sid] * (18 + sid))  # two blocks each
    drv.step({sid: 1 << 30 for sid in range(3)})
    drv.step({sid: 1 for sid in range(3)})
    h = runner.graphs.inputs.h
    assert h["seq_lens"][:4].tolist() == [19, 20, 21, 1]  # prompt + the token sampled by the prefill
    assert h["slot_mapping"][3] == -1 and h["input_ids"][3] == 0 and not h["block_tables"][3].any()
    tables = np.array([drv.seqs[s].table for s in range(3)], dtype=np.int32)
    assert (h["block_tables"][:3, :2] == tables).all() and not h["block_tables"][:3, 2:].any()
    assert h["query_start_loc"][:5].tolist() == [0, 1, 2, 3, 4]
    meta = runner.graphs.inputs.meta(4, runner.graphs.max_seq_len)
    assert meta.max_seq_len == 256 and meta.block_tables.shape == (4, 16)  # fixed: the split never varies
    d = runner.graphs.inputs.d
    assert d["seq_lens"][:4].tolist() == [19, 20, 21, 1]  # the copy reached the device buffer


_HAVE_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU and CuPy (run make gpu-check)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_graphs_give_the_eager_greedy_tokens_on_a_gpu(tiny_llama_dir, dtype):
    """Real capture and replay (CuPy kernels on torch's capture stream): the same greedy tokens as
    eager launches, over a batch that walks down through the buckets."""
    from executor_svc.attention_cupy import CupyAttentionBackend
    from executor_svc.kv_cache import KVCache
    from executor_svc.runner import ModelRunner
    from executor_svc.sampler import Sampler

    gpu_model = load_model(tiny_llama_dir, "cuda", dtype)
    outputs = []
    for graphs in (False, True):
        kv = KVCache(gpu_model.cfg, 16, 64, 0, dtype, "cuda")
        runner = ModelRunner(gpu_model, kv, CupyAttentionBackend(), Sampler(seed=0))
        if graphs:
            runner.graphs = DecodeGraphs(gpu_model, kv, runner.backend, runner.max_model_len, (1, 2, 4, 8))
            runner.graphs.capture_all()
        outputs.append(_serve(runner, PROMPTS, 10, stagger=True)[0])
    assert outputs[1] == outputs[0]
    assert runner.graphs.replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU and CuPy (run make gpu-check)")
def test_chained_replays_give_the_sequential_greedy_tokens_on_a_gpu(tiny_llama_dir):
    """Plans prepared ahead with greedy tokens kept on the device (token_chain.py): each step is
    launched before the one before it completes, its open rows filled on the device behind the
    static-input copy, the two host mirrors taking turns; tokens equal to one step at a time, eager."""
    from executor_svc.attention_cupy import CupyAttentionBackend
    from executor_svc.kv_cache import KVCache
    from executor_svc.pipeline import StepPipeline
    from executor_svc.runner import ModelRunner
    from executor_svc.sampler import Sampler
    from pagedserve.engine_api import GenerationRequest, RequestParams
    from scheduler_svc.sched.scheduler import Scheduler
    from scheduler_svc.sched.scheduler_config import SchedulerConfig
    from testing.executor_plans import apply_result

    gpu_model = load_model(tiny_llama_dir, "cuda", torch.bfloat16)
    outputs, chained = [], 0
    for pipelined in (False, True):
        kv = KVCache(gpu_model.cfg, 16, 64, 0, torch.bfloat16, "cuda")
        runner = ModelRunner(gpu_model, kv, CupyAttentionBackend(), Sampler(seed=0))
        if pipelined:
            runner.graphs = DecodeGraphs(gpu_model, kv, runner.backend, runner.max_model_len, (1, 2, 4, 8))
            runner.graphs.capture_all()
        sched = Scheduler(SchedulerConfig(block_size=16, max_model_len=256), 64, 0, eos_token_ids=())
        out = {f"r{i}": [] for i in range(len(PROMPTS))}
        for i, p in enumerate(PROMPTS):
            sched.add_request(GenerationRequest(f"r{i}", p, RequestParams(max_tokens=6 + 2 * i, ignore_eos=True,
                                                                          sampling=SamplingParams(temperature=0.0))))
        pipe = StepPipeline(runner, ahead=pipelined)
        for _ in range(500):
            if not sched.has_work() and pipe.in_flight is None:
                break
            plan = sched.schedule() if len(sched.in_flight) < (2 if pipelined else 1) else None
            results = pipe.push(plan) if plan is not None else [pipe.finish()] if pipe.in_flight else []
            for result in results:
                apply_result(sched, result, out)
        outputs.append(out)
        chained = pipe.chained
    assert outputs[1] == outputs[0]
    assert chained > 5 and runner.graphs.replays > 5
