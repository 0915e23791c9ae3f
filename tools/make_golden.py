#!/usr/bin/env python3
"""Write the Hugging Face reference cases under tests/golden/ (see tests/golden/README.md).

For each case: build a tiny random HF model in float32 (fixed torch seed), save it with
save_pretrained, load it back, cast a copy to float64 and compute, with eager attention,
the logits, the losses (HF's outputs.loss with output_router_logits=True; cross-entropy only for
the sigmoid-router families GLM-4-MoE and DeepSeek-V3), d loss / d param for every parameter
under its Hub name, and the loss over 5 AdamW steps on the same batch.

HF's modeling code casts to float32 in a few places even in a float64 model (RMSNorm,
router softmax or sigmoid, attention softmax, RoPE angles and YaRN frequencies, the
load-balancing loss, the causal-LM loss).
For the reference these casts are replaced by the input dtype (`float64_numerics`); the
patched float64 result is checked against unpatched HF (float64 and float32) and against an
independent float64 formula of the loss, so the patches change rounding only.

Development tool only: the C++ tests read the committed outputs. Usage:
    python3 tools/make_golden.py --out tests/golden
"""

import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.modeling_rope_utils import _compute_yarn_parameters
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.glm4_moe import modeling_glm4_moe
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.mixtral import modeling_mixtral
from transformers.models.olmoe import modeling_olmoe
from transformers.models.qwen2_moe import modeling_qwen2_moe
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

# Optimizer settings of the adamw_loss trajectory (written to the metadata).
ADAMW = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0, steps=5)
ROUTER_AUX_LOSS_COEF = 0.02
MIN_ROUTING_GAP = 1e-3  # K-th minus (K+1)-th router probability, every layer, token and AdamW step

