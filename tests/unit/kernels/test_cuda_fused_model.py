"""The model's forward on the fused layer kernels (executor_svc/model/cuda_layers.py) against its eager
torch modules, both with the CuPy attention backend, through the runner: prefill, chunked prefill over
cached blocks, mixed and decode steps, GQA (the tiny model's 4 q / 2 KV heads). Run twice: on the CPU
with every CUDA kernel (fused layers, attention, cache write) executed from its source by the SIMT
emulator (in CI), and on a GPU with the real launchers (marked ``gpu``; ``make gpu-check``).

Greedy tokens must be equal and logits close; the KV cache the fused RoPE kernel writes must match
the one the backend's write_kv writes, and the backend's write must not run at all."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from executor_svc.model.cuda_layers import install
from testing.kernels.cuda_site import DTYPES
from testing.kernels.cuda_site import cuda_model as _model
from testing.kernels.cuda_site import cupy_runner as _runner
from testing.kernels.reference import rel_error
from testing.lora_adapters import torch_model
from testing.plan_driver import PlanDriver

TOL = {"float32": 1e-5, "bfloat16": 1e-2}
PROMPTS = [[(5 * i + 2) % 300 + 1 for i in range(n)] for n in (11, 4, 19)]


def _serve(runner, max_new: int = 5, chunk: int = 7) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prompts of 11, 4 and 19 tokens in chunks of 7 (a fresh prompt, chunks over cached blocks, a
    prompt done beside another's chunk), then decode steps; outputs and each step's sampled logits."""
    drv = PlanDriver(runner)
    for sid, p in enumerate(PROMPTS):
        drv.add(sid, p)
    logits = []
    while todo := {sid: chunk for sid in drv.seqs if len(drv.seqs[sid].outputs) < max_new}:
        drv.step(todo)
        logits.append(runner.last_logits.cpu())
    return [drv.seqs[s].outputs for s in sorted(drv.seqs)], logits


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layers_generate_like_the_eager_modules(where, tiny_llama_dir, monkeypatch, dtype):
    calls = where.patch(monkeypatch)
    eager = _runner(_model(tiny_llama_dir, where, DTYPES[dtype], fused=False)[0])
    want, want_logits = _serve(eager)
    assert calls["reshape_and_cache"] > 0
    calls.clear()
    model, kernels = _model(tiny_llama_dir, where, DTYPES[dtype], fused=True)
    fused = _runner(model)
    got, got_logits = _serve(fused)
    assert got == want
    assert len(got_logits) == len(want_logits)
    for i, (g, w) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert rel_error(g, w) < TOL[dtype], f"step {i}"
    for (fk, fv), (ek, ev) in zip(fused.kv.layers, eager.kv.layers, strict=True):
        assert rel_error(fk, ek) < TOL[dtype] and rel_error(fv, ev) < TOL[dtype]
    steps, layers = len(got_logits), model.cfg.num_layers
    assert calls["reshape_and_cache"] == 0, "the backend wrote K/V although the fused kernel did"
    assert calls["decode"] > 0 and calls["prefill"] > 0  # (both attention kernels ran)
    assert kernels.calls == {"rope_and_cache": steps * layers, "silu_and_mul": steps * layers,
                             "add_rms_norm": steps * (2 * layers + 1)}


def test_fused_layers_replay_in_decode_graphs(where, tiny_llama_dir, monkeypatch):
    """Decode steps through DecodeGraphs (on a GPU captured as CUDA graphs: the fused kernels must not
    sync the host; on the CPU its eager twin) give the eager model's tokens."""
    from executor_svc.decode_graphs import DecodeGraphs

    where.patch(monkeypatch)
    want = _serve(_runner(_model(tiny_llama_dir, where, torch.float32, fused=False)[0]), max_new=8)[0]
    runner = _runner(_model(tiny_llama_dir, where, torch.float32, fused=True)[0])
    runner.graphs = DecodeGraphs(runner.model, runner.kv, runner.backend, 256, (1, 2, 4))
    runner.graphs.capture_all()
    assert _serve(runner, max_new=8)[0] == want
    assert runner.graphs.replays > 0


def test_add_rms_norm_gives_a_row_its_bits_alone(where):
    """Batch invariance (#43): the one fused kernel that reduces (RMSNorm) sums a row in an order set by
    the hidden size alone, so a row computed alone and in a batch of 7 is the same bits (RoPE and
    SiLU-and-mul are elementwise per token). The mode need not turn the fused kernels off."""
    from executor_svc.model.cuda_layers import cuda_kernels

    kern = where.fused if where.fused is not None else cuda_kernels()
    g = torch.Generator().manual_seed(5)
    res, delta = (torch.randn(7, 1000, generator=g).to(where.device, torch.bfloat16) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(1000, generator=g)).to(where.device, torch.bfloat16)
    batch_res, batch_out = res.clone(), torch.empty_like(res)
    kern.add_rms_norm(batch_res, delta, weight, 1e-5, batch_out)
    for i in (0, 3, 6):
        one_res, one_out = res[i:i + 1].clone(), torch.empty_like(res[:1])
        kern.add_rms_norm(one_res, delta[i:i + 1].clone(), weight, 1e-5, one_out)
        assert torch.equal(one_out[0], batch_out[i]) and torch.equal(one_res[0], batch_res[i]), f"row {i}"


