"""The batched LoRA kernels (``cupy_kernels/lora.cu``, Punica-style shrink/expand) against a float64
reference, and ``executor_svc/lora/apply.py``'s kernel path against its torch products and against
PEFT's merged model. Run twice: by the CPU emulator from the exact source NVRTC compiles (in CI),
and on a GPU through the launchers (marked ``gpu``, skipped without CUDA; ``make gpu-check``).

Every case stacks several slots in one launch with tokens of different slots interleaved, -1 tokens,
an empty slot, ranks that are not a multiple of the shrink block's 4 rows, and the output column
ranges of fused q/k/v and gate/up (a slot touching only k, or only up). Outputs outside a token's
range, and rows of tokens without an adapter, must come back bit for bit."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from cupy_kernels import lora
from executor_svc.lora import LoraManager
from executor_svc.lora.adapter import MAX_RANK
from executor_svc.lora.apply import LoraBatch, add_delta, add_delta_kernels
from testing.kernels.reference import rel_error
from testing.lora_adapters import random_adapter

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
_HAVE_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
GPU = [pytest.mark.gpu, pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU and CuPy (run make gpu-check)")]

# name -> (input features, sub-projection output widths, max_rank, per slot {sub index: rank})
LAYOUTS = {
    "qkv": (72, (64, 16, 16), 5, [{0: 5, 2: 5}, {1: 3}, {0: 2, 1: 2, 2: 2}, {}]),
    "gate_up": (40, (100, 100), 7, [{0: 7, 1: 7}, {1: 4}, {0: 1}]),
    "down": (300, (48,), 9, [{0: 9}, {0: 6}, {0: 3}]),
}
# Tiles of 8: one slot throughout (A and B^T read once for the tile), mixed slots, no adapter at all, and a
# last partial tile of one slot. Slot 3 (where it exists) holds no weights for this projection.
TOKEN_SLOTS = [2] * 8 + [0, -1, 1, 2, 0, 3, -1, 1] + [-1] * 8 + [1] * 3


class _OnGpu:
    """The launchers, with the emulator's call shape."""

    device = "cuda"

    def shrink(self, *args, **kw):
        return lora.shrink(*args, **kw)

    def expand(self, *args, **kw):
        return lora.expand(*args, **kw)


@pytest.fixture(scope="module", params=["emulator", pytest.param("cuda", marks=GPU)])
def kern(request):
    if request.param == "cuda":
        return _OnGpu()
    from testing.kernels.emulate_lora import LoraEmulator

    emu = LoraEmulator()
    emu.device = "cpu"
    return emu


def make_slots(layout: str, seed: int, device: str):
    """(a [S, R, in], bt [S, R, out], bounds [3, S] int32) laid out as executor_svc/lora/slots.py does:
    a slot's rank rows packed at the front, B^T block-diagonal over the sub-projections."""
    n_in, widths, max_rank, per_slot = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    r, out = len(widths) * max_rank, sum(widths)
    starts = [sum(widths[:i]) for i in range(len(widths))]
    a, bt = torch.zeros(len(per_slot), r, n_in), torch.zeros(len(per_slot), r, out)
    bounds = torch.zeros(3, len(per_slot), dtype=torch.int32)
    for s, pieces in enumerate(per_slot):
        col, lo, hi = 0, None, 0
        for sub, rank in sorted(pieces.items()):
            a[s, col:col + rank] = torch.randn(rank, n_in, generator=g) / n_in ** 0.5
            bt[s, col:col + rank, starts[sub]:starts[sub] + widths[sub]] = torch.randn(rank, widths[sub], generator=g)
            col += rank
            lo = starts[sub] if lo is None else lo
            hi = starts[sub] + widths[sub]
        bounds[:, s] = torch.tensor([col, lo or 0, hi])
    return a.to(device), bt.to(device), bounds.to(device)


def reference(x, y, a, bt, bounds, slots):
    """float64 y + each token's (x A^T) B^T over its slot's used rows and column range."""
    ref = y.double().clone()
    for tok, s in enumerate(slots):
        if s < 0:
            continue
        used, lo, hi = (int(v) for v in bounds[:, s])
        if used:
            t = x[tok].double() @ a[s, :used].double().t()
            ref[tok, lo:hi] += t @ bt[s, :used, lo:hi].double()
    return ref