# Tiny models. gate_scale multiplies the initialised router weights (decisive routing);
# qk_scale multiplies q_proj/k_proj so attention is far from uniform (a RoPE or mask error
# then moves the logits visibly); norm_jitter sets RMSNorm weights to 1 + jitter * N(0,1)
# so a missing norm-weight multiply shows in the forward too.
CASES = {
    "mixtral_gqa": dict(arch="mixtral", seed=14, vocab=128, hidden=32, inter=64, layers=2, heads=4, kv_heads=2,
                        experts=4, top_k=2, T=16, rope_theta=1e6, sliding_window=None, pad_row1=0),
    "mixtral_e3_k1": dict(arch="mixtral", seed=2, vocab=100, hidden=48, inter=80, layers=2, heads=6, kv_heads=2,
                          experts=3, top_k=1, T=13, rope_theta=1e6, sliding_window=None, pad_row1=0),
    "mixtral_swa_padded": dict(arch="mixtral", seed=18, vocab=112, hidden=32, inter=56, layers=2, heads=4,
                               kv_heads=2, experts=4, top_k=2, T=14, rope_theta=1e6, sliding_window=5,
                               pad_row1=4),
    "mistral_dense": dict(arch="mistral", seed=4, vocab=128, hidden=32, inter=64, layers=2, heads=4, kv_heads=2,
                          T=12, rope_theta=1e6, sliding_window=None, pad_row1=0),
    "llama_dense": dict(arch="llama", seed=5, vocab=120, hidden=32, inter=56, layers=2, heads=4, kv_heads=4,
                        T=12, rope_theta=1e4, sliding_window=None, pad_row1=0),
    # Qwen3-MoE: 3 layers, layer 1 dense (mlp_only_layers) with its own intermediate_size between two
    # sparse ones; head_dim 12 != hidden / heads = 8; top-K weights NOT renormalised (the default).
    "qwen3_moe_mixed": dict(arch="qwen3_moe", seed=28, vocab=128, hidden=32, inter=40, moe_inter=24, layers=3,
                            heads=4, kv_heads=2, head_dim=12, experts=4, top_k=2, norm_topk_prob=False,
                            mlp_only_layers=[1], sparse_step=1, T=16, rope_theta=1e6, sliding_window=None,
                            pad_row1=0),
    # Qwen3-MoE with norm_topk_prob, decoder_sparse_step 2 (layers 1 and 3 sparse), padding.
    "qwen3_moe_norm_topk_padded": dict(arch="qwen3_moe", seed=30, vocab=112, hidden=32, inter=48, moe_inter=16,
                                       layers=4, heads=4, kv_heads=1, head_dim=8, experts=6, top_k=2,
                                       norm_topk_prob=True, mlp_only_layers=[], sparse_step=2, T=14,
                                       rope_theta=1e6, sliding_window=None, pad_row1=4),
    # Qwen2-MoE: q/k/v biases, a gated shared expert of its own width in every MoE layer, a dense layer
    # (mlp_only_layers [2]) after two sparse ones, norm_topk_prob false; row 1 right-padded by 3.
    "qwen2_moe_shared": dict(arch="qwen2_moe", seed=62, vocab=128, hidden=32, inter=40, moe_inter=16, shared_inter=24,
                             layers=3, heads=4, kv_heads=2, experts=4, top_k=2, norm_topk_prob=False,
                             mlp_only_layers=[2], sparse_step=1, T=15, rope_theta=1e6, sliding_window=None,
                             pad_row1=3),
    # OLMoE: q/k norms over the whole projections, clip_qkv 1.0 active on part of q, k and v (v_proj x 6
    # so v reaches it too), norm_topk_prob true; row 1 right-padded by 5.
    "olmoe_clip": dict(arch="olmoe", seed=68, vocab=120, hidden=32, inter=24, layers=2, heads=4, kv_heads=2,
                       experts=4, top_k=2, norm_topk_prob=True, clip_qkv=1.0, T=16, rope_theta=1e4,
                       sliding_window=None, pad_row1=5),
    # OLMoE defaults otherwise: norm_topk_prob false, no clip, MHA.
    "olmoe_plain": dict(arch="olmoe", seed=55, vocab=112, hidden=32, inter=32, layers=2, heads=4, kv_heads=4,
                        experts=4, top_k=2, norm_topk_prob=False, clip_qkv=None, T=12, rope_theta=1e4,
                        sliding_window=None, pad_row1=0),
    # Dense Qwen3 as the small ones are: q/k norms, head_dim 16 != hidden / heads = 8, tied embeddings.
    "qwen3_dense": dict(arch="qwen3", seed=25, vocab=120, hidden=32, inter=56, layers=2, heads=4, kv_heads=2,
                        head_dim=16, T=12, rope_theta=1e6, sliding_window=None, pad_row1=0, tie=True),
    # GLM-4.5 style: partial RoPE (first 8 of 16 head dims), per-head q/k norms, q/k/v biases, layer 0 dense,
    # sigmoid router with a score-correction bias, renormalised top-2 x 2.5, one ungated shared expert; padding.
    # Its routing concentrates within the first AdamW steps (no seed in 0-8000 and 12400-20400 keeps all 8
    # experts in use through step 2), so the AdamW steps need only 7 of 8; the reference pass uses all 8.
    "glm4_moe_partial": dict(arch="glm4_moe", seed=4369, adamw_min_experts=7, vocab=128, hidden=32, inter=48, moe_inter=16, layers=3,
                             heads=4, kv_heads=2, head_dim=16, partial_rotary_factor=0.5, use_qk_norm=True,
                             attention_bias=True, experts=8, top_k=2, n_shared=1, n_group=1, topk_group=1,
                             routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense=1, T=16,
                             rope_theta=1e6, sliding_window=None, pad_row1=3),
    # GLM-4.5-Air style: no q/k norms, every layer MoE, 2 groups of 4 experts (top-1 group), no renormalisation.
    "glm4_moe_air": dict(arch="glm4_moe", seed=541, vocab=112, hidden=32, inter=48, moe_inter=16, layers=2,
                         heads=4, kv_heads=2, head_dim=8, partial_rotary_factor=0.5, use_qk_norm=False,
                         attention_bias=True, experts=8, top_k=2, n_shared=2, n_group=2, topk_group=1,
                         routed_scaling_factor=1.0, norm_topk_prob=False, first_k_dense=0, T=14,
                         rope_theta=1e6, sliding_window=None, pad_row1=0),
    # DeepSeek-V3: MLA with a q LoRA, interleaved YaRN RoPE (attention_factor and softmax mscale != 1),
    # 4 groups of 2 experts (top-2 groups), top-3 renormalised x 2.5, shared width 2 x 16; padding.
    "deepseek_v3_mla_yarn": dict(arch="deepseek_v3", seed=689, vocab=128, hidden=32, inter=48, moe_inter=16,
                                 layers=3, heads=4, kv_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope=8,
                                 qk_rope=4, v_head=6, experts=8, top_k=3, n_shared=2, n_group=4, topk_group=2,
                                 routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense=1,
                                 rope_interleave=True, T=16, rope_theta=1e4,
                                 yarn=dict(factor=4.0, original_max_position_embeddings=64, beta_fast=32,
                                           beta_slow=1, mscale=0.8, mscale_all_dim=0.6),
                                 sliding_window=None, pad_row1=4),
    # DeepSeek-V3 with a plain q_proj, rotate-half RoPE (default type), one group, every layer MoE.
    "deepseek_v3_plain_q": dict(arch="deepseek_v3", seed=418, vocab=128, hidden=32, inter=48, moe_inter=16,
                                layers=2, heads=4, kv_heads=4, q_lora_rank=None, kv_lora_rank=12, qk_nope=8,
                                qk_rope=4, v_head=6, experts=6, top_k=2, n_shared=1, n_group=1, topk_group=1,
                                routed_scaling_factor=1.0, norm_topk_prob=False, first_k_dense=0,
                                rope_interleave=False, T=15, rope_theta=1e4, yarn=None, sliding_window=None,
                                pad_row1=0),
}
MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")
MOE_CLASSES = (MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM)
# Sigmoid-router MoE (DeepSeek-V3 style): cross-entropy only, no load-balancing loss in HF's outputs.loss.
SIGMOID_MOE_ARCHS = ("glm4_moe", "deepseek_v3")
SIGMOID_MOE_CLASSES = (Glm4MoeForCausalLM, DeepseekV3ForCausalLM)
SIGMOID_ROUTERS = (modeling_glm4_moe.Glm4MoeTopkRouter, modeling_deepseek_v3.DeepseekV3TopkRouter)
E_BIAS_SCALE = 0.1  # mlp.gate.e_score_correction_bias (HF inits it to 0): N(0, 0.1) so it changes some choices
MLA_KV_SCALE = 6.0  # MLA: kv_b_proj and kv_a_proj_with_mqa (k_nope, k_rope) scaled like q, attention far from uniform
V_SCALE_CLIP = 6.0  # olmoe_clip: v_proj scaled so that clip_qkv clips some v values too
BIAS_SCALE = 0.1  # q/k/v biases (HF initialises them to 0): N(0, 0.1) so a missing bias shows
GATE_SCALE = 10.0
QK_SCALE = 4.0
NORM_JITTER = 0.1
B = 2
MODULES = (modeling_mixtral, modeling_mistral, modeling_llama, modeling_qwen3, modeling_qwen3_moe, modeling_qwen2_moe,
           modeling_olmoe)
PREFIX = {modeling_mixtral: "Mixtral", modeling_mistral: "Mistral", modeling_llama: "Llama", modeling_qwen3: "Qwen3",
          modeling_qwen3_moe: "Qwen3Moe", modeling_qwen2_moe: "Qwen2Moe", modeling_olmoe: "Olmoe"}
SIGMOID_MODULES = {modeling_glm4_moe: "Glm4Moe", modeling_deepseek_v3: "DeepseekV3"}


# ---------------------------------------------------------------------------------------------
# float64 numerics: the same formulas as HF, without the float32 casts
# ---------------------------------------------------------------------------------------------

