"""verl_qerl.verl.logprobs: chunked token log-probs against a float64 reference and verl's own fallback."""

from __future__ import annotations

import pytest
import torch

from verl_qerl.verl.logprobs import token_logprobs, verl_logprobs_from_logits


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,chunk", [((37, 1001), 4000), ((3, 5, 257), 1 << 26), ((1, 64), 1), ((0, 11), 64)])
def test_forward_and_gradient_match_float64(dtype, shape, chunk):
    g = torch.Generator().manual_seed(hash((shape, chunk)) % 2**31)
    logits = (torch.randn(*shape, generator=g) * 4).to(dtype).requires_grad_(True)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=g)
    out = token_logprobs(logits, labels, chunk_elements=chunk)
    assert out.dtype == torch.float32 and out.shape == labels.shape
    ref_in = logits.detach().double().requires_grad_(True)
    ref = _reference(ref_in, labels)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    weights = torch.randn(labels.shape, generator=g)
    (out * weights).sum().backward()
    (ref * weights.double()).sum().backward()
    assert logits.grad.dtype == dtype and logits.grad.shape == logits.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits.grad.double(), ref_in.grad, rtol=tol, atol=tol)


def test_chunking_does_not_change_the_result():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(50, 333, generator=g)
    labels = torch.randint(0, 333, (50,), generator=g)
    whole = token_logprobs(logits, labels, chunk_elements=1 << 30)
    for chunk in (1, 333, 334, 5000):
        assert torch.equal(token_logprobs(logits, labels, chunk_elements=chunk), whole), chunk


def test_matches_verls_fallback_in_float32():
    """verl's ``logprobs_from_logits_v2`` (the per-row loop this replaces) on fp32 logits: same numbers."""
    verl_F = pytest.importorskip("verl.utils.torch_functional")
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 9, 513, generator=g) * 3
    labels = torch.randint(0, 513, (2, 9), generator=g)
    theirs = verl_F.logprobs_from_logits_v2(logits, labels)
    torch.testing.assert_close(verl_logprobs_from_logits(logits, labels), theirs, rtol=1e-6, atol=1e-6)


def test_bad_input_is_refused_with_the_reason():
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="outside the vocabulary of 10"):
        token_logprobs(logits, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="do not match logits"):
        token_logprobs(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        token_logprobs(logits, torch.zeros(4))
    with pytest.raises(TypeError, match="floating point"):
        token_logprobs(torch.zeros(4, 10, dtype=torch.long), torch.zeros(4, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_matches_float64_at_qwen_vocabulary():
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = (torch.randn(1100, 151936, device="cuda", generator=g) * 3).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 151936, (1100,), device="cuda", generator=g)
    out = token_logprobs(logits, labels)
    ref_in = logits.detach().double().requires_grad_(True)
    ref = _reference(ref_in, labels)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_in.grad, rtol=1e-2, atol=1e-2)
