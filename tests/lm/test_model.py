"""Unit tests of the MoE transformer (tier 1: one process, no devices)."""
from __future__ import annotations

import pytest
import torch

from lm.data import MASK_ID
from lm.model import (ENGINES, IGNORE_INDEX, PRESETS, ModelPreset, MoETransformer, get_preset,
                       init_parameters, is_expert_param, lm_batch, lm_loss, model_flops_per_token, param_counts)


def _model(preset="tiny-gpt", engine="mpipemoe", seed=0, **changes):
    model = MoETransformer(get_preset(preset).replace(**changes), engine=engine)
    init_parameters(model, seed)
    return model


def _expected_counts(p: ModelPreset) -> tuple[int, int]:
    """(replicated, expert) parameter counts written out from the architecture."""
    D, H, E = p.d_model, p.d_hidden, p.num_experts
    per_block_replicated = 2 * D + (3 * D * D + 3 * D) + (D * D + D) + 2 * D + E * D
    per_block_expert = E * (D * H + H + H * D + D)
    replicated = p.vocab_size * D + p.seq_len * D + p.num_layers * per_block_replicated + 2 * D
    return replicated, p.num_layers * per_block_expert


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-bert"])
def test_tiny_preset_parameter_counts(name):
    counts = param_counts(_model(name))
    replicated, expert = _expected_counts(get_preset(name))
    assert counts == {"params_total": replicated + expert, "params_expert": expert,
                      "params_replicated": replicated}
    assert counts["params_total"] == 703_104


def test_paper_presets_have_the_paper_shapes():
    assert (PRESETS["gpt-s"].d_model, PRESETS["gpt-s"].d_hidden, PRESETS["gpt-s"].num_layers) == (1024, 4096, 24)
    assert (PRESETS["gpt-xl"].d_model, PRESETS["gpt-xl"].d_hidden) == (2048, 8192)
    assert PRESETS["bert-l"].kind == "bert" and PRESETS["bert-l"].num_heads == 16
    assert all(PRESETS[name].num_experts == 8 for name in ("gpt-s", "gpt-xl", "bert-l"))


@pytest.mark.parametrize("change, field", [({"num_heads": 5}, "num_heads"), ({"kind": "t5"}, "kind"),
                                           ({"d_model": 0}, "d_model"), ({"top_k": 9}, "top_k"),
                                           ({"norm": "batchnorm"}, "norm"), ({"positions": "alibi"}, "positions"),
                                           ({"router_rule": "sinkhorn"}, "router_rule"), ({"bias": 1}, "bias"),
                                           ({"norm_eps": 0.0}, "norm_eps"), ({"rope_theta": -1.0}, "rope_theta"),
                                           ({"positions": "rotary", "num_heads": 128}, "positions")])
def test_bad_preset_names_the_field(change, field):
    with pytest.raises(ValueError, match=rf"ModelPreset\.{field}="):
        get_preset("tiny-gpt").replace(**change)


def test_the_original_architecture_records_as_before_and_the_mixtral_one_in_full():
    """Checkpoints store ``as_dict``: the presets of the original architecture without the
    architecture fields (their older checkpoints compare equal on resume), tiny-mixtral with them."""
    assert set(get_preset("tiny-gpt").as_dict()) == {"kind", "d_model", "d_hidden", "num_layers", "num_heads",
                                                     "num_experts", "seq_len", "top_k", "capacity_factor",
                                                     "activation", "vocab_size"}
    mixtral = get_preset("tiny-mixtral")
    assert ModelPreset(**mixtral.as_dict()) == mixtral
    assert {k: mixtral.as_dict()[k] for k in ("norm", "positions", "bias", "router_rule")} == \
        {"norm": "rmsnorm", "positions": "rotary", "bias": False, "router_rule": "topk-then-softmax"}


def test_a_mixtral_style_model_has_no_biases_nor_position_table():
    model = _model("tiny-mixtral")
    names = [name for name, _ in model.named_parameters()]
    assert not [n for n in names if n.endswith("bias") or n.endswith(("b1", "b2")) or "pos_embed" in n]
    assert "blocks.0.moe.experts.w3" in names and "blocks.0.ln1.weight" in names
    assert model.blocks[0].moe.config.router_rule == "topk-then-softmax" and not model.blocks[0].moe.config.bias