def _rmsnorm_forward(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_forward(self, x, position_ids):
    cfg = self.config
    assert self.rope_type == "default" and self.attention_scaling == 1.0
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    base = cfg.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _make_eager_attention(module_globals):
    repeat_kv = module_globals.repeat_kv

    def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key_states = repeat_kv(key, module.num_key_value_groups)
        value_states = repeat_kv(value, module.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
        return attn_output, attn_weights

    return eager_attention_forward


def rope_parameters_f64(cfg):
    """float64 inv_freq and attention_factor (the cos/sin multiplier) of a default or YaRN RoPE, the same
    formulas as transformers' _compute_default_rope_parameters / _compute_yarn_parameters (which run in
    float32), over the first int(head_dim * partial_rotary_factor) dims of a head."""
    rp = cfg.rope_parameters
    base = rp["rope_theta"]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dim = int(head_dim * rp.get("partial_rotary_factor", 1.0))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if rp["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    assert rp["rope_type"] == "yarn", rp
    factor = rp["factor"]
    if factor is None:
        factor = cfg.max_position_embeddings / rp["original_max_position_embeddings"]
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1
    orig = rp["original_max_position_embeddings"]

    def correction_dim(rotations):  # the dim index whose wavelength fits `rotations` times into orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    # ramp 0: extrapolation (the plain frequency), 1: interpolation (frequency / factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)
    return inv_freq, float(attention_factor)


def yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rotary_forward_general(self, x, position_ids):
    """Default or YaRN RoPE, partial rotary dims included, in float64 (cos/sin x attention_factor)."""
    inv_freq, attention_factor = rope_parameters_f64(self.config)
    assert self.rope_type in ("default", "yarn") and abs(attention_factor - self.attention_scaling) < 1e-15
    assert inv_freq.shape == self.inv_freq.shape
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_factor).to(x.dtype), (emb.sin() * attention_factor).to(x.dtype)


def route_sigmoid(scores_for_choice, n_group, topk_group, top_k):
    """HF's group-limited top-K choice (Glm4MoeTopkRouter / DeepseekV3TopkRouter): group score = sum of the
    group's two best scores, keep the topk_group best groups, top-K of the scores inside them. Returns the
    sorted choice [N, K], the topk_group-th minus (topk_group+1)-th group score (None if every group is
    kept) and the K-th minus (K+1)-th score among the allowed experts."""
    n, e = scores_for_choice.shape
    group_scores = scores_for_choice.view(n, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_gap = None
    if n_group > topk_group:
        gs = torch.sort(group_scores, dim=-1, descending=True).values
        group_gap = gs[:, topk_group - 1] - gs[:, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, topk_group, dim=-1)[1], 1)
    allowed = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(n, e).bool()
    assert topk_group * (e // n_group) > top_k
    masked = scores_for_choice.masked_fill(~allowed, float("-inf"))
    srt = torch.sort(masked, dim=-1, descending=True).values
    choice = torch.sort(torch.topk(masked, top_k, dim=-1)[1], dim=-1).values
    return choice, group_gap, srt[:, top_k - 1] - srt[:, top_k]


def _sigmoid_router_forward(self, hidden_states):
    """Glm4MoeTopkRouter / DeepseekV3TopkRouter.forward without the float32 casts (same selection rule)."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = (
        scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1))
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
                  .reshape(-1, self.num_experts))
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * self.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def _router_forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    router_probs = F.softmax(router_logits, dim=-1)
    top_value, top_index = torch.topk(router_probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises; Qwen3-MoE when configured
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value, top_index


def _load_balancing_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """HF's load_balancing_loss_func, accumulating in the logits' dtype instead of float32."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    dtype = gate_logits[0].dtype
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=dtype)
    router_prob_sum = torch.zeros(num_experts, dtype=dtype)
    total_rows = 0.0
    flat_mask = None if attention_mask is None else attention_mask.reshape(-1).to(dtype)
    for layer_gate in gate_logits:
        routing_weights = F.softmax(layer_gate, dim=-1)
        _, selected = torch.topk(routing_weights, top_k, dim=-1)
        row_weight = torch.ones(routing_weights.shape[0], dtype=dtype) if flat_mask is None else flat_mask
        tokens_per_expert_sum = tokens_per_expert_sum + torch.zeros(num_experts, dtype=dtype).scatter_add_(
            0, selected.reshape(-1), row_weight.repeat_interleave(top_k))
        router_prob_sum = router_prob_sum + (routing_weights * row_weight.unsqueeze(-1)).sum(dim=0)
        total_rows = total_rows + row_weight.sum()
    return torch.sum((tokens_per_expert_sum / total_rows) * (router_prob_sum / total_rows)) * num_experts


def _causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                    **kwargs):
    """HF's ForCausalLMLoss without the float32 upcast (the model is float64 already)."""
    assert num_items_in_batch is None and shift_labels is None
    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous().view(-1)
    return F.cross_entropy(logits.view(-1, vocab_size), shift_labels, ignore_index=ignore_index)


@contextlib.contextmanager
def float64_numerics():
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for mod in MODULES:
        prefix = PREFIX[mod]
        patch(getattr(mod, prefix + "RMSNorm"), "forward", _rmsnorm_forward)
        patch(getattr(mod, prefix + "RotaryEmbedding"), "forward", _rotary_forward)
        patch(mod, "eager_attention_forward", _make_eager_attention(mod))
    for mod in (modeling_mixtral, modeling_qwen3_moe, modeling_qwen2_moe, modeling_olmoe):
        patch(getattr(mod, PREFIX[mod] + "TopKRouter"), "forward", _router_forward)
        patch(mod, "load_balancing_loss_func", _load_balancing_loss)
    for mod, prefix in SIGMOID_MODULES.items():
        patch(getattr(mod, prefix + "RMSNorm"), "forward", _rmsnorm_forward)
        patch(getattr(mod, prefix + "RotaryEmbedding"), "forward", _rotary_forward_general)
        patch(mod, "eager_attention_forward", _make_eager_attention(mod))
        patch(getattr(mod, prefix + "TopkRouter"), "forward", _sigmoid_router_forward)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


# ---------------------------------------------------------------------------------------------
# models, inputs, names
# ---------------------------------------------------------------------------------------------

def build_config(c):
    common = dict(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
                  num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                  rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=c.get("tie", False),
                  max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]})
    if c["arch"] == "mixtral":
        cfg = MixtralConfig(**common, num_local_experts=c["experts"], num_experts_per_tok=c["top_k"],
                            router_aux_loss_coef=ROUTER_AUX_LOSS_COEF, router_jitter_noise=0.0,
                            sliding_window=c["sliding_window"])
        cls = MixtralForCausalLM
    elif c["arch"] == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, head_dim=c["head_dim"], num_experts=c["experts"],
                             num_experts_per_tok=c["top_k"], moe_intermediate_size=c["moe_inter"],
                             norm_topk_prob=c["norm_topk_prob"], mlp_only_layers=c["mlp_only_layers"],
                             decoder_sparse_step=c["sparse_step"], router_aux_loss_coef=ROUTER_AUX_LOSS_COEF,
                             attention_bias=False, use_sliding_window=False)
        cls = Qwen3MoeForCausalLM
    elif c["arch"] == "qwen2_moe":
        cfg = Qwen2MoeConfig(**common, num_experts=c["experts"], num_experts_per_tok=c["top_k"],
                             moe_intermediate_size=c["moe_inter"], shared_expert_intermediate_size=c["shared_inter"],
                             norm_topk_prob=c["norm_topk_prob"], mlp_only_layers=c["mlp_only_layers"],
                             decoder_sparse_step=c["sparse_step"], router_aux_loss_coef=ROUTER_AUX_LOSS_COEF,
                             qkv_bias=True, use_sliding_window=False)
        cls = Qwen2MoeForCausalLM
    elif c["arch"] == "olmoe":
        cfg = OlmoeConfig(**common, num_experts=c["experts"], num_experts_per_tok=c["top_k"],
                          norm_topk_prob=c["norm_topk_prob"], clip_qkv=c["clip_qkv"],
                          router_aux_loss_coef=ROUTER_AUX_LOSS_COEF, attention_bias=False)
        cls = OlmoeForCausalLM
    elif c["arch"] in SIGMOID_MOE_ARCHS:
        moe = dict(moe_intermediate_size=c["moe_inter"], n_routed_experts=c["experts"], num_experts_per_tok=c["top_k"],
                   n_shared_experts=c["n_shared"], n_group=c["n_group"], topk_group=c["topk_group"],
                   routed_scaling_factor=c["routed_scaling_factor"], norm_topk_prob=c["norm_topk_prob"],
                   first_k_dense_replace=c["first_k_dense"])
        if c["arch"] == "glm4_moe":
            common["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_theta"],
                                         "partial_rotary_factor": c["partial_rotary_factor"]}
            cfg = Glm4MoeConfig(**common, **moe, head_dim=c["head_dim"], use_qk_norm=c["use_qk_norm"],
                                attention_bias=c["attention_bias"])
            cls = Glm4MoeForCausalLM
        else:
            if c["yarn"]:
                common["rope_parameters"] = {"rope_type": "yarn", "rope_theta": c["rope_theta"], **c["yarn"]}
            cfg = DeepseekV3Config(**common, **moe, q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                                   qk_nope_head_dim=c["qk_nope"], qk_rope_head_dim=c["qk_rope"], v_head_dim=c["v_head"],
                                   rope_interleave=c["rope_interleave"], attention_bias=False)
            cls = DeepseekV3ForCausalLM
    elif c["arch"] == "qwen3":
        cfg = Qwen3Config(**common, head_dim=c["head_dim"], attention_bias=False, use_sliding_window=False)
        cls = Qwen3ForCausalLM
    elif c["arch"] == "mistral":
        cfg = MistralConfig(**common, sliding_window=c["sliding_window"])
        cls = MistralForCausalLM
    else:
        cfg = LlamaConfig(**common, attention_bias=False, mlp_bias=False)
        cls = LlamaForCausalLM
    cfg._attn_implementation = "eager"
    if c["arch"] in MOE_ARCHS + SIGMOID_MOE_ARCHS:
        cfg._experts_implementation = "eager"  # the plain per-expert loop (grouped_mm has no float64)
    return cfg, cls


