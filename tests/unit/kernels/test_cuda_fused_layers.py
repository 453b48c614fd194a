"""The fused decoder-layer kernels (RMSNorm + residual, SiLU-and-mul, RoPE + cache write) against
float64 references and against the model's eager torch modules, run twice: by the CPU emulator
from the exact source NVRTC compiles (in CI), and on a GPU through the launchers (marked ``gpu``,
skipped without CUDA; ``make gpu-check``). Outputs and cache slots start as NaN, so an element a
kernel skips fails the comparison."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.nn.functional as F

from executor_svc.model.architecture import RopeConfig
from executor_svc.model.llama import RMSNorm
from executor_svc.model.rope import RotaryEmbedding, apply_rotary
from testing.kernels.reference import rel_error
from testing.kernels.reference_fused import ref_add_rms_norm, ref_rotary, ref_silu_and_mul

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


_HAVE_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


class _OnGpu:
    """The launchers, with the emulator's call shape; inputs move to the GPU and results back."""

    device = "cuda"

    def add_rms_norm(self, residual, delta, weight, eps, out):
        from cupy_kernels.fused_layers import add_rms_norm

        add_rms_norm(residual, delta, weight, eps, out)

    def silu_and_mul(self, gate_up, out):
        from cupy_kernels.fused_layers import silu_and_mul

        silu_and_mul(gate_up, out)

    def rope_and_cache(self, *args):
        from cupy_kernels.fused_layers import rope_and_cache

        rope_and_cache(*args)


@pytest.fixture(scope="module", params=[
    "emulator",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _HAVE_GPU, reason="needs a CUDA GPU and CuPy (run make gpu-check)")])])
def emu(request):
    if request.param == "cuda":
        return _OnGpu()
    from testing.kernels.emulate_fused import FusedEmulator

    kern = FusedEmulator()
    kern.device = "cpu"
    return kern


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1000])  # under, over and not a multiple of the block
def test_add_rms_norm_matches_reference_and_eager(emu, dtype, hidden):
    seed = random.randrange(1 << 30)
    g, t = _gen(seed), DTYPES[dtype]
    residual = torch.randn(3, hidden, generator=g).to(emu.device, t)
    delta = torch.randn(3, hidden, generator=g).to(emu.device, t)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(emu.device, t)
    norm = RMSNorm(hidden, 1e-5).to(emu.device)
    norm.weight.data = weight.clone()
    eager_res = residual + delta
    eager_out = norm(eager_res)
    ref_res, ref_out = ref_add_rms_norm(residual, delta, weight, 1e-5)
    out = torch.full_like(residual, float("nan"))
    emu.add_rms_norm(residual, delta, weight, 1e-5, out)
    assert torch.equal(residual, eager_res), f"residual must be torch's x + delta exactly (seed {seed})"
    assert rel_error(out, ref_out) < TOL[dtype], f"seed {seed}"
    assert rel_error(out, eager_out.double()) < TOL[dtype], f"seed {seed}"
    assert rel_error(residual, ref_res) < TOL[dtype]


def test_rms_norm_without_delta_leaves_residual(emu):
    g = _gen(1)
    residual, weight = torch.randn(2, 96, generator=g).to(emu.device), torch.rand(96, generator=g).to(emu.device)
    before = residual.clone()
    out = torch.full_like(residual, float("nan"))
    emu.add_rms_norm(residual, None, weight, 1e-6, out)
    assert torch.equal(residual, before)
    assert rel_error(out, ref_add_rms_norm(before, None, weight, 1e-6)[1]) < 1e-5


