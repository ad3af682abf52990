"""Op dispatch decided once: a CustomOp takes forward_cpu (the C++ kernels) or forward_native (torch) on
its first call and keeps that choice; either way its outputs are the torch path's."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import RopeConfig
from pagedllm.layers import custom_op, sampler
from pagedllm.layers.activation import ActAndMul, get_act_and_mul
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding


def _count_kernel_questions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    asked: list[int] = []
    real = custom_op.load_cpu_kernels

    def counting() -> bool:
        asked.append(1)
        return real()

    monkeypatch.setattr(custom_op, "load_cpu_kernels", counting)
    return asked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_chooses_once_and_matches_the_torch_path(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _count_kernel_questions(monkeypatch)
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6, dtype)
    norm.weight.data = torch.randn(64).to(dtype)
    x, residual = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    want = norm.forward_native(x.clone(), residual.clone())
    for _ in range(3):
        got = norm(x.clone(), residual.clone())
        assert torch.allclose(got[0].float(), want[0].float(), atol=1e-5 if dtype == torch.float32 else 0)
        assert torch.equal(got[1], want[1])
        assert torch.allclose(norm(x).float(), norm.forward_native(x).float(),
                              atol=1e-5 if dtype == torch.float32 else 0)
    assert len(asked) == 1, "the implementation is chosen on the first call only"
    assert norm._impl in (RMSNorm.forward_cpu, RMSNorm.forward_native)
    q = torch.randn(5, 4, 64).to(dtype)  # a layout the kernel does not take: the torch path, same result
    assert torch.equal(norm(q), norm.forward_native(q))


def test_act_and_mul_and_rotary_match_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _count_kernel_questions(monkeypatch)
    torch.manual_seed(0)
    gate_up = torch.randn(6, 2 * 32).to(torch.bfloat16)
    silu = get_act_and_mul("silu")
    for _ in range(2):
        assert torch.equal(silu(gate_up), silu.forward_native(gate_up))
    gelu = get_act_and_mul("gelu")
    assert torch.equal(gelu(gate_up), gelu.forward_native(gate_up))
    assert gelu._impl is ActAndMul.forward_native  # no kernel for gelu: never asks
    rotary = RotaryEmbedding(16, 64, RopeConfig(theta=10000.0), torch.bfloat16)
    cos_sin = rotary.lookup(torch.arange(6))
    q, k = torch.randn(6, 4, 16).to(torch.bfloat16), torch.randn(6, 2, 16).to(torch.bfloat16)
    want = rotary.forward_native(cos_sin, q.clone(), k.clone())
    for _ in range(2):
        got = rotary(cos_sin, q.clone(), k.clone())
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(asked) == 2  # silu once, rotary once


def test_argmax_rows_chooses_once() -> None:
    x = torch.randn(4, 100)
    assert torch.equal(sampler.argmax_rows(x), x.argmax(dim=-1))
    chosen = sampler._cpu_argmax_rows
    assert chosen is not sampler._choose_cpu_argmax_rows
    assert torch.equal(sampler.argmax_rows(x.t().contiguous().t()), x.argmax(dim=-1))  # strided: torch's
    assert sampler._cpu_argmax_rows is chosen