def build_model(c):
    cfg, cls = build_config(c)
    torch.manual_seed(c["seed"])
    model = cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + NORM_JITTER * torch.randn(p.shape))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_SCALE)
            elif name.endswith("mlp.gate.weight"):
                p.mul_(GATE_SCALE)
            elif name.endswith("_proj.bias"):
                p.copy_(BIAS_SCALE * torch.randn(p.shape))
            if c.get("clip_qkv") and name.endswith("v_proj.weight"):
                p.mul_(V_SCALE_CLIP)
            if c["arch"] == "deepseek_v3" and name.endswith("q_b_proj.weight"):  # MLA's q (with a q LoRA)
                p.mul_(QK_SCALE)
            if c["arch"] == "deepseek_v3" and name.endswith(("kv_b_proj.weight", "kv_a_proj_with_mqa.weight")):
                p.mul_(MLA_KV_SCALE)
        if c["arch"] in SIGMOID_MOE_ARCHS:  # a persistent float32 buffer, saved with the weights
            for name, b in model.named_buffers():
                if name.endswith("mlp.gate.e_score_correction_bias"):
                    b.copy_(E_BIAS_SCALE * torch.randn(b.shape))
    return model


def build_inputs(c):
    g = torch.Generator().manual_seed(1000 + c["seed"])
    T, V = c["T"], c["vocab"]
    input_ids = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
    labels = input_ids.clone()
    labels[0, 1:3] = -100  # a masked "prompt"
    labels[1, T // 2] = -100
    inputs = {"input_ids": input_ids, "labels": labels}
    if c["pad_row1"]:
        mask = torch.ones(B, T, dtype=torch.int64)
        mask[1, T - c["pad_row1"]:] = 0
        input_ids[1, T - c["pad_row1"]:] = 0
        labels[1, T - c["pad_row1"]:] = -100
        inputs["attention_mask"] = mask
    return inputs


def hub_named(model, tensors_by_param):
    """{internal param name: tensor} -> {Hub name: tensor}; unpacks 5.x packed experts (Mixtral:
    block_sparse_moe.experts.e.w1/w3/w2; Qwen2/3-MoE, OLMoE, GLM-4-MoE, DeepSeek-V3:
    mlp.experts.e.gate_proj/up_proj/down_proj)."""
    out = {}
    mixtral = isinstance(model, MixtralForCausalLM)
    block = ".block_sparse_moe.experts." if mixtral else ".mlp.experts."
    w1, w3, w2 = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for name, t in tensors_by_param.items():
        if ".mlp.experts.gate_up_proj" in name:  # [E, 2I, C]: gate rows (w1) first, then up rows (w3)
            pre = name.replace(".mlp.experts.gate_up_proj", block)
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{pre}{e}.{w1}.weight"] = t[e, :inter]
                out[f"{pre}{e}.{w3}.weight"] = t[e, inter:]
        elif ".mlp.experts.down_proj" in name:  # [E, C, I]
            pre = name.replace(".mlp.experts.down_proj", block)
            for e in range(t.shape[0]):
                out[f"{pre}{e}.{w2}.weight"] = t[e]
        elif ".mlp.gate.weight" in name and isinstance(model, MixtralForCausalLM):
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
        else:
            out[name] = t
    return out


def saved_buffers(model):
    """The persistent buffers save_pretrained writes next to the parameters: the sigmoid routers'
    mlp.gate.e_score_correction_bias (no other model here has one)."""
    return {n: b for n, b in model.named_buffers() if n.endswith("mlp.gate.e_score_correction_bias")}


def expected_hub_shapes(c):
    """{Hub name: shape} of a GLM-4-MoE / DeepSeek-V3 case, written out from the configuration."""
    C, V, H, E = c["hidden"], c["vocab"], c["heads"], c["experts"]
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,), "lm_head.weight": (V, C)}
    for l in range(c["layers"]):
        p = f"model.layers.{l}."
        a = p + "self_attn."
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (C,)
        if c["arch"] == "glm4_moe":
            hd, kv = c["head_dim"], c["kv_heads"]
            shapes.update({a + "q_proj.weight": (H * hd, C), a + "k_proj.weight": (kv * hd, C),
                           a + "v_proj.weight": (kv * hd, C), a + "o_proj.weight": (C, H * hd)})
            if c["attention_bias"]:  # q/k/v only: GLM's o_proj has no bias
                shapes.update({a + "q_proj.bias": (H * hd,), a + "k_proj.bias": (kv * hd,), a + "v_proj.bias": (kv * hd,)})
            if c["use_qk_norm"]:
                shapes.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
        else:
            qk = c["qk_nope"] + c["qk_rope"]
            if c["q_lora_rank"]:
                r = c["q_lora_rank"]
                shapes.update({a + "q_a_proj.weight": (r, C), a + "q_a_layernorm.weight": (r,),
                               a + "q_b_proj.weight": (H * qk, r)})
            else:
                shapes[a + "q_proj.weight"] = (H * qk, C)
            r = c["kv_lora_rank"]
            shapes.update({a + "kv_a_proj_with_mqa.weight": (r + c["qk_rope"], C), a + "kv_a_layernorm.weight": (r,),
                           a + "kv_b_proj.weight": (H * (c["qk_nope"] + c["v_head"]), r),
                           a + "o_proj.weight": (C, H * c["v_head"])})
        m = p + "mlp."
        if l < c["first_k_dense"]:
            I = c["inter"]
            shapes.update({m + "gate_proj.weight": (I, C), m + "up_proj.weight": (I, C), m + "down_proj.weight": (C, I)})
        else:
            I, S = c["moe_inter"], c["moe_inter"] * c["n_shared"]
            shapes.update({m + "gate.weight": (E, C), m + "gate.e_score_correction_bias": (E,),
                           m + "shared_experts.gate_proj.weight": (S, C), m + "shared_experts.up_proj.weight": (S, C),
                           m + "shared_experts.down_proj.weight": (C, S)})
            for e in range(E):
                shapes.update({f"{m}experts.{e}.gate_proj.weight": (I, C), f"{m}experts.{e}.up_proj.weight": (I, C),
                               f"{m}experts.{e}.down_proj.weight": (C, I)})
    return shapes


