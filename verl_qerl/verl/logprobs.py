"""Per-token log-probabilities from logits, in chunks of rows: verl's path when flash-attn is missing.

verl 0.9.1 takes the log-probability of each sampled token with flash-attn's Triton cross-entropy kernel when
the flash-attn package is installed. Without it (``logprobs_from_logits_v2``) it loops over the rows of the
logits in Python: one ``log_softmax`` and one ``gather`` per token, i.e. 8,704 of each for a micro-batch of
4 x 2,176 tokens, and as many autograd nodes in the backward. Machines without flash-attn (no wheel for the
installed torch, CPU CI) pay that in every actor pass of every micro-batch.

:func:`token_logprobs` computes the same quantity the way the flash-attn kernel does (log-sum-exp in fp32,
result in fp32) over chunks of rows, and its backward recomputes the softmax chunk by chunk from the saved
logits and log-sum-exp instead of keeping a second vocabulary-sized tensor. :func:`verl_logprobs_from_logits`
has verl's signature, so the FSDP engine can call it in place of verl's fallback
(:mod:`verl_qerl.verl.integration` swaps it in only where flash-attn's kernel is absent).
"""

from __future__ import annotations

import torch

#: Elements of one fp32 chunk (rows x vocabulary): 2^26 x 4 B = 256 MiB, ~440 rows of Qwen2.5's 151,936.
CHUNK_ELEMENTS = 1 << 26


def _chunk_rows(vocab: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(1, vocab))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_elements: int) -> torch.Tensor:
        rows, vocab = logits.shape
        step = _chunk_rows(vocab, chunk_elements)
        out = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for start in range(0, rows, step):
            x = logits[start:start + step].float()
            lse_chunk = torch.logsumexp(x, dim=-1)
            lse[start:start + step] = lse_chunk
            out[start:start + step] = x.gather(-1, labels[start:start + step, None]).squeeze(-1) - lse_chunk
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_elements = chunk_elements
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        step = _chunk_rows(vocab, ctx.chunk_elements)
        grad_out = grad_out.float()
        grad_logits = torch.empty_like(logits)
        for start in range(0, rows, step):
            g = grad_out[start:start + step, None]
            # d(x_y - logsumexp(x)) / dx_j = [j == y] - softmax(x)_j
            chunk = torch.exp(logits[start:start + step].float() - lse[start:start + step, None]).mul_(-g)
            chunk.scatter_add_(-1, labels[start:start + step, None], g)
            grad_logits[start:start + step] = chunk
        return grad_logits, None, None


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, chunk_elements: int = CHUNK_ELEMENTS
                   ) -> torch.Tensor:
    """``log_softmax(logits.float(), -1)`` gathered at ``labels``, in fp32, shape ``logits.shape[:-1]``.

    ``logits`` is ``(..., vocab)`` of any floating dtype, ``labels`` integer ids of shape ``logits.shape[:-1]``.
    Differentiable in ``logits`` (the gradient comes back in ``logits.dtype``). Peak extra memory is one
    fp32 chunk of ``chunk_elements`` (plus the fp32 output and log-sum-exp, 8 bytes per row).
    """
    if not logits.is_floating_point():
        raise TypeError(f"token_logprobs: logits must be floating point, got {logits.dtype}")
    if logits.dim() < 1 or labels.shape != logits.shape[:-1]:
        raise ValueError(f"token_logprobs: labels of shape {tuple(labels.shape)} do not match logits "
                         f"{tuple(logits.shape)} without the vocabulary dimension")
    if labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"token_logprobs: labels must be integer token ids, got {labels.dtype}")
    vocab = logits.shape[-1]
    if labels.numel():
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token_logprobs: label ids span [{lo}, {hi}], outside the vocabulary of {vocab}")
    flat = _TokenLogprobs.apply(logits.reshape(-1, vocab), labels.reshape(-1).long(), chunk_elements)
    return flat.view(labels.shape)


def verl_logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True
                              ) -> torch.Tensor:
    """verl's ``logprobs_from_logits(logits, labels, inplace_backward)`` computed by :func:`token_logprobs`.

    ``inplace_backward`` is accepted for verl's signature; the gradient is always a fresh tensor (the logits
    stay intact for an entropy term that also needs them).
    """
    del inplace_backward
    return token_logprobs(logits, labels)
