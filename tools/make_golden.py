#!/usr/bin/env python3
"""Write the Hugging Face reference cases under tests/golden/ (see tests/golden/README.md).

For each case: build a tiny random HF model in float32 (fixed torch seed), save it with
save_pretrained, load it back, cast a copy to float64 and compute, with eager attention,
the logits, the losses (HF's outputs.loss with output_router_logits=True), d loss / d param
for every parameter under its Hub name, and the loss over 5 AdamW steps on the same batch.

HF's modeling code casts to float32 in a few places even in a float64 model (RMSNorm,
router softmax, attention softmax, RoPE angles, the load-balancing loss, the causal-LM loss).
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
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)
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
}
MOE_ARCHS = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe")
MOE_CLASSES = (MixtralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, OlmoeForCausalLM)
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
    if c["arch"] in MOE_ARCHS:
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
    block_sparse_moe.experts.e.w1/w3/w2; Qwen3-MoE: mlp.experts.e.gate_proj/up_proj/down_proj)."""
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


def check_hub_file(model_dir, model, c):
    """The saved file holds exactly the Hub names and the in-memory values."""
    want = {k: v.detach().numpy() for k, v in hub_named(model, dict(model.named_parameters())).items()}
    with safe_open(os.path.join(model_dir, "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert keys == set(want), f"saved names differ: {sorted(keys ^ set(want))}"
        for k in keys:
            t = f.get_tensor(k)
            assert t.dtype == np.float32 and t.shape == want[k].shape and np.array_equal(t, want[k]), k
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
    out = model(**kw)
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


def check_routing(model, out, c, where):
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
    aux = E * sum_e f_e P_e pooled over layers and non-padding tokens."""
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
    kw = {"experts_implementation": "eager"} if c["arch"] in MOE_ARCHS else {}
    loaded = type(model32).from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager", **kw)
    for (n1, p1), (n2, p2) in zip(model32.named_parameters(), loaded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), f"reload changed {n1}"
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
        missing = set(f.keys()) ^ {k[5:] for k in expected if k.startswith("grad.")}
        assert not missing, f"grad names differ from the saved names: {sorted(missing)}"
    meta = {k: repr(v) if isinstance(v, float) else str(v) for k, v in ADAMW.items()}
    meta.update(router_aux_loss_coef=repr(float(coef)), torch_version=torch.__version__,
                transformers_version=transformers.__version__, reference_dtype="float64",
                no_weight_decay="RMSNorm weights (*input_layernorm.weight, *post_attention_layernorm.weight, "
                                + ("*self_attn.q_norm.weight, *self_attn.k_norm.weight, " if c["arch"].startswith("qwen3") else "")
                                + "model.norm.weight)",
                lr_schedule="constant", seed=str(c["seed"]))
    save_safetensors(os.path.join(case_dir, "expected.safetensors"), expected, meta)

    size = sum(os.path.getsize(os.path.join(case_dir, f)) for f in os.listdir(case_dir))
    assert size < 2_000_000, f"{name}: {size} bytes"
    print(f"{name}: loss {loss.item():.9f} ce {ce.item():.9f} aux {aux.item():.9f} "
          f"adamw {['%.6f' % x for x in losses]} grad_norm {['%.4f' % x for x in norms]} "
          f"min_gap {min(gaps + step_gaps) if gaps else float('nan'):.4f} size {size}")
    print("   checks " + " ".join(f"{k}={v:.2e}" for k, v in checks.items()))
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