def test_only_dropless_decoders_of_mixtrals_architecture_export_as_mixtral():
    from lm.model import is_mixtral_style

    mixtral = get_preset("tiny-mixtral")
    assert is_mixtral_style(mixtral) and is_mixtral_style(get_preset("mixtral-s"))
    assert not is_mixtral_style(mixtral.replace(capacity_factor=1.25))  # transformers' Mixtral drops no token
    assert not is_mixtral_style(mixtral.replace(activation="gelu"))
    assert not is_mixtral_style(get_preset("tiny-gpt"))


def test_rotary_scores_depend_on_the_distance_between_positions_only():
    from lm.model import apply_rotary, rotary_cos_sin

    g = torch.Generator().manual_seed(0)
    q_d, k_d = torch.randn(2, 32, generator=g, dtype=torch.float64)
    cos_Sd, sin_Sd = (t.double() for t in rotary_cos_sin(20, 32, 10000.0, torch.device("cpu")))

    def score(m, n):
        rotate = lambda x, p: apply_rotary(x[None, None, None], cos_Sd[p:p + 1], sin_Sd[p:p + 1])  # noqa: E731
        return float((rotate(q_d, m) * rotate(k_d, n)).sum())

    assert score(7, 3) == pytest.approx(score(15, 11), rel=1e-6)  # distance 4 both times
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)
    assert score(0, 0) == pytest.approx(float(q_d @ k_d), rel=1e-12)  # position 0: no rotation


def test_experts_must_divide_by_the_expert_parallel_degree():
    preset = get_preset("tiny-gpt")  # 4 experts
    with pytest.raises(ValueError, match=r"num_experts=4 .*multiple of the expert-parallel degree \(3, the number "
                                         r"of workers\).* use --expert-parallel 1 "):
        preset.check_world_size(3)
    preset.check_world_size(8, expert_parallel=4)  # fewer experts than workers: 2 expert groups of 4
    preset.check_world_size(8, expert_parallel=2)
    with pytest.raises(ValueError, match=r"degree \(8, --expert-parallel\), which must divide the 8 workers; use "
                                         r"--expert-parallel 1, 2, 4 "):
        preset.check_world_size(8, expert_parallel=8)
    with pytest.raises(ValueError, match=r"use --expert-parallel 1, 2 \("):
        preset.check_world_size(6, expert_parallel=4)  # divides the experts, not the workers
    assert get_preset("gpt-s").check_world_size(64, expert_parallel=8) is None
    with pytest.raises(ValueError, match="preset='nope' is unknown"):
        get_preset("nope")


def test_output_shapes_and_aux_loss():
    model = _model()
    tokens_BS = torch.randint(0, 256, (3, 17))
    logits_BSV, aux_loss = model(tokens_BS)
    assert logits_BSV.shape == (3, 17, 259)
    assert aux_loss.dim() == 0 and torch.isfinite(aux_loss)
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_gpt_is_causal_and_bert_is_not():
    tokens_BS = torch.randint(0, 256, (1, 16))
    changed_BS = tokens_BS.clone()
    changed_BS[0, 10] = (changed_BS[0, 10] + 1) % 256
    with torch.no_grad():
        for name, causal in (("tiny-gpt", True), ("tiny-bert", False)):
            model = _model(name)
            before, _ = model(tokens_BS)
            after, _ = model(changed_BS)
            assert torch.allclose(before[0, :10], after[0, :10], atol=1e-6) == causal, name
            assert not torch.allclose(before[0, 10:], after[0, 10:])


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-bert"])
def test_engines_give_the_same_loss_and_gradients(preset):
    window_BS = torch.randint(0, 256, (4, 65 if preset == "tiny-gpt" else 64),
                              generator=torch.Generator().manual_seed(3))
    results = {}
    for engine in ENGINES:
        model = _model(preset, engine)
        inputs_BS, targets_BS = lm_batch(model.preset.kind, window_BS, MASK_ID, 259,
                                         torch.Generator().manual_seed(1))
        logits_BSV, aux_loss = model(inputs_BS)
        loss = lm_loss(logits_BSV, targets_BS) + 0.01 * aux_loss
        loss.backward()
        results[engine] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    ref_loss, ref_grads = results["mpipemoe"]
    for engine, (loss, grads) in results.items():
        assert loss == pytest.approx(ref_loss, rel=1e-5), engine
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{engine} {name}")


