"""The LoRA kernel of the fused CPU decode stack (executor_svc/csrc/lora_cpu.c), alone: a tile of
tokens of one slot gives each token exactly its delta alone (a token's sums never depend on its
step), equal to a float64 reference; only the slot's sub-projections' output columns change;
bfloat16 slots compute with their rounded weights; tokens are cut into tiles of one slot."""

from __future__ import annotations

import ctypes

import pytest
import torch

from executor_svc.cpu_ops import native_ops
from executor_svc.lora.slots import ProjectionSlots
from executor_svc.model.architecture import ModelConfig, RopeConfig

TILE = 3  # PS_LORA_TILE
HIDDEN, INTER = 80, 200  # (not multiples of 16: the lanes' tails run too)


@pytest.fixture(scope="module")
def lib():
    lib = native_ops().lib
    lib.ps_lora_tile.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.ps_lora_tiles.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.ps_lora_check.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def _cfg() -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", 100, HIDDEN, INTER, 1, 5, 1, 16, 1e-5, RopeConfig(10000.0), 64,
                       False, False, False, "float32", (0,))


def _gate_up(dtype: torch.dtype, rank: int = 5, seed: int = 0) -> tuple[ProjectionSlots, dict]:
    """gate/up slots (two sub-projections: a block-diagonal B); slot 1 holds both, slot 2 only up_proj."""
    g = torch.Generator().manual_seed(seed)
    p = ProjectionSlots.empty(_cfg(), ("gate_proj", "up_proj"), 3, 8, torch.device("cpu"), dtype)
    both = {m: (torch.randn(rank, HIDDEN, generator=g), torch.randn(INTER, rank, generator=g))
            for m in ("gate_proj", "up_proj")}
    p.write(1, both, 0.5)
    p.write(2, {"up_proj": both["up_proj"]}, 2.0)
    return p, both


def _tile(lib, p: ProjectionSlots, slot: int, tokens: list[int], x: torch.Tensor, y: torch.Tensor) -> None:
    desc = p.desc()
    toks = torch.tensor(tokens, dtype=torch.int32)
    lib.ps_lora_tile(ctypes.addressof(desc), slot, toks.data_ptr(), len(tokens), x.data_ptr(), x.stride(0),
                     y.data_ptr(), y.stride(0))


def _reference(p: ProjectionSlots, slot: int, x: torch.Tensor) -> torch.Tensor:
    """x [n, in] -> the slot's delta [n, out] in float64, from the slot's own (possibly rounded) tensors."""
    used = p.used[slot]
    a, bt = p.a[slot, :used].double(), p.bt[slot, :used].double()
    return (x.double() @ a.t()) @ bt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tile_gives_each_token_its_delta_alone(lib, dtype):
    p, _ = _gate_up(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, HIDDEN, generator=g)
    y0 = torch.randn(7, 2 * INTER, generator=g)
    tiled, alone = y0.clone(), y0.clone()
    _tile(lib, p, 1, [4, 0, 6], x, tiled)
    _tile(lib, p, 1, [2, 5], x, tiled)
    for t in (4, 0, 6, 2, 5):
        _tile(lib, p, 1, [t], x, alone)
    assert torch.equal(tiled, alone)  # bit for bit: a token's sums run in one order
    touched = [0, 2, 4, 5, 6]
    ref = y0.double()[touched] + _reference(p, 1, x[touched])
    torch.testing.assert_close(tiled[touched].double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(tiled[[1, 3]], y0[[1, 3]])  # tokens not in a tile are left alone
    assert not torch.equal(tiled[touched], y0[touched])


def test_only_the_slots_sub_projections_columns_change(lib):
    p, _ = _gate_up(torch.float32)
    assert p.segs[2, 0].tolist() == [0, 5, INTER, 2 * INTER] and p.segs[2, 1].tolist() == [0, 0, 0, 0]
    x = torch.randn(2, HIDDEN)
    y0 = torch.randn(2, 2 * INTER)
    y = y0.clone()
    _tile(lib, p, 2, [0, 1], x, y)
    assert torch.equal(y[:, :INTER], y0[:, :INTER])  # gate_proj: this adapter has none
    torch.testing.assert_close(y.double(), y0.double() + _reference(p, 2, x), rtol=1e-5, atol=1e-4)
    y = y0.clone()
    _tile(lib, p, 0, [0, 1], x, y)  # an empty slot adds nothing
    assert torch.equal(y, y0)


def test_bfloat16_slots_hold_the_rounded_weights(lib):
    p32, both = _gate_up(torch.float32)
    p16, _ = _gate_up(torch.bfloat16)
    a, _ = both["gate_proj"]
    assert torch.equal(p16.a[1, :5], a.to(torch.bfloat16))  # rounded once, when written
    assert p16.a.element_size() == 2 and p32.a.element_size() == 4
    x = torch.randn(3, HIDDEN)
    y32, y16 = torch.zeros(3, 2 * INTER), torch.zeros(3, 2 * INTER)
    _tile(lib, p32, 1, [0, 1, 2], x, y32)
    _tile(lib, p16, 1, [0, 1, 2], x, y16)
    torch.testing.assert_close(y16.double(), _reference(p16, 1, x), rtol=1e-5, atol=1e-4)
    gap = float((y16 - y32).abs().max() / y32.abs().max())
    assert 0 < gap < 2e-2  # bfloat16's rounding, no more


def test_tokens_cut_into_tiles_of_one_slot(lib):
    token_lora = torch.tensor([1, -1, 1, 0, 1, 1, 1, 0, -1], dtype=torch.int32)
    order = torch.argsort(token_lora.long(), stable=True).to(torch.int32)
    tiles = torch.full((len(order), 2), -7, dtype=torch.int32)
    count = lib.ps_lora_tiles(token_lora.data_ptr(), order.data_ptr(), len(order), tiles.data_ptr())
    cut = [order[k:k + c].tolist() for k, c in tiles[:count].tolist()]
    # slot -1 gets no tile; slot 0's two tokens one tile; slot 1's five tokens TILE and the rest
    assert cut == [[3, 7], [0, 2, 4], [5, 6]]
    assert all(len({int(token_lora[t]) for t in c}) == 1 and len(c) <= TILE for c in cut)


def _check(lib, p: ProjectionSlots, n_in: int, out: int) -> int:
    desc = p.desc()  # (kept alive through the call)
    return lib.ps_lora_check(ctypes.addressof(desc), n_in, out)


def test_bad_segments_are_refused(lib):
    p, _ = _gate_up(torch.float32)
    assert _check(lib, p, HIDDEN, 2 * INTER) == 0
    assert _check(lib, p, HIDDEN + 1, 2 * INTER) != 0  # another projection's
    p.segs[1, 0, 3] = 2 * INTER + 1  # outputs past the projection's
    assert _check(lib, p, HIDDEN, 2 * INTER) != 0
    p.segs[1, 0, 3] = INTER
    p.segs[1, 1, 1] = 17  # rank rows past the slot's 16
    assert _check(lib, p, HIDDEN, 2 * INTER) != 0
