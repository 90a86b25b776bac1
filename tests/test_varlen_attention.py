"""verl_qerl.verl.varlen_attention: packed rows through a transformers model equal each sequence run alone."""

from __future__ import annotations

import pytest
import torch

from verl_qerl.verl import varlen_attention as va

transformers = pytest.importorskip("transformers")


def _tiny_qwen2(attn: str, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=256,
                                   attn_implementation=attn)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_boundaries_from_packed_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    cu, max_len = va.packed_boundaries(pos)
    assert cu.tolist() == [0, 3, 5, 6, 10] and cu.dtype == torch.int32 and max_len == 4
    cu, max_len = va.packed_boundaries(torch.tensor([[5, 6, 7, 2, 3]]))  # restarts anywhere, not only at 0
    assert cu.tolist() == [0, 3, 5] and max_len == 3
    with pytest.raises(va.VarlenAttentionError, match="expected"):
        va.packed_boundaries(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(va.VarlenAttentionError, match="no position_ids"):
        va.packed_boundaries(None)


def test_packed_forward_and_grad_equal_each_sequence_alone():
    va.register()
    model = _tiny_qwen2(va.QERL_VARLEN)
    ref = _tiny_qwen2("sdpa")
    ref.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(7)
    lengths = [5, 1, 12, 7]
    seqs = [torch.randint(0, 97, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(input_ids=ids, position_ids=pos, attention_mask=None).logits[0]
    alone = torch.cat([ref(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # without the boundaries the packed row would attend across sequences: the test can tell
    fused = ref(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    assert (fused[lengths[0]:] - alone[lengths[0]:]).abs().max() > 1e-3

    model.train()
    ref.train()
    packed = model(input_ids=ids, position_ids=pos).logits[0]
    packed.square().mean().backward()
    torch.cat([ref(input_ids=s[None]).logits[0] for s in seqs]).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_refuses_padded_batches_and_unsupported_options():
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 2, 6, 8)
    pos = torch.arange(6)[None]
    with pytest.raises(va.VarlenAttentionError, match="use_remove_padding=True"):
        va.varlen_attention_forward(None, q, kv, kv, torch.ones(1, 1, 6, 6, dtype=torch.bool), position_ids=pos)
    with pytest.raises(va.VarlenAttentionError, match="batch of 2 rows"):
        va.varlen_attention_forward(None, q.expand(2, -1, -1, -1), kv, kv, None, position_ids=pos)
    with pytest.raises(va.VarlenAttentionError, match="dropout"):
        va.varlen_attention_forward(None, q, kv, kv, None, dropout=0.1, position_ids=pos)
    with pytest.raises(va.VarlenAttentionError, match="sliding window"):
        va.varlen_attention_forward(None, q, kv, kv, None, sliding_window=4, position_ids=pos)
    with pytest.raises(va.VarlenAttentionError, match="cover 5"):
        va.varlen_attention_forward(None, q, kv, kv, None, position_ids=torch.arange(5)[None])


def test_config_check_refuses_varlen_with_padding():
    pytest.importorskip("omegaconf")
    from omegaconf import OmegaConf

    from verl_qerl.verl.config import QeRLConfigError, _check_packed_attention

    bad = OmegaConf.create({"actor_rollout_ref": {"model": {"use_remove_padding": False, "override_config": {
        "attn_implementation": va.QERL_VARLEN}}}})
    with pytest.raises(QeRLConfigError, match="use_remove_padding=True"):
        _check_packed_attention(bad)
    ok = OmegaConf.create({"actor_rollout_ref": {"model": {"use_remove_padding": True, "override_config": {
        "attn_implementation": va.QERL_VARLEN}}}})
    _check_packed_attention(ok)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("heads,kv_heads", [(28, 4), (8, 8)])
def test_gpu_flash_path_matches_per_sequence_sdpa(heads, kv_heads):
    """PyTorch's varlen FlashAttention-2 vs causal SDPA per sequence in float32, forward and backward."""
    g = torch.Generator(device="cuda").manual_seed(11)
    lengths = [300, 1, 2049, 77]
    total = sum(lengths)
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    q = torch.randn(1, heads, total, 128, device="cuda", generator=g).bfloat16().requires_grad_(True)
    k = torch.randn(1, kv_heads, total, 128, device="cuda", generator=g).bfloat16().requires_grad_(True)
    v = torch.randn(1, kv_heads, total, 128, device="cuda", generator=g).bfloat16().requires_grad_(True)
    out, _ = va.varlen_attention_forward(None, q, k, v, None, scaling=128 ** -0.5, position_ids=pos)
    cu, _ = va.packed_boundaries(pos)
    qf, kf, vf = (t.detach().float()[0].transpose(0, 1).requires_grad_(True) for t in (q, k, v))
    ref = va._sdpa_per_sequence(qf, kf, vf, cu, 128 ** -0.5)
    assert out.shape == (1, total, heads, 128)
    torch.testing.assert_close(out[0].float(), ref, rtol=2e-2, atol=2e-2)
    w = torch.randn(out.shape, device="cuda", generator=g)
    (out.float() * w).sum().backward()
    (ref * w[0]).sum().backward()
    for got, want in ((q, qf), (k, kf), (v, vf)):
        torch.testing.assert_close(got.grad[0].transpose(0, 1).float(), want.grad, rtol=5e-2, atol=5e-2)


def test_verls_engine_packed_path_equals_its_padded_path():
    """verl's own FSDP engine code (prepare_model_inputs / prepare_model_outputs, no FSDP wrap): log-probs and
    entropy of one micro-batch through use_remove_padding=True + qerl_varlen equal use_remove_padding=False + SDPA,
    and their gradients too."""
    impl = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl")
    from types import SimpleNamespace

    import verl.utils.tensordict_utils as tu
    import verl.utils.torch_functional as verl_F
    from verl.utils.dataset.dataset_utils import DatasetPadMode

    from verl_qerl.verl.logprobs import verl_logprobs_from_logits

    # the plugin's hook (integration 6) ran when verl's engine module was imported: no flash-attn here
    assert impl.logprobs_from_logits is verl_logprobs_from_logits
    assert transformers.AttentionInterface._global_mapping[va.QERL_VARLEN] is va.varlen_attention_forward
    engine = object.__new__(impl.FSDPEngineWithLMHead)
    engine.pad_to_length, engine.pad_to_length_bucket = False, 1
    engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = False, 1
    engine.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    lengths = [9, 3, 14]

    def micro_batch(packed: bool):
        ids = tu.nested_tensor_from_tensor_list([torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n))
                                                 for n in lengths])
        pos = tu.nested_tensor_from_tensor_list([torch.arange(n) for n in lengths])
        td = tu.get_tensordict({"input_ids": ids, "position_ids": pos, "temperature": torch.full((3,), 0.7)})
        tu.assign_non_tensor(td, use_remove_padding=packed, pad_mode=DatasetPadMode.NO_PADDING,
                             calculate_entropy=True, use_fused_kernels=False)
        return td

    outs = {}
    for packed, attn in ((True, va.QERL_VARLEN), (False, "sdpa")):
        model = _tiny_qwen2(attn, seed=3)
        mb = micro_batch(packed)
        inputs, out_args = engine.prepare_model_inputs(mb)
        result = engine.prepare_model_outputs(model(**inputs, use_cache=False), out_args, mb, None)
        lp, ent = result["log_probs"].values(), result["entropy"].values()
        (lp.sum() + 0.1 * ent.sum()).backward()
        outs[packed] = (lp.detach().float(), ent.detach().float(),
                        torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert outs[True][0].shape == (sum(lengths),)
    for a, b in zip(outs[True], outs[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("signature", ["2.10", "2.12"])
def test_the_varlen_call_adapts_to_torch_s_signature(monkeypatch, signature):
    """torch 2.10's varlen_attn takes ``is_causal`` and no GQA flag; 2.12's ``window_size=(-1, 0)`` and
    ``enable_gqa``: each gets the causal, GQA-correct call (a stand-in records it and computes the reference)."""
    calls = []

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        calls.append(kw)
        return va._sdpa_per_sequence(q, k, v, cu_q, kw.get("scale", q.shape[-1] ** -0.5))

    if signature == "2.10":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            assert is_causal and key.shape[1] == query.shape[1]  # no GQA flag: K/V come repeated
            return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=is_causal)
    else:
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False):
            assert window_size == (-1, 0) and enable_gqa
            return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                             window_size=window_size, enable_gqa=enable_gqa)

    import inspect

    monkeypatch.setattr(va, "_varlen_attn", lambda: (fake, frozenset(inspect.signature(fake).parameters)))
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(9, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out = va._torch_varlen(q, k, v, cu, 5, 8 ** -0.5)
    torch.testing.assert_close(out, va._sdpa_per_sequence(q, k, v, cu, 8 ** -0.5))
    assert len(calls) == 1
    if signature == "2.10":
        with pytest.raises(va.VarlenAttentionError, match="no scale argument"):
            va._torch_varlen(q, k, v, cu, 5, 0.5)