@pytest.mark.parametrize("tokens", [1, lora.TILE], ids=["per-token", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shrink_expand_match_reference(kern, layout, dtype, tokens):
    seed = random.randrange(1 << 30)
    a, bt, bounds = make_slots(layout, seed, kern.device)
    num_slots, r, n_in = a.shape
    out = bt.shape[2]
    slots = [s if s < num_slots else -1 for s in TOKEN_SLOTS]
    n, t_ = len(slots), DTYPES[dtype]
    g = torch.Generator().manual_seed(seed + 1)
    # x a slice of a wider buffer (row stride > row), y a slice of a wider output: the kernels take strides.
    x = torch.randn(n, n_in + 8, generator=g).to(kern.device, t_)[:, 4:4 + n_in]
    y = torch.randn(n, out + 3, generator=g).to(kern.device, t_)[:, :out]
    before = y.clone()
    token_slots = torch.tensor(slots, dtype=torch.int32, device=kern.device)
    t = torch.full((n, r), float("nan"), device=kern.device)
    kern.shrink(t, x, a, bounds, token_slots, tokens=tokens)
    for tok, s in enumerate(slots):  # t: exactly the used rows of tokens with a slot
        used = int(bounds[0, s]) if s >= 0 else 0
        if used:  # (float32 sums: bounded by the size of the terms, not of their sum, which may cancel)
            want = x[tok].double() @ a[s, :used].double().t()
            scale = x[tok].double().abs() @ a[s, :used].double().abs().t()
            assert bool(((t[tok, :used].double() - want).abs() <= 1e-5 * scale).all()), \
                f"shrink token {tok} (seed {seed})"
    width = max(int(bounds[2, s] - bounds[1, s]) for s in set(slots) if s >= 0)
    kern.expand(y, t, bt, bounds, token_slots, width, tokens=tokens)
    ref = reference(x, before, a, bt, bounds, slots)
    touched = torch.zeros(n, out, dtype=torch.bool)
    for tok, s in enumerate(slots):
        if s >= 0 and int(bounds[0, s]):
            touched[tok, int(bounds[1, s]):int(bounds[2, s])] = True
    touched = touched.to(kern.device)
    assert torch.equal(y[~touched], before[~touched]), f"expand wrote outside the tokens' ranges (seed {seed})"
    assert rel_error(y[touched], ref[touched]) < TOL[dtype], f"seed {seed}"
    assert rel_error((y.double() - before.double())[touched], (ref - before.double())[touched]) < 50 * TOL[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_token_s_delta_does_not_depend_on_its_tile(kern, dtype):
    """Tiled or not, with neighbours of its slot or of others: a token's sums run in one order, so its
    result is bit for bit the same (the kernels add nothing to the batch variance of the base model)."""
    a, bt, bounds = make_slots("qkv", 5, kern.device)
    g = torch.Generator().manual_seed(6)
    x0 = torch.randn(1, a.shape[2], generator=g).to(kern.device, DTYPES[dtype])
    y0 = torch.randn(1, bt.shape[2], generator=g).to(kern.device, DTYPES[dtype])
    results = []
    for neighbours, tokens in (([], 1), ([0] * 7, lora.TILE), ([1, -1, 2, 0, 0, 1, 2], lora.TILE), ([0] * 3, 1)):
        slots = [0, *neighbours]
        x = torch.cat([x0, torch.randn(len(neighbours), a.shape[2], generator=g).to(x0)])
        y = torch.cat([y0, torch.randn(len(neighbours), bt.shape[2], generator=g).to(y0)])
        t = torch.empty(len(slots), a.shape[1], device=kern.device)
        ts = torch.tensor(slots, dtype=torch.int32, device=kern.device)
        kern.shrink(t, x, a, bounds, ts, tokens=tokens)
        kern.expand(y, t, bt, bounds, ts, tokens=tokens)
        results.append(y[0])
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_launchers_refuse_bad_arguments():
    """The checks run on CPU tensors (metadata only), before any CUDA is needed."""
    a, bt, bounds = make_slots("qkv", 0, "cpu")
    n = 3
    slots, t = torch.zeros(n, dtype=torch.int32), torch.empty(n, a.shape[1])
    x, y = torch.randn(n, a.shape[2]), torch.randn(n, bt.shape[2])
    lora.check_shrink(t, x, a, bounds, slots)
    lora.check_expand(y, t, bt, bounds, slots, bt.shape[2])
    with pytest.raises(ValueError, match="token_slots: dtype must be torch.int32"):
        lora.check_shrink(t, x, a, bounds, slots.long())
    with pytest.raises(ValueError, match="x: expected shape \\[3, 72\\]"):
        lora.check_shrink(t, x[:, :70], a, bounds, slots)
    with pytest.raises(ValueError, match="a: expected a contiguous float32"):
        lora.check_shrink(t, x, a.half(), bounds, slots)
    with pytest.raises(ValueError, match="bounds: expected shape \\[3, 4\\]"):
        lora.check_expand(y, t, bt, bounds[:, :2].contiguous(), slots, 8)
    with pytest.raises(ValueError, match="y: rows must be contiguous"):
        lora.check_expand(y.t().contiguous().t(), t, bt, bounds, slots, 8)
    with pytest.raises(ValueError, match="width: the widest slot's output range, in \\[0, 96\\]"):
        lora.check_expand(y, t, bt, bounds, slots, 97)
    with pytest.raises(ValueError, match="R = 800 rank rows per slot exceeds the kernels' 768"):
        lora.check_shrink(torch.empty(n, 800), x, torch.zeros(4, 800, 72), bounds, slots)
    with pytest.raises(ValueError, match="the CUDA kernels need CUDA tensors"):
        lora.shrink(t, x, a, bounds, slots)
    with pytest.raises(ValueError, match="tokens: 1 or 8 per block, got 4"):
        lora.expression("ps_lora_shrink", "float32", 4)
    assert [lora.tokens_per_block(n) for n in (1, lora.TILE_FROM - 1, lora.TILE_FROM)] == [1, 1, lora.TILE]
    assert lora.MAX_R == 3 * MAX_RANK  # q/k/v at the largest rank a slot holds


@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_kernel_path_equals_torch_products(kern, tiny_llama_dir, dtype):
    """``add_delta_kernels`` (the CUDA path) against ``add_delta`` (the torch products) on the same slots
    of a real model, every projection of every layer, four adapters and base tokens interleaved."""
    from testing.lora_adapters import torch_model

    model = torch_model(tiny_llama_dir).to(kern.device)
    manager = LoraManager(model, max_loras=4, max_rank=8, kernels=kern)
    targets = [["q_proj", "v_proj"], ["k_proj", "o_proj", "up_proj"], ["gate_proj", "down_proj", "q_proj"],
               ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]]
    for slot, tg in enumerate(targets):
        manager.slots.load(slot, random_adapter(model.cfg, tg, [8, 3, 5, 6][slot], seed=slot))
    slots = torch.tensor([3, -1, 0, 1, 2, 0, -1, 3, 1, 2, 2])
    loaded = [True] * 4
    with_k = LoraBatch.build(slots, loaded, torch.device(kern.device), with_kernels=True)
    groups = LoraBatch.build(slots, loaded, torch.device(kern.device))
    g = torch.Generator().manual_seed(7)
    base = (slots < 0).to(kern.device)
    for layer in manager.slots.layers:
        for name, p in layer.items():
            x = torch.randn(len(slots), p.a.shape[2], generator=g).to(kern.device, DTYPES[dtype])
            y = torch.randn(len(slots), p.bt.shape[2], generator=g).to(kern.device, DTYPES[dtype])
            want = add_delta(x, y.clone(), p, groups)
            got = add_delta_kernels(x, y.clone(), p, with_k, kern)
            assert got.dtype == want.dtype
            assert rel_error(got, want.double()) < TOL[dtype], name
            assert not torch.equal(got, y), f"{name}: no delta added"
            assert torch.equal(got[base], y[base]), f"{name}: base tokens changed"


def test_model_on_kernels_equals_peft(tiny_llama_dir, tmp_path):
    """Our float32 model with its deltas from the (emulated) kernels: prefill then decode steps of three
    adapters and the base model in one batch give each sequence PEFT's merged model's logits. On a GPU
    the kernel path is held to the torch products instead (test_apply_kernel_path_equals_torch_products:
    `make gpu-check` installs no PEFT)."""
    from testing.kernels.emulate_lora import LoraEmulator

    kern = LoraEmulator()
    kern.device = "cpu"
    from transformers import AutoModelForCausalLM

    from testing.executor_plans import hf_logits
    from testing.lora_adapters import forced_logits, make_adapter, torch_model

    targets = [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["k_proj", "up_proj"],
               ["v_proj", "down_proj"]]
    merged, model = [], torch_model(tiny_llama_dir)
    manager = LoraManager(model, max_loras=3, max_rank=8, kernels=kern)
    for slot, tg in enumerate(targets):
        merged.append(make_adapter(tiny_llama_dir, tmp_path / f"a{slot}", tg, r=[8, 5, 3][slot], seed=20 + slot))
        manager.load(slot, str(tmp_path / f"a{slot}"))
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 500, (n,), generator=gen).tolist() for n in (6, 3, 9, 4)]
    conts = [torch.randint(1, 500, (2,), generator=gen).tolist() for _ in prompts]
    slots = [1, -1, 0, 2]
    before = kern.launches
    ours = forced_logits(model, manager, "torch", slots, prompts, conts)
    assert kern.launches > before, "the deltas did not go through the kernels"
    for i, (s, p, c) in enumerate(zip(slots, prompts, conts, strict=True)):
        ref = hf_logits(base if s < 0 else merged[s], p + c)[len(p) - 1:]
        assert rel_error(ours[i], ref) < 1e-4, f"sequence {i} (slot {s})"
        assert torch.equal(ours[i].argmax(-1), ref.argmax(-1))