def test_the_switch_and_the_cpu_path(tiny_llama_dir):
    """--fused-layers (default on) and its environment variable; a CPU model never takes the fused
    layers (its modules and fused C decode stack stay as they are), nor a model with them switched off."""
    from executor_svc.config import parse_config
    from executor_svc.model import load_model

    base = ["--model", str(tiny_llama_dir), "--scheduler", "tcp://127.0.0.1:1"]
    assert parse_config(base, {}).fused_layers is True
    assert parse_config([*base, "--no-fused-layers"], {}).fused_layers is False
    assert parse_config(base, {"PAGEDSERVE_FUSED_LAYERS": "0"}).fused_layers is False
    assert load_model(tiny_llama_dir).fused_layers is None
    model = torch_model(tiny_llama_dir)
    assert install(model) is None and model.fused_layers is None  # (a CPU model, no kernels named)
    assert install(model, enabled=False, kernels=object()) is None and model.fused_layers is None


class _Locked:
    """The fused emulator one launch at a time (tensor-parallel ranks run in threads)."""

    def __init__(self, kernels) -> None:
        import threading

        self.kernels, self.lock, self.calls = kernels, threading.Lock(), Counter()

    def __getattr__(self, name: str):
        fn = getattr(self.kernels, name)

        def call(*args):
            with self.lock:
                self.calls[name] += 1
                return fn(*args)
        return call


def test_tensor_parallel_ranks_compose_with_the_fused_layers(emulated, tiny_llama_dir, monkeypatch):
    """Two ranks (2 q / 1 KV heads and half the MLP each), each on the fused layers: the row-parallel
    sums land in the residual stream as the eager modules' do; the tokens are one eager runner's."""
    import testing.lora_adapters
    from executor_svc.attention_cupy import CupyAttentionBackend
    from testing.tp_harness import tp_runner

    emulated.patch(monkeypatch)
    want = _serve(_runner(_model(tiny_llama_dir, emulated, torch.float32, fused=False)[0]))[0]
    kernels, plain = _Locked(emulated.fused), testing.lora_adapters.torch_model

    def fused_model(*args, **kwargs):
        model = plain(*args, **kwargs)
        install(model, kernels=kernels)
        return model

    monkeypatch.setattr(testing.lora_adapters, "torch_model", fused_model)
    with tp_runner(tiny_llama_dir, backend=CupyAttentionBackend, packed=False) as runner:
        assert runner.model.cfg.num_heads == 2 and runner.model.fused_layers is not None
        drv = PlanDriver(runner)
        for sid, p in enumerate(PROMPTS):
            drv.add(sid, p)
        drv.run_until(5, chunk=7)
        assert [drv.seqs[s].outputs for s in range(len(PROMPTS))] == want
    assert kernels.calls["rope_and_cache"] > 0