def test_add_rms_norm_out_may_alias_delta(emu):
    g = _gen(2)
    residual, delta, weight = (x.to(emu.device) for x in (torch.randn(2, 300, generator=g),
                                                          torch.randn(2, 300, generator=g), torch.rand(300)))
    ref_res, ref_out = ref_add_rms_norm(residual, delta, weight, 1e-5)
    emu.add_rms_norm(residual, delta, weight, 1e-5, delta)
    assert rel_error(delta, ref_out) < 1e-5 and rel_error(residual, ref_res) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference_and_eager(emu, dtype):
    seed = random.randrange(1 << 30)
    t = DTYPES[dtype]
    gate_up = (3 * torch.randn(4, 2 * 300, generator=_gen(seed))).to(emu.device, t)
    out = torch.full((4, 300), float("nan"), dtype=t, device=emu.device)
    emu.silu_and_mul(gate_up, out)
    gate, up = gate_up.split(300, dim=-1)
    assert rel_error(out, ref_silu_and_mul(gate_up)) < TOL[dtype], f"seed {seed}"
    assert rel_error(out, (F.silu(gate) * up).double()) < TOL[dtype], f"seed {seed}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 64), (9, 3, 64), (8, 8, 128)])  # GQA, SmolLM2's, MHA
def test_rope_and_cache_matches_reference_and_eager(emu, dtype, heads):
    nq, nkv, head = heads
    seed = random.randrange(1 << 30)
    g, t, n, bs, blocks = _gen(seed), DTYPES[dtype], 5, 16, 4
    dev = emu.device
    qkv = torch.randn(n, (nq + 2 * nkv) * head, generator=g).to(dev, t)  # one fused projection's rows
    q, k, v = (x.view(n, -1, head) for x in qkv.split([nq * head, nkv * head, nkv * head], dim=-1))
    positions = torch.tensor([0, 7, 8, 300, 4095], dtype=torch.int64, device=dev)
    slots = torch.tensor([3, 17, -1, 40, 63], dtype=torch.int64, device=dev)  # -1: a padding token
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head, torch.device(dev))
    cos, sin = rotary.cos_sin(positions, t)
    eager_q, eager_k = apply_rotary(q.clone(), cos, sin), apply_rotary(k.clone(), cos, sin)
    ref_q, ref_k = ref_rotary(q, positions, rotary.inv_freq), ref_rotary(k, positions, rotary.inv_freq)
    v_in = v.clone()
    k_cache = torch.full((blocks, bs, nkv, head), float("nan"), dtype=t, device=dev)
    v_cache = torch.full_like(k_cache, float("nan"))
    emu.rope_and_cache(q, k, v, k_cache, v_cache, positions, slots, rotary.inv_freq)
    assert rel_error(q, ref_q) < TOL[dtype] and rel_error(k, ref_k) < TOL[dtype], f"seed {seed}"
    assert rel_error(q, eager_q.double()) < TOL[dtype] and rel_error(k, eager_k.double()) < TOL[dtype]
    flat_k, flat_v = k_cache.view(-1, nkv, head), v_cache.view(-1, nkv, head)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k[i]) and torch.equal(flat_v[slot], v_in[i])
    untouched = torch.ones(blocks * bs, dtype=torch.bool, device=dev)
    untouched[slots[slots >= 0]] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()


def test_bad_arguments_name_the_argument():
    from cupy_kernels import fused_layers

    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="weight"):
        fused_layers.check_add_rms_norm(torch.empty_like(x), x, None, torch.ones(63))
    with pytest.raises(ValueError, match="out: must not alias residual"):
        fused_layers.check_add_rms_norm(x, x, None, torch.ones(64))
    with pytest.raises(ValueError, match="gate_up"):
        fused_layers.check_silu_and_mul(torch.empty(2, 32), torch.randn(2, 63))
    with pytest.raises(ValueError, match="out"):
        fused_layers.check_silu_and_mul(torch.empty(2, 31), torch.randn(2, 64))
    cache = torch.zeros(2, 16, 2, 64)
    pos = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="inv_freq"):
        fused_layers.check_rope_and_cache(torch.zeros(3, 4, 64), torch.zeros(3, 2, 64), torch.zeros(3, 2, 64),
                                          cache, cache.clone(), pos, pos.clone(), torch.zeros(31))
    with pytest.raises(ValueError, match="slot_mapping"):
        fused_layers.check_rope_and_cache(torch.zeros(3, 4, 64), torch.zeros(3, 2, 64), torch.zeros(3, 2, 64),
                                          cache, cache.clone(), pos, torch.zeros(2, dtype=torch.int64),
                                          torch.zeros(32))