def test_init_is_reproducible_and_independent_of_expert_layout():
    full = _model(seed=5)
    again = _model(seed=5)
    for (name, a), (_, b) in zip(full.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    # Rank 1 of 2 holds global experts 2 and 3: its init equals those slices of the full model.
    w1 = full.blocks[0].moe.experts.w1
    slice_ = torch.empty(2, *w1.shape[1:])
    from lm.model import _normal_, _seed_for
    for i in range(2):
        _normal_(slice_[i], 0.02, _seed_for(5, "blocks.0.moe.experts.w1", 2 + i))
    assert torch.equal(slice_, w1[2:].detach())
    assert is_expert_param("blocks.0.moe.experts.w1") and not is_expert_param("blocks.0.moe.router.weight")


def test_masked_lm_batch():
    window_BS = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    inputs_BS, targets_BS = lm_batch("bert", window_BS, MASK_ID, 259, torch.Generator().manual_seed(0))
    chosen = targets_BS != IGNORE_INDEX
    assert 0.08 < chosen.float().mean() < 0.22
    assert torch.equal(targets_BS[chosen], window_BS[chosen])
    assert torch.equal(inputs_BS[~chosen], window_BS[~chosen])
    assert (inputs_BS[chosen] == MASK_ID).float().mean() > 0.6
    inputs_BS, targets_BS = lm_batch("gpt", window_BS, MASK_ID, 259)
    assert torch.equal(inputs_BS, window_BS[:, :-1]) and torch.equal(targets_BS, window_BS[:, 1:])


def _bert_batch_on(device):
    window_BS = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0)).to(device)
    return lm_batch("bert", window_BS, MASK_ID, 259, torch.Generator().manual_seed(0))


@pytest.mark.gpu
def test_a_bert_batch_on_cuda_is_the_cpu_one_and_does_not_wait_for_the_device():
    """The masks are drawn on the host and copied from pinned memory without a sync (a
    pageable copy made the host wait for the queued backward before every micro-batch)."""
    from moe_engine.experts import runs_without_host_sync

    window_BS = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0)).cuda()
    torch.cuda.synchronize()
    assert runs_without_host_sync(lambda: lm_batch("bert", window_BS, MASK_ID, 259, torch.Generator()))
    for got, want in zip(_bert_batch_on(torch.device("cuda")), _bert_batch_on(torch.device("cpu"))):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_model_flops_per_token_counts_the_weights_a_token_passes_through(activation):
    """6 FLOPs per weight a token multiplies (top_k of the experts, the tied head; not the
    embedding lookups, nor biases and norms), from the real model's parameters, plus attention."""
    preset = get_preset("tiny-gpt").replace(activation=activation, top_k=2)
    with torch.device("meta"):
        model = MoETransformer(preset, engine="fastmoe")
    weights = 0.0
    for name, param in model.named_parameters():
        expert = is_expert_param(name)  # [E, ...]: one matrix (or bias vector) per expert
        if param.dim() - expert < 2 or "embed" in name:
            continue
        weights += param.numel() * (preset.top_k / preset.num_experts if expert else 1)
    weights += preset.d_model * preset.vocab_size  # the head, tied to the token embedding
    attention = 12 * preset.num_layers * preset.d_model * preset.seq_len
    assert model_flops_per_token(preset) == pytest.approx(6 * weights + attention)


def test_gpt_s_flops_per_token_as_documented():
    # docs/training.md, "Throughput and MFU": 3.32 GFLOP per token for gpt-s (top-2 of 8)
    assert model_flops_per_token(get_preset("gpt-s")) == pytest.approx(3.32e9, rel=5e-3)