def check_hub_file(model_dir, model, c):
    """The saved file holds exactly the Hub names and the in-memory values."""
    want = {k: v.detach().numpy() for k, v in hub_named(model, dict(model.named_parameters())).items()}
    want.update({k: v.detach().numpy() for k, v in saved_buffers(model).items()})
    with safe_open(os.path.join(model_dir, "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert keys == set(want), f"saved names differ: {sorted(keys ^ set(want))}"
        for k in keys:
            t = f.get_tensor(k)
            assert t.dtype == np.float32 and t.shape == want[k].shape and np.array_equal(t, want[k]), k
    if c["arch"] in SIGMOID_MOE_ARCHS:
        shapes = expected_hub_shapes(c)
        got = {k: tuple(want[k].shape) for k in keys}
        assert got == shapes, f"saved names/shapes differ: {sorted(set(got.items()) ^ set(shapes.items()))}"
        return
    if c.get("tie"):  # transformers saves a tied head as the embedding alone
        assert "lm_head.weight" not in keys and model.lm_head.weight is model.model.embed_tokens.weight
    for needle in ["model.embed_tokens.weight", "model.norm.weight"] + ([] if c.get("tie") else ["lm_head.weight"]) + [
                   "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                   "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                   "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight"]:
        assert needle in keys, needle
    if c["arch"] == "mixtral":
        assert "model.layers.1.block_sparse_moe.gate.weight" in keys
        assert f"model.layers.1.block_sparse_moe.experts.{c['experts'] - 1}.w2.weight" in keys
    elif c["arch"] == "olmoe":
        for l in range(c["layers"]):
            assert f"model.layers.{l}.mlp.gate.weight" in keys
            assert f"model.layers.{l}.mlp.experts.{c['experts'] - 1}.down_proj.weight" in keys
            assert model.model.layers[l].self_attn.q_norm.weight.shape[0] == c["hidden"]
    elif c["arch"] in ("qwen3_moe", "qwen2_moe"):
        sparse = [l for l in range(c["layers"]) if l not in c["mlp_only_layers"] and (l + 1) % c["sparse_step"] == 0]
        for l in range(c["layers"]):
            if c["arch"] == "qwen3_moe":
                assert f"model.layers.{l}.self_attn.q_norm.weight" in keys and f"model.layers.{l}.self_attn.k_norm.weight" in keys
            else:
                assert all(f"model.layers.{l}.self_attn.{p}_proj.bias" in keys for p in "qkv")
                assert (f"model.layers.{l}.mlp.shared_expert_gate.weight" in keys) == (l in sparse)
                assert (f"model.layers.{l}.mlp.shared_expert.down_proj.weight" in keys) == (l in sparse)
            if l in sparse:
                assert f"model.layers.{l}.mlp.gate.weight" in keys
                assert f"model.layers.{l}.mlp.experts.{c['experts'] - 1}.down_proj.weight" in keys
            else:
                assert f"model.layers.{l}.mlp.gate_proj.weight" in keys and f"model.layers.{l}.mlp.gate.weight" not in keys
        assert len(sparse) >= 2 and len(sparse) < c["layers"], sparse
    else:
        assert "model.layers.1.mlp.gate_proj.weight" in keys and "model.layers.1.mlp.down_proj.weight" in keys


# ---------------------------------------------------------------------------------------------
# reference computations
# ---------------------------------------------------------------------------------------------

def forward_backward(model, inputs):
    model.zero_grad(set_to_none=True)
    kw = dict(inputs)
    if isinstance(model, MOE_CLASSES):
        kw["output_router_logits"] = True
    hooks = []
    if isinstance(model, SIGMOID_MOE_CLASSES):  # each router's logits and HF's choice, for check_routing
        model.golden_routes = []
        for layer, block in enumerate(model.model.layers):
            if isinstance(getattr(block.mlp, "gate", None), SIGMOID_ROUTERS):
                hooks.append(block.mlp.gate.register_forward_hook(
                    lambda m, i, o, layer=layer: model.golden_routes.append((layer, m, o[0].detach(), o[2].detach()))))
    out = model(**kw)
    for h in hooks:
        h.remove()
    out.loss.backward()
    return out


def split_losses(model, out, inputs):
    ce = model.loss_function(out.logits, inputs["labels"], model.config.vocab_size)
    if isinstance(model, MOE_CLASSES):
        aux = out.aux_loss
        coef = model.config.router_aux_loss_coef
    else:
        aux = torch.zeros((), dtype=out.logits.dtype)
        coef = 0.0
    return ce.detach(), aux.detach(), coef


def clip_fractions(model, inputs, clip):
    """Fractions of the q, k (after their norms) and v values beyond clip_qkv in a forward pass."""
    seen = {"q": [], "k": [], "v": []}
    hooks = []
    for layer in model.model.layers:
        a = layer.self_attn
        for key, mod in (("q", a.q_norm), ("k", a.k_norm), ("v", a.v_proj)):
            hooks.append(mod.register_forward_hook(lambda m, i, o, key=key: seen[key].append(o.detach().abs() > clip)))
    with torch.no_grad():
        model(**{k: v for k, v in inputs.items() if k != "labels"})
    for h in hooks:
        h.remove()
    return {k: torch.cat([x.reshape(-1) for x in v]).double().mean().item() for k, v in seen.items()}


def check_sigmoid_routing(model, c, where):
    """Every MoE layer and token (padding too): HF's choice equals route_sigmoid's on the biased scores;
    the group and the K-th choice margins exceed MIN_ROUTING_GAP; every expert is chosen (in AdamW steps
    at least c["adamw_min_experts"] where set). Returns the group gaps, the choice gaps, the number of
    (layer, token) choices the correction bias changes and the fewest experts a layer used."""
    moe_layers = [l for l in range(c["layers"]) if l >= c["first_k_dense"]]
    assert [r[0] for r in model.golden_routes] == moe_layers, [r[0] for r in model.golden_routes]
    group_gaps, choice_gaps, changed, min_used = [], [], 0, []
    for layer, gate, logits, hf_choice in model.golden_routes:
        scores = torch.sigmoid(logits.double())
        biased = scores + gate.e_score_correction_bias.detach().double()
        choice, group_gap, choice_gap = route_sigmoid(biased, c["n_group"], c["topk_group"], c["top_k"])
        plain, _, _ = route_sigmoid(scores, c["n_group"], c["topk_group"], c["top_k"])
        assert torch.equal(choice, torch.sort(hf_choice, dim=-1).values), f"{where}: layer {layer} choice differs"
        if group_gap is not None:
            g = group_gap.min().item()
            assert g > MIN_ROUTING_GAP, f"{where}: layer {layer} group gap {g:.3g}; change the seed"
            group_gaps.append(g)
        g = choice_gap.min().item()
        assert g > MIN_ROUTING_GAP, f"{where}: layer {layer} routing gap {g:.3g}; change the seed"
        choice_gaps.append(g)
        used = torch.unique(choice).numel()
        need = c["experts"] if where == "reference" else c.get("adamw_min_experts", c["experts"])
        assert used >= need, f"{where}: layer {layer} uses only {used} of {c['experts']} experts; change the seed"
        min_used.append(used)
        changed += (choice != plain).any(dim=-1).sum().item()
    return group_gaps, choice_gaps, changed, min(min_used)


def check_routing(model, out, c, where):
    if isinstance(model, SIGMOID_MOE_CLASSES):
        group_gaps, choice_gaps, _, used = check_sigmoid_routing(model, c, where)
        return [("group", g) for g in group_gaps] + [("choice", g) for g in choice_gaps] + [("used", used)]
    if not isinstance(model, MOE_CLASSES):
        return []
    k, e = c["top_k"], c["experts"]
    gaps = []
    for layer, logits in enumerate(out.router_logits):
        p = torch.sort(F.softmax(logits.detach().double(), dim=-1), dim=-1, descending=True).values
        gap = (p[:, k - 1] - p[:, k]).min().item()
        used = torch.unique(torch.topk(logits.detach(), k, dim=-1).indices).numel()
        assert gap > MIN_ROUTING_GAP, f"{where}: layer {layer} routing gap {gap:.3g}; change the seed"
        assert used == e, f"{where}: layer {layer} uses only {used} of {e} experts; change the seed"
        gaps.append(gap)
    return gaps


def own_loss_formula(out, inputs, c):
    """Independent float64 formula: mean CE over shifted, non-ignored labels + coef * aux,
    aux = E * sum_e f_e P_e pooled over layers and non-padding tokens. Dense and sigmoid-router
    (GLM-4-MoE, DeepSeek-V3: HF's loss is cross-entropy only) models: aux = 0."""
    logits = out.logits.detach().double()
    labels = inputs["labels"][:, 1:]
    lg = logits[:, :-1]
    valid = labels != -100
    lse = torch.logsumexp(lg, dim=-1)
    picked = torch.gather(lg, -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ce = ((lse - picked) * valid).sum() / valid.sum()
    if c["arch"] not in MOE_ARCHS:
        return ce, torch.zeros((), dtype=torch.float64)
    mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).reshape(-1).double()
    e, k = c["experts"], c["top_k"]
    counts = torch.zeros(e, dtype=torch.float64)
    probs = torch.zeros(e, dtype=torch.float64)
    rows = 0.0
    for layer_logits in out.router_logits:
        p = F.softmax(layer_logits.detach().double(), dim=-1)
        sel = torch.topk(p, k, dim=-1).indices
        counts += (F.one_hot(sel, e).sum(1).double() * mask[:, None]).sum(0)
        probs += (p * mask[:, None]).sum(0)
        rows += mask.sum().item()
    aux = e * torch.sum((counts / rows) * (probs / rows))
    return ce, aux


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def adamw_trajectory(model, inputs, c):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("norm.weight") else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": ADAMW["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]), eps=ADAMW["eps"],
                            foreach=False)
    losses, norms, gaps = [], [], []
    for step in range(ADAMW["steps"]):
        out = forward_backward(model, inputs)
        gaps += check_routing(model, out, c, f"adamw step {step}")
        losses.append(out.loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(list(model.parameters()), ADAMW["grad_clip"]).item())
        opt.step()
    return losses, norms, gaps