def test_lora_deltas_reach_the_fused_layers_before_rope(emulated, tiny_llama_dir, monkeypatch):
    """Adapters on q/k/v (added inside the merged projection, before RoPE rotates q and k), o, gate/up
    and down, two slots and base tokens in one batch: the fused layers' logits are the eager modules'
    (an adapter's k delta added after RoPE, or lost, would move them), and the adapters do change them."""
    from executor_svc.attention_cupy import CupyAttentionBackend
    from executor_svc.lora import LoraManager
    from testing.cpu_agreement import Forcer
    from testing.lora_adapters import random_adapter

    emulated.patch(monkeypatch)
    model, kernels = _model(tiny_llama_dir, emulated, torch.float32, fused=True)
    fused = model.fused_layers
    manager = LoraManager(model, max_loras=2, max_rank=8)
    manager.slots.load(0, random_adapter(model.cfg, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"], 8, seed=1))
    manager.slots.load(1, random_adapter(model.cfg, ["k_proj"], 4, seed=2))
    prompts = [PROMPTS[0], PROMPTS[1][:3], PROMPTS[2][:6]]

    def logits(layers, slots: list[int]) -> torch.Tensor:
        model.fused_layers = layers
        forcer = Forcer(model, torch.float32, len(prompts), 32, "torch")
        forcer.backend = CupyAttentionBackend()
        seqs = list(range(len(prompts)))
        with manager.batch(torch.tensor([s for s, p in zip(slots, prompts, strict=True) for _ in p])):
            rows = [forcer.step(seqs, prompts)]
        for k in range(3):
            with manager.batch(torch.tensor(slots)):
                rows.append(forcer.step(seqs, [[7 + k + s] for s in seqs]))
        return torch.stack(rows, dim=1)  # [seqs, steps, vocab]

    slots = [0, -1, 1]
    got, want = logits(fused, slots), logits(None, slots)
    assert kernels.calls["rope_and_cache"] > 0
    for i in range(len(prompts)):
        assert rel_error(got[i], want[i]) < 1e-5, f"sequence {i} (slot {slots[i]})"
    base = logits(fused, [-1, -1, -1])
    assert rel_error(got[1], base[1]) < 1e-5  # the base model's sequence
    assert rel_error(got[0], base[0]) > 1e-3 and rel_error(got[2], base[2]) > 1e-3  # the adapters' moved


def _view(func, args, out) -> bool:
    """Whether an op returned a view of an input (no launch): ``to`` a dtype it has, a reshape..."""
    ret = func._schema.returns
    out = out[0] if isinstance(out, (list, tuple)) and out else out  # (split: a list of views)
    if not ret or ret[0].alias_info is None or ret[0].alias_info.is_write or not isinstance(out, torch.Tensor):
        return False
    storages = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return out.untyped_storage().data_ptr() in storages


class _Launches:
    """Counts what a CUDA run would launch: every aten op that is neither a view nor an allocation
    (each is one kernel on CUDA), plus each kernel launcher call (attention, fused layers), whose own
    host-side torch calls are not counted."""

    _ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
    _GEMM = {"linear", "mm", "addmm"}  # (one cuBLAS GEMM; decomposed or not, by device and mode)

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.overloadpacket.__name__
                if outer.counting and not outer.inside and name not in outer._ALLOC and not _view(func, args, out):
                    outer.ops["gemm" if name in outer._GEMM else name] += 1
                return out

        self.mode, self.ops, self.counting, self.inside = Mode(), Counter(), False, False

    def kernel(self, name: str, fn):
        def call(*args, **kwargs):
            if self.counting:
                self.ops[f"kernel:{name}"] += 1
            self.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside = False
        return call

    def count(self, fn, *args) -> Counter:
        """What ``fn(*args)`` launches, by op."""
        self.ops, self.counting = Counter(), True
        try:
            with self.mode:
                fn(*args)
        finally:
            self.counting = False
        return self.ops


def test_a_fused_decode_layer_launches_nine_kernels(emulated, tiny_llama_dir, monkeypatch):
    """A bfloat16 decode step's launches per decoder layer (a 2-layer forward's minus a 1-layer one's):
    the four projections' GEMMs, the attention kernel, two add_rms_norm, rope_and_cache and
    silu_and_mul on the fused layers; the eager modules' chains of small ops take 36 (RMSNorm 8 each in
    bfloat16, RoPE 5 per tensor, the cache write, SiLU-and-mul 2, the residual adds 1 each)."""
    from cupy_kernels import cache_ops, launchers
    from executor_svc.attention_cupy import CupyAttentionBackend
    from testing.cpu_agreement import Forcer

    emulated.patch(monkeypatch)
    launches = _Launches()
    for module, name in ((launchers, "paged_attention_decode"), (launchers, "paged_attention_prefill"),
                         (cache_ops, "reshape_and_cache")):
        monkeypatch.setattr(module, name, launches.kernel(name, getattr(module, name)))
    per_layer = {}
    for fused in (False, True):
        model = _model(tiny_llama_dir, emulated, torch.bfloat16, fused=False)[0]
        if fused:
            install(model, kernels=type("K", (), {n: staticmethod(launches.kernel(n, getattr(emulated.fused, n)))
                                                  for n in ("add_rms_norm", "silu_and_mul", "rope_and_cache")})())
        forcer = Forcer(model, torch.bfloat16, 3, 32, "torch")
        forcer.backend = CupyAttentionBackend()
        forcer.step([0, 1, 2], PROMPTS)
        with torch.inference_mode():
            both = launches.count(forcer.step, [0, 1, 2], [[3], [4], [5]])
            model.layers = torch.nn.ModuleList(list(model.layers)[:1])
            forcer.kv.layers = forcer.kv.layers[:1]
            one = launches.count(forcer.step, [0, 1, 2], [[3], [4], [5]])
        per_layer[fused] = both - one
    fused_ops, eager_ops = per_layer[True], per_layer[False]
    assert fused_ops == {"gemm": 4, "kernel:paged_attention_decode": 1, "kernel:add_rms_norm": 2,
                         "kernel:rope_and_cache": 1, "kernel:silu_and_mul": 1}, fused_ops
    assert eager_ops["gemm"] == 4 and eager_ops["kernel:paged_attention_decode"] == 1
    assert eager_ops["kernel:reshape_and_cache"] == 1  # (the fused layers write K/V in rope_and_cache)
    assert eager_ops.total() > 30, eager_ops  # (36 with torch 2.13: the exact ops are torch's to choose)