def test_a_memory_budget_is_shared_by_every_moe_layer_and_steers_their_choices():
    from lm.model import preset_moe_config
    from moe_engine import MemoryBudget
    from moe_engine.memory import predict_memory

    preset = get_preset("tiny-gpt")
    config = preset_moe_config(preset)
    batch = 2
    tokens = batch * preset.seq_len

    def need(n, strategy):  # every layer's saved tensors, one working set
        e = predict_memory(config, tokens, 1, n, strategy, dtype=torch.float32)
        return preset.num_layers * e.saved_bytes + e.peak_bytes - e.saved_bytes
    budget = need(1, "S4")  # keeping everything ("none", the fastest at n = 1) does not fit
    assert need(1, "none") > budget
    torch.manual_seed(0)
    model = MoETransformer(preset, memory_budget=budget)
    layers = [block.moe for block in model.blocks]
    assert all(layer.planner.memory_budget == MemoryBudget(budget, layers=preset.num_layers) for layer in layers)
    for _ in range(3):
        logits, aux = model(torch.randint(0, 256, (batch, preset.seq_len)))
        (logits.float().square().mean() + aux).backward()
        assert all(need(layer.last_partitions, layer.last_strategy) <= budget for layer in layers)
    # ... and without one, the model builds its layers without
    assert MoETransformer(preset).blocks[0].moe.planner.memory_budget is None


def test_under_autocast_the_residual_stream_and_layer_norms_run_in_the_compute_dtype():
    """The trainer's mixed precision: float32 parameters under bf16 autocast. The blocks'
    inputs, the LayerNorm outputs and the MoE layers' inputs and outputs are bf16 (autocast
    alone keeps the stream float32 and casts it again before every GEMM); parameter
    gradients are float32; the loss stays near the float32 model's."""
    model = _model("tiny-gpt")
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen[name] = (inputs[0].dtype, (output[0] if isinstance(output, tuple) else output).dtype)
        return hook
    block = model.blocks[0]
    for name, module in (("block", block), ("ln1", block.ln1), ("ln2", block.ln2), ("moe", block.moe),
                         ("ln_f", model.ln_f)):
        module.register_forward_hook(record(name))
    inputs, targets = lm_batch("gpt", torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0)),
                               MASK_ID, 259)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, aux = model(inputs)
        loss = lm_loss(logits, targets)
    loss.backward()
    assert all(dtypes == (torch.bfloat16, torch.bfloat16) for dtypes in seen.values()), seen
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        reference = lm_loss(model(inputs)[0], targets)
    assert abs(float(loss) - float(reference)) < 0.02 * float(reference)


def test_the_lm_head_pads_its_rows_for_the_product_and_keeps_the_logits():
    """The byte vocabulary's 259 rows are padded to 264 for the product (aligned operands);
    the logits are those of the unpadded head."""
    model = _model("tiny-gpt")
    hidden = torch.randn(2, 5, 128)
    logits = model._lm_head(hidden)
    assert logits.shape == (2, 5, 259)
    torch.testing.assert_close(logits, torch.nn.functional.linear(hidden, model.tok_embed.weight))


def test_one_rank_without_a_memory_budget_runs_one_partition():
    """With one rank nothing is sent for partitions to hide and, without a budget, nothing
    needs their memory saving: the model runs n = 1 rather than searching; a budget keeps
    the search."""
    assert all(block.moe.partitions == 1 for block in _model("tiny-gpt").blocks)
    budgeted = MoETransformer(get_preset("tiny-gpt"), memory_budget=2**30)
    assert all(block.moe.partitions == "auto" for block in budgeted.blocks)


def test_a_bert_batch_on_cuda_is_the_cpu_one_and_does_not_wait_for_the_device_cpu_twin():
    """The GPU test's setup on CPU: the same seed gives the same masked batch."""
    for got, want in zip(_bert_batch_on(torch.device("cpu")), _bert_batch_on(torch.device("cpu"))):
        assert torch.equal(got, want)