def f32(t):
    return np.array(t.detach().to(torch.float32).numpy(), dtype=np.float32, order="C")  # keeps shape [] scalars


_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}


def save_safetensors(path, tensors, metadata=None):
    """safetensors writer with a byte-deterministic header (sorted keys; the Rust writer behind
    safetensors.numpy.save_file orders __metadata__ randomly)."""
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name]) if tensors[name].ndim else tensors[name]
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(data)
    with safe_open(path, "np") as f:  # read back with the reference reader
        assert set(f.keys()) == set(tensors) and (f.metadata() or {}) == (metadata or {})
        for name in tensors:
            assert np.array_equal(f.get_tensor(name), tensors[name]) and f.get_tensor(name).shape == tensors[name].shape


def make_case(name, c, out_root):
    case_dir = os.path.join(out_root, name)
    if os.path.isdir(case_dir):
        shutil.rmtree(case_dir)
    os.makedirs(case_dir)

    model32 = build_model(c)
    model32.save_pretrained(case_dir, safe_serialization=True)
    check_hub_file(case_dir, model32, c)
    kw = {"experts_implementation": "eager"} if c["arch"] in MOE_ARCHS + SIGMOID_MOE_ARCHS else {}
    loaded = type(model32).from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager", **kw)
    for (n1, p1), (n2, p2) in zip(model32.named_parameters(), loaded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), f"reload changed {n1}"
    for (n1, b1), (n2, b2) in zip(saved_buffers(model32).items(), saved_buffers(loaded).items()):
        assert n1 == n2 and b2.dtype == torch.float32 and torch.equal(b1, b2), f"reload changed {n1}"
    assert len(saved_buffers(loaded)) == len(saved_buffers(model32))
    yarn = {}
    if c["arch"] in SIGMOID_MOE_ARCHS:  # the float64 RoPE re-implementation against transformers' own
        inv64, att64 = rope_parameters_f64(loaded.config)
        rot = loaded.model.rotary_emb
        assert rel_err(rot.inv_freq, inv64) < 2e-7 and abs(rot.attention_scaling - att64) < 1e-15
        attn = loaded.model.layers[0].self_attn
        if c["arch"] == "deepseek_v3":
            qk_head_dim = c["qk_nope"] + c["qk_rope"]
            softmax_mscale = yarn_mscale(c["yarn"]["factor"], c["yarn"]["mscale_all_dim"]) ** 2 if c["yarn"] else 1.0
            assert abs(attn.scaling - qk_head_dim ** -0.5 * softmax_mscale) < 1e-15, attn.scaling
        else:
            softmax_mscale = 1.0
            assert attn.scaling == c["head_dim"] ** -0.5
        if c.get("yarn"):
            inv_hf, att_hf = _compute_yarn_parameters(copy.deepcopy(loaded.config))
            yarn = dict(attention_factor=att64, softmax_mscale=softmax_mscale,
                        inv_freq_rel=rel_err(inv_hf, inv64), attention_factor_abs=abs(att_hf - att64),
                        inv_freq=inv64.tolist())
            assert yarn["inv_freq_rel"] < 2e-7 and yarn["attention_factor_abs"] < 1e-15, yarn
            assert att64 != 1.0 and softmax_mscale != 1.0
    inputs = build_inputs(c)
    save_safetensors(os.path.join(case_dir, "input.safetensors"), {k: v.numpy() for k, v in inputs.items()})
    clipped = {}
    if c.get("clip_qkv"):  # the clamp must act on part of q, k and v, not on none or all of them
        clipped = clip_fractions(loaded, inputs, c["clip_qkv"])
        assert all(0.01 < f < 0.9 for f in clipped.values()), clipped

    # Unpatched HF (float32 and float64) for the cross-checks.
    ref32 = copy.deepcopy(loaded).train()
    out32 = forward_backward(ref32, inputs)
    raw64 = copy.deepcopy(loaded).double().train()
    out_raw64 = forward_backward(raw64, inputs)

    with float64_numerics():
        model = copy.deepcopy(loaded).double().train()
        model.loss_function = _causal_lm_loss
        out = forward_backward(model, inputs)
        ce, aux, coef = split_losses(model, out, inputs)
        loss = out.loss.detach()
        assert abs(loss.item() - (ce + coef * aux).item()) < 1e-14
        gaps = check_routing(model, out, c, "reference")
        changed = check_sigmoid_routing(model, c, "reference")[2] if c["arch"] in SIGMOID_MOE_ARCHS else 0
        assert changed > 0 or c["arch"] not in SIGMOID_MOE_ARCHS, "e_score_correction_bias changes no choice"
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert all(g is not None for g in grads.values())
        own_ce, own_aux = own_loss_formula(out, inputs, c)
        opt_model = copy.deepcopy(loaded).double().train()
        opt_model.loss_function = _causal_lm_loss
        losses, norms, step_gaps = adamw_trajectory(opt_model, inputs, c)
    assert losses[0] == loss.item(), (losses[0], loss.item())

    checks = {
        "own_formula_ce_abs": abs(own_ce.item() - ce.item()),
        "own_formula_aux_abs": abs(own_aux.item() - aux.item()),
        "own_formula_loss_abs": abs((own_ce + coef * own_aux).item() - loss.item()),
        "hf_raw64_loss_abs": abs(out_raw64.loss.item() - loss.item()),
        "hf_raw64_logits_rel": rel_err(out_raw64.logits, out.logits),
        "hf_raw64_grad_rel": max(rel_err(p.grad, grads[n]) for n, p in raw64.named_parameters()),
        "hf_fp32_loss_abs": abs(out32.loss.item() - loss.item()),
        "hf_fp32_logits_rel": rel_err(out32.logits, out.logits),
        "hf_fp32_grad_rel": max(rel_err(p.grad, grads[n]) for n, p in ref32.named_parameters()),
    }
    assert checks["own_formula_loss_abs"] < 1e-12, checks
    assert checks["hf_raw64_logits_rel"] > 0, "float64_numerics changed nothing: the patches did not apply"
    assert checks["hf_raw64_loss_abs"] < 1e-5 and checks["hf_raw64_grad_rel"] < 1e-4, checks
    assert checks["hf_fp32_loss_abs"] < 1e-4 and checks["hf_fp32_grad_rel"] < 1e-3, checks

    expected = {"logits": f32(out.logits), "ce_loss": f32(ce), "aux_loss": f32(aux), "loss": f32(loss),
                "adamw_loss": np.array(losses, dtype=np.float32),
                "adamw_grad_norm": np.array(norms, dtype=np.float32)}
    for hub_name, g in hub_named(model, grads).items():
        expected["grad." + hub_name] = f32(g)
    with safe_open(os.path.join(case_dir, "model.safetensors"), "np") as f:
        # the saved buffers (e_score_correction_bias) have no gradient
        missing = (set(f.keys()) - set(saved_buffers(model))) ^ {k[5:] for k in expected if k.startswith("grad.")}
        assert not missing, f"grad names differ from the saved names: {sorted(missing)}"
    meta = {k: repr(v) if isinstance(v, float) else str(v) for k, v in ADAMW.items()}
    if c["arch"] in SIGMOID_MOE_ARCHS:  # every norm weight present, by name pattern
        patterns = []
        for n, _ in model.named_parameters():
            if n.endswith("norm.weight") and n.startswith("model.layers."):
                pat = "*" + n.split(".", 3)[3]
                if pat not in patterns:
                    patterns.append(pat)
        patterns.sort(key=lambda pat: not pat.startswith(("*input_layernorm", "*post_attention_layernorm")))
        no_decay = "RMSNorm weights (" + ", ".join(patterns + ["model.norm.weight"]) + ")"
    else:
        no_decay = ("RMSNorm weights (*input_layernorm.weight, *post_attention_layernorm.weight, "
                    + ("*self_attn.q_norm.weight, *self_attn.k_norm.weight, " if c["arch"].startswith("qwen3") else "")
                    + "model.norm.weight)")
    meta.update(router_aux_loss_coef=repr(float(coef)), torch_version=torch.__version__,
                transformers_version=transformers.__version__, reference_dtype="float64",
                no_weight_decay=no_decay, lr_schedule="constant", seed=str(c["seed"]))
    save_safetensors(os.path.join(case_dir, "expected.safetensors"), expected, meta)

    size = sum(os.path.getsize(os.path.join(case_dir, f)) for f in os.listdir(case_dir))
    assert size < 2_000_000, f"{name}: {size} bytes"
    if c["arch"] in SIGMOID_MOE_ARCHS:
        group_gaps = [g for kind, g in gaps + step_gaps if kind == "group"]
        choice_gaps = [g for kind, g in gaps + step_gaps if kind == "choice"]
        gap_text = (f"min_group_gap {min(group_gaps) if group_gaps else float('nan'):.4f} "
                    f"min_choice_gap {min(choice_gaps):.4f} bias_changed_choices {changed} "
                    f"experts_used_min {min(u for kind, u in gaps + step_gaps if kind == 'used')}/{c['experts']}")
    else:
        gap_text = f"min_gap {min(gaps + step_gaps) if gaps else float('nan'):.4f}"
    print(f"{name}: loss {loss.item():.9f} ce {ce.item():.9f} aux {aux.item():.9f} "
          f"adamw {['%.6f' % x for x in losses]} grad_norm {['%.4f' % x for x in norms]} "
          f"{gap_text} size {size}")
    print("   checks " + " ".join(f"{k}={v:.2e}" for k, v in checks.items()))
    if yarn:
        print(f"   yarn attention_factor {yarn['attention_factor']!r} softmax_mscale {yarn['softmax_mscale']!r} "
              f"inv_freq {yarn['inv_freq']} (vs transformers: inv_freq rel {yarn['inv_freq_rel']:.1e}, "
              f"attention_factor abs {yarn['attention_factor_abs']:.1e})")
    if clipped:
        print("   clip_qkv clips " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in clipped.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/golden", help="output directory (one subdirectory per case)")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (repeatable)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name in args.case or CASES:
        make_case(name, CASES[name], args.out)


if __name__ == "__main__":
    sys.exit(main())
