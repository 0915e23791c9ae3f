#!/usr/bin/env python3
"""Write the generation references under tests/golden/generate/ (see its README.md).

Tiny random models of nine families (a Mixtral with GQA and a sliding window shorter than prompt
+ reply, a dense Llama with multi-head attention, Qwen3-MoE, OLMoE, Qwen2-MoE, a Mistral with a sliding
window, a dense Qwen3 with tied embeddings, GLM-4.5 (Glm4Moe) and DeepSeek-V3 with multi-head latent
attention and YaRN), saved with save_pretrained in bfloat16 (half the bytes; moetron and transformers
both compute in float32 on the saved values, loaded with dtype=float32) -- except the sigmoid routers'
`mlp.gate.weight` and `mlp.gate.e_score_correction_bias`, which stay float32 in the file as transformers
keeps them (_keep_in_fp32_modules_strict) in a model it holds in bf16,
plus a tiny SentencePiece tokenizer in the Mixtral directory so the server tests have a complete
model directory. For each model, `generate(do_sample=False)` of transformers in float32 gives the
expected tokens. The script checks, so that an fp32 implementation must reproduce them exactly:
  * the same greedy tokens come from a float64 copy recomputing the whole sequence at every step
    without any cache (so the KV cache and the sliding-window cache of transformers agree with the
    definition);
  * at every step the float64 top-1 logit exceeds the runner-up by more than MIN_GAP;
  * (GLM-4.5, DeepSeek-V3) over the whole float64 sequence, every MoE layer and token, the group and
    the top-K expert choices (scores + selection bias) are decided by more than MIN_ROUTING_GAP, and
    without the selection bias the greedy reply differs (so a loader dropping it fails).

Development tool only: the C++ tests read the committed files. Usage:
    python3 tools/make_generate_reference.py --out tests/golden/generate
    python3 tools/make_generate_reference.py --out tests/golden/generate --cases glm4_moe,deepseek_v3
(--cases rewrites only the named case directories and their entries of an existing expected.json; the
other entries are kept as they are.)
"""

import argparse
import json
import os
import shutil
import tempfile

import sentencepiece as spm
import torch
import transformers
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                          OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

NEW_TOKENS = 32
MIN_GAP = 2e-3  # float64 top-1 minus top-2 logit at every greedy step
MIN_ROUTING_GAP = 1e-3  # sigmoid routers: K-th minus (K+1)-th biased score (and group score), float64
TEXT_MAX_TOKENS = 16  # the text exchanges (chat and completion) of the server tests

# The tokenizer's training text: deterministic sentences over a small vocabulary.
SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "our neighbour",
            "the children", "a red fox", "the farmer"]
VERBS = ["sees", "likes", "finds", "follows", "paints", "builds", "remembers", "carries", "watches", "visits"]
OBJECTS = ["the river", "a green house", "the market", "an apple tree", "the blue sky", "a wooden boat",
           "the quiet garden", "a long road", "the bright moon", "a tall tower"]
ENDINGS = ["every morning.", "at night.", "in the spring.", "after the rain.", "with great care.",
           "once upon a time.", "near the sea.", "before dinner."]

CASES = {
    # GQA, 4 experts top-2, sliding window 16 < prompt + 32 new tokens: the window matters while decoding.
    "mixtral_gqa": dict(arch="mixtral", seed=21, vocab=320, hidden=32, inter=32, layers=2, heads=4, kv_heads=2,
                        experts=4, top_k=2, rope_theta=1e6, sliding_window=16, prompt_len=11, tokenizer=True),
    # Dense Llama, MHA, rope_theta 1e4.
    "llama_dense": dict(arch="llama", seed=6, vocab=128, hidden=32, inter=48, layers=2, heads=4, kv_heads=4,
                        rope_theta=1e4, sliding_window=None, prompt_len=9, tokenizer=False),
    # Qwen3-MoE: q/k norms, head_dim 12 != 32 / 4, layer 1 dense between two sparse layers, top-K
    # weights not renormalised; with the tiny byte-level tokenizer.json of tests/data (ids 0-801:
    # <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2 = EOS) and a ChatML chat template, so the directory
    # is a complete Qwen-style model for `moetron serve`.
    "qwen3_moe": dict(arch="qwen3_moe", seed=33, vocab=832, hidden=32, inter=40, moe_inter=24, layers=3, heads=4,
                      kv_heads=2, head_dim=12, experts=4, top_k=2, mlp_only_layers=[1], rope_theta=1e6,
                      sliding_window=None, prompt_len=10, tokenizer=False, tokenizer_json=True),
    # OLMoE: q/k norms over the whole projections, clip_qkv 2.0 (clipping part of q and k), norm_topk_prob false.
    "olmoe": dict(arch="olmoe", seed=35, vocab=144, hidden=32, inter=24, layers=2, heads=4, kv_heads=4, experts=4,
                  top_k=2, clip_qkv=2.0, rope_theta=1e4, sliding_window=None, prompt_len=9, tokenizer=False),
    # Qwen2-MoE: q/k/v biases (drawn, not HF's zeros), a sigmoid-gated shared expert of its own width in
    # the sparse layers, layer 2 dense (mlp_only_layers), norm_topk_prob false.
    "qwen2_moe": dict(arch="qwen2_moe", seed=39, vocab=160, hidden=32, inter=40, moe_inter=16, shared_inter=24,
                      layers=3, heads=4, kv_heads=2, experts=4, top_k=2, mlp_only_layers=[2], rope_theta=1e6,
                      sliding_window=None, prompt_len=9, tokenizer=False),
    # Dense Mistral, GQA, sliding window 12 < prompt + 32 new tokens.
    "mistral_dense": dict(arch="mistral", seed=38, vocab=128, hidden=32, inter=48, layers=2, heads=4, kv_heads=2,
                          rope_theta=1e6, sliding_window=12, prompt_len=9, tokenizer=False),
    # Dense Qwen3: q/k norms, head_dim 16 != 32 / 4.  Untied: a random model with a tied head repeats
    # its last token (its own embedding's logit dominates); tying is the training golden's.
    "qwen3_dense": dict(arch="qwen3", seed=37, vocab=120, hidden=32, inter=56, layers=2, heads=4, kv_heads=2,
                        head_dim=16, rope_theta=1e6, sliding_window=None, prompt_len=9, tokenizer=False),
    # GLM-4.5 (Glm4Moe): partial RoPE (the first 8 of 16 head dims, rotate-half), per-head q/k norms, q/k/v
    # biases (drawn), layer 0 dense (first_k_dense_replace 1), a sigmoid router over 2 groups of 4 experts
    # (top-1 group) with a drawn selection bias (e_score_correction_bias, float32 in the file), top-2
    # renormalised x 2.5, one ungated shared expert.
    "glm4_moe": dict(arch="glm4_moe", seed=32, vocab=160, hidden=32, inter=48, moe_inter=16, layers=3,
                     heads=4, kv_heads=2, head_dim=16, partial_rotary_factor=0.5, use_qk_norm=True,
                     attention_bias=True, experts=8, top_k=2, n_group=2, topk_group=1, n_shared=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense=1, rope_theta=1e6,
                     sliding_window=None, prompt_len=9, tokenizer=False),
    # DeepSeek-V3: multi-head latent attention with a q LoRA (q_lora_rank 16, kv_lora_rank 12, qk_nope 8,
    # qk_rope 4, v_head 6), interleaved YaRN RoPE (attention factor and softmax mscale != 1), layer 0 dense,
    # a sigmoid router over 4 groups of 2 experts (top-2 groups) with a drawn selection bias, top-3
    # renormalised x 2.5, shared expert width 2 x 16.
    "deepseek_v3": dict(arch="deepseek_v3", seed=36, vocab=160, hidden=32, inter=48, moe_inter=16, layers=3,
                        heads=4, kv_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope=8, qk_rope=4, v_head=6,
                        experts=8, top_k=3, n_group=4, topk_group=2, n_shared=2, routed_scaling_factor=2.5,
                        norm_topk_prob=True, first_k_dense=1, rope_interleave=True, rope_theta=1e4,
                        yarn=dict(factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
                                  mscale=0.8, mscale_all_dim=0.6),
                        max_position_embeddings=256, sliding_window=None, prompt_len=9, tokenizer=False),
}
SIGMOID_MOE_ARCHS = ("glm4_moe", "deepseek_v3")  # DeepSeek-V3 style routers (mlp.gate with a selection bias)
EAGER_EXPERT_ARCHS = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe") + SIGMOID_MOE_ARCHS
TINY_TOKENIZER_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data",
                                   "tiny-bytelevel-tokenizer.json")
# Qwen2.5's ChatML template without its default system prompt (moetron's chatml inserts none).
CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")
QK_SCALE = 4.0  # attention far from uniform, so position / cache / window errors change the logits
GATE_SCALE = 10.0  # decisive routing
E_BIAS_SCALE = 0.1  # mlp.gate.e_score_correction_bias (HF inits it to 0): N(0, 0.1) so it changes some choices
MLA_KV_SCALE = 6.0  # MLA: kv_b_proj and kv_a_proj_with_mqa (k_nope, k_rope) scaled like q (as tools/make_golden.py)
HEAD_SCALE = 40.0  # logits spread over several units: clear greedy choices
NORM_JITTER = 0.1

CHAT_USER = "Hello there, my friend"
COMPLETION_PROMPT = "Once upon a time the cat"


def build(c):
    common = dict(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
                  num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                  rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=False, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]})
    if c["arch"] in SIGMOID_MOE_ARCHS:
        common["max_position_embeddings"] = c.get("max_position_embeddings", 512)
        moe = dict(moe_intermediate_size=c["moe_inter"], n_routed_experts=c["experts"], num_experts_per_tok=c["top_k"],
                   n_shared_experts=c["n_shared"], n_group=c["n_group"], topk_group=c["topk_group"],
                   routed_scaling_factor=c["routed_scaling_factor"], norm_topk_prob=c["norm_topk_prob"],
                   first_k_dense_replace=c["first_k_dense"])
    if c["arch"] == "glm4_moe":
        common["rope_parameters"]["partial_rotary_factor"] = c["partial_rotary_factor"]
        cfg = Glm4MoeConfig(**common, **moe, head_dim=c["head_dim"], use_qk_norm=c["use_qk_norm"],
                            attention_bias=c["attention_bias"])
        cls = Glm4MoeForCausalLM
    elif c["arch"] == "deepseek_v3":
        common["rope_parameters"] = {"rope_type": "yarn", "rope_theta": c["rope_theta"], **c["yarn"]}
        cfg = DeepseekV3Config(**common, **moe, q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                               qk_nope_head_dim=c["qk_nope"], qk_rope_head_dim=c["qk_rope"], v_head_dim=c["v_head"],
                               rope_interleave=c["rope_interleave"], attention_bias=False)
        cls = DeepseekV3ForCausalLM
    elif c["arch"] == "mixtral":
        cfg = MixtralConfig(**common, num_local_experts=c["experts"], num_experts_per_tok=c["top_k"],
                            router_aux_loss_coef=0.02, router_jitter_noise=0.0, sliding_window=c["sliding_window"])
        cls = MixtralForCausalLM
    elif c["arch"] == "olmoe":
        cfg = OlmoeConfig(**common, num_experts=c["experts"], num_experts_per_tok=c["top_k"], norm_topk_prob=False,
                          clip_qkv=c["clip_qkv"], router_aux_loss_coef=0.02, attention_bias=False)
        cls = OlmoeForCausalLM
    elif c["arch"] == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, head_dim=c["head_dim"], num_experts=c["experts"],
                             num_experts_per_tok=c["top_k"], moe_intermediate_size=c["moe_inter"],
                             norm_topk_prob=False, mlp_only_layers=c["mlp_only_layers"], router_aux_loss_coef=0.02,
                             attention_bias=False, use_sliding_window=False)
        cls = Qwen3MoeForCausalLM
    elif c["arch"] == "qwen2_moe":
        cfg = Qwen2MoeConfig(**common, num_experts=c["experts"], num_experts_per_tok=c["top_k"],
                             moe_intermediate_size=c["moe_inter"], shared_expert_intermediate_size=c["shared_inter"],
                             norm_topk_prob=False, mlp_only_layers=c["mlp_only_layers"], decoder_sparse_step=1,
                             router_aux_loss_coef=0.02, qkv_bias=True, use_sliding_window=False)
        cls = Qwen2MoeForCausalLM
    elif c["arch"] == "mistral":
        cfg = MistralConfig(**common, sliding_window=c["sliding_window"])
        cls = MistralForCausalLM
    elif c["arch"] == "qwen3":
        cfg = Qwen3Config(**common, head_dim=c["head_dim"], attention_bias=False, use_sliding_window=False)
        cls = Qwen3ForCausalLM
    else:
        cfg = LlamaConfig(**common, attention_bias=False, mlp_bias=False)
        cls = LlamaForCausalLM
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
            elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.copy_(0.1 * torch.randn(p.shape))
            elif name == "lm_head.weight":
                p.mul_(HEAD_SCALE)
            if c["arch"] == "deepseek_v3" and name.endswith("q_b_proj.weight"):  # MLA's q (with a q LoRA)
                p.mul_(QK_SCALE)
            if c["arch"] == "deepseek_v3" and name.endswith(("kv_b_proj.weight", "kv_a_proj_with_mqa.weight")):
                p.mul_(MLA_KV_SCALE)
            # bf16 storage: round now so the float32 model is exactly the saved one (the tensors kept in
            # float32 in the file stay as drawn)
            if not keeps_fp32(model, name):
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
        if c["arch"] in SIGMOID_MOE_ARCHS:  # a persistent float32 buffer, saved with the weights
            for name, b in model.named_buffers():
                if name.endswith("mlp.gate.e_score_correction_bias"):
                    b.copy_(E_BIAS_SCALE * torch.randn(b.shape))
    return model


def keeps_fp32(model, name):
    """Whether transformers keeps this parameter / buffer in float32 in a bf16 model
    (_keep_in_fp32_modules_strict: the sigmoid routers' gate.weight and e_score_correction_bias)."""
    keep = type(model)._keep_in_fp32_modules_strict or []
    return any(name == k or name.endswith("." + k) for k in keep)


def save_bf16(model, d):
    """save_pretrained in bfloat16, but for what transformers keeps in float32 (keeps_fp32); returns the
    state dict written, in its saved dtypes."""
    keep = {n: t.detach().clone() for n, t in model.state_dict().items() if keeps_fp32(model, n)}
    model.to(torch.bfloat16)
    for n, t in keep.items():
        owner, _, attr = n.rpartition(".")
        getattr(model.get_submodule(owner), attr).data = t
    model.save_pretrained(d, safe_serialization=True)
    return model.state_dict()


def routing_gaps(model64, c, ids):
    """Sigmoid routers (GLM-4.5, DeepSeek-V3): over a float64 forward of `ids`, every MoE layer and token,
    transformers' group-limited top-K choice on scores + e_score_correction_bias equals a float64
    re-derivation; returns the smallest topk_group-th minus next group score, the smallest K-th minus
    (K+1)-th allowed score, and how many (layer, token) choices the selection bias changes."""
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((m, i[0].detach(), o[2].detach())))
             for n, m in model64.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        model64(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    assert len(seen) == c["layers"] - c["first_k_dense"]
    group_gap, choice_gap, changed = float("inf"), float("inf"), 0
    for gate, x, hf_idx in seen:
        scores = torch.sigmoid(x.reshape(-1, c["hidden"]).double() @ gate.weight.double().t())
        biased = scores + gate.e_score_correction_bias.double()
        choice, gg, cg = route_sigmoid(biased, c["n_group"], c["topk_group"], c["top_k"])
        plain, _, _ = route_sigmoid(scores, c["n_group"], c["topk_group"], c["top_k"])
        assert torch.equal(choice, torch.sort(hf_idx, dim=-1).values), "routing differs from transformers'"
        if gg is not None:
            group_gap = min(group_gap, gg.min().item())
        choice_gap = min(choice_gap, cg.min().item())
        changed += (choice != plain).any(dim=-1).sum().item()
    return group_gap, choice_gap, changed


def route_sigmoid(scores_for_choice, n_group, topk_group, top_k):
    """transformers' group-limited top-K (Glm4MoeTopkRouter / DeepseekV3TopkRouter): a group's score is the
    sum of its two best scores, the topk_group best groups are kept, the top-K scores inside them chosen.
    Returns the sorted choice [N, K], the topk_group-th minus (topk_group+1)-th group score (None when
    every group is kept) and the K-th minus (K+1)-th allowed score."""
    n, e = scores_for_choice.shape
    group_scores = scores_for_choice.view(n, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_gap = None
    if n_group > topk_group:
        gs = torch.sort(group_scores, dim=-1, descending=True).values
        group_gap = gs[:, topk_group - 1] - gs[:, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, topk_group, dim=-1)[1], 1)
    allowed = group_mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(n, e).bool()
    masked = scores_for_choice.masked_fill(~allowed, float("-inf"))
    srt = torch.sort(masked, dim=-1, descending=True).values
    choice = torch.sort(torch.topk(masked, top_k, dim=-1)[1], dim=-1).values
    return choice, group_gap, srt[:, top_k - 1] - srt[:, top_k]


def train_tokenizer(out_dir, vocab):
    sentences = []
    for i, s in enumerate(SUBJECTS):
        for j, v in enumerate(VERBS):
            for k, o in enumerate(OBJECTS):
                e = ENDINGS[(i + 2 * j + 3 * k) % len(ENDINGS)]
                sentences.append(f"{s.capitalize()} {v} {o} {e}")
    # Chat markup and every printable ASCII character, so no prompt of the tests needs <unk>.
    for s in SUBJECTS:
        sentences.append(f"[INST] Hello there, my friend. Where is {s}? [/INST] {s.capitalize()} is near the sea.")
    sentences.append("".join(chr(c) for c in range(32, 127)))
    with tempfile.TemporaryDirectory() as tmp:
        # A relative prefix inside the temporary directory: the model file records it, so the bytes
        # do not depend on where the script runs.
        cwd = os.getcwd()
        os.chdir(tmp)
        prefix = "tokenizer"
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_prefix=prefix, vocab_size=vocab, model_type="bpe",
                byte_fallback=False, character_coverage=1.0, split_digits=True, normalization_rule_name="identity",
                remove_extra_whitespaces=False, add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                num_threads=1, minloglevel=2)
        finally:
            os.chdir(cwd)
        shutil.copy(os.path.join(tmp, prefix + ".model"), os.path.join(out_dir, "tokenizer.model"))
    return spm.SentencePieceProcessor(model_file=os.path.join(out_dir, "tokenizer.model"))


def greedy_recompute64(model64, prompt, n, eos):
    """Greedy by full recomputation in float64, no cache; returns tokens and the smallest top-1 gap."""
    ids = list(prompt)
    out, min_gap = [], float("inf")
    for _ in range(n):
        with torch.no_grad():
            logits = model64(torch.tensor([ids]), use_cache=False).logits[0, -1]
        top = torch.topk(logits, 2).values
        min_gap = min(min_gap, (top[0] - top[1]).item())
        t = int(torch.argmax(logits))
        if t == eos:
            break
        out.append(t)
        ids.append(t)
    return out, min_gap


def hf_generate(model32, prompt, n, eos):
    with torch.no_grad():
        seq = model32.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=eos)
    gen = seq[0, len(prompt):].tolist()
    if eos in gen:  # transformers keeps the eos it stopped on (then pads with it)
        gen = gen[:gen.index(eos)]
    return gen


def make_case(name, c, out_root):
    d = os.path.join(out_root, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model = build(c)
    cls = type(model)
    if cls._keep_in_fp32_modules_strict:
        saved = save_bf16(model, d)
        # The file holds what transformers holds for the model loaded in bf16: float32 where it keeps float32.
        held = cls.from_pretrained(d, dtype=torch.bfloat16).state_dict()
        assert {n: t.dtype for n, t in saved.items()} == {n: t.dtype for n, t in held.items()}, "saved dtypes"
        assert all(torch.equal(saved[n], held[n]) for n in saved), "a bf16 load changed a value"
        assert any(t.dtype == torch.float32 for t in saved.values())
    else:
        model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    model32 = cls.from_pretrained(d, dtype=torch.float32).eval()
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), model32.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), f"reload changed {n1}"
    if c["arch"] in SIGMOID_MOE_ARCHS:  # the selection bias is a buffer: saved, and loaded back unchanged
        b1 = {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
        b2 = {n: b for n, b in model32.named_buffers() if n.endswith("e_score_correction_bias")}
        assert b1.keys() == b2.keys() and len(b1) == c["layers"] - c["first_k_dense"]
        assert all(torch.equal(b1[n], b2[n]) and b2[n].abs().min() > 0 for n in b1), "selection bias lost"
    kw = {"experts_implementation": "eager"} if c["arch"] in EAGER_EXPERT_ARCHS else {}  # no float64 grouped_mm
    model64 = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager", **kw).double().eval()

    eos = 2
    case = {"model": name, "class": cls.__name__, "new_tokens": NEW_TOKENS}
    hf_tok = None
    if c.get("tokenizer_json"):
        from transformers import PreTrainedTokenizerFast
        shutil.copy(TINY_TOKENIZER_JSON, os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
                       "pad_token": "<|endoftext|>", "chat_template": CHATML}, f, indent=2)
            f.write("\n")
        hf_tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"), eos_token="<|im_end|>",
                                         pad_token="<|endoftext|>")
        hf_tok.chat_template = CHATML
        assert hf_tok.convert_tokens_to_ids("<|im_end|>") == eos
    sp = train_tokenizer(d, c["vocab"]) if c["tokenizer"] else None
    if sp is not None:
        prompt = [1] + sp.encode(COMPLETION_PROMPT + " sees the river and")
        prompt = prompt[:c["prompt_len"]]
    else:
        g = torch.Generator().manual_seed(100 + c["seed"])
        prompt = [1] + torch.randint(3, c["vocab"], (c["prompt_len"] - 1,), generator=g).tolist()
    gen = hf_generate(model32, prompt, NEW_TOKENS, eos)
    ref, gap = greedy_recompute64(model64, prompt, NEW_TOKENS, eos)
    assert gen == ref, f"{name}: transformers generate {gen} != float64 recomputation {ref}"
    assert len(gen) == NEW_TOKENS, f"{name}: EOS after {len(gen)} tokens; change the seed"
    assert gap > MIN_GAP, f"{name}: smallest greedy gap {gap:.3g}; change the seed"
    assert len(set(gen)) >= 8, f"{name}: only {len(set(gen))} distinct tokens; change the seed"
    case.update(prompt_ids=prompt, expected_ids=gen, min_top1_gap_float64=round(gap, 6))
    if c["arch"] in SIGMOID_MOE_ARCHS:
        group_gap, choice_gap, changed = routing_gaps(model64, c, prompt + gen)
        assert group_gap > MIN_ROUTING_GAP, f"{name}: group gap {group_gap:.3g}; change the seed"
        assert choice_gap > MIN_ROUTING_GAP, f"{name}: routing gap {choice_gap:.3g}; change the seed"
        assert changed > 0, f"{name}: the selection bias changes no choice; change the seed"
        # Without the selection bias (a loader dropping it) the reply differs.
        biases = [b for n, b in model64.named_buffers() if n.endswith("e_score_correction_bias")]
        kept = [b.clone() for b in biases]
        for b in biases:
            b.zero_()
        unbiased, _ = greedy_recompute64(model64, prompt, NEW_TOKENS, eos)
        for b, k in zip(biases, kept):
            b.copy_(k)
        assert unbiased != gen, f"{name}: the reply does not depend on the selection bias; change the seed"
        first = next(i for i in range(NEW_TOKENS) if i >= len(unbiased) or unbiased[i] != gen[i])
        print(f"{name}: routing gaps: group {group_gap:.4f}, choice {choice_gap:.4f}; the selection bias changes "
              f"{changed} of {(c['layers'] - c['first_k_dense']) * len(prompt + gen)} (layer, token) choices; "
              f"without it the reply differs from new token {first} on")
    if c["sliding_window"]:
        assert len(prompt) + NEW_TOKENS > c["sliding_window"] > len(prompt)

    if hf_tok is not None:
        # Chat (ChatML, transformers' apply_chat_template): the reply ends at <|im_end|> (EOS) or after 16.
        msgs = [{"role": "user", "content": CHAT_USER}]
        chat_prompt = list(hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"])
        chat_gen = hf_generate(model32, chat_prompt, TEXT_MAX_TOKENS, eos)
        chat_ref, chat_gap = greedy_recompute64(model64, chat_prompt, TEXT_MAX_TOKENS, eos)
        assert chat_gen == chat_ref and chat_gap > MIN_GAP, (chat_gen, chat_ref, chat_gap)
        chat_text = hf_tok.decode(chat_gen, skip_special_tokens=True)
        assert len(chat_text) > 0
        case["text"] = {"max_tokens": TEXT_MAX_TOKENS, "template": "chatml",
                        "chat": {"user": CHAT_USER, "prompt_ids": chat_prompt, "completion_ids": chat_gen,
                                 "content": chat_text,
                                 "finish_reason": "length" if len(chat_gen) == TEXT_MAX_TOKENS else "stop"}}
    if sp is not None:
        # Chat (mistral template, mistral-common v1): BOS enc("[INST] " + user + " [/INST]"); the reply is
        # the decode of the new tokens alone.
        chat_prompt = [1] + sp.encode("[INST] " + CHAT_USER + " [/INST]")
        chat_gen = hf_generate(model32, chat_prompt, TEXT_MAX_TOKENS, eos)
        chat_ref, chat_gap = greedy_recompute64(model64, chat_prompt, TEXT_MAX_TOKENS, eos)
        assert chat_gen == chat_ref and chat_gap > MIN_GAP, (chat_gen, chat_ref, chat_gap)
        # Completion: BOS enc(prompt); the text is what decoding prompt + new tokens adds after the prompt.
        comp_prompt = [1] + sp.encode(COMPLETION_PROMPT)
        comp_gen = hf_generate(model32, comp_prompt, TEXT_MAX_TOKENS, eos)
        comp_ref, comp_gap = greedy_recompute64(model64, comp_prompt, TEXT_MAX_TOKENS, eos)
        assert comp_gen == comp_ref and comp_gap > MIN_GAP, (comp_gen, comp_ref, comp_gap)
        full = sp.decode(comp_prompt + comp_gen)
        head = sp.decode(comp_prompt)
        assert full.startswith(head)
        chat_text, comp_text = sp.decode(chat_gen), full[len(head):]
        assert len(chat_text) > 0 and len(comp_text) > 0
        case["text"] = {
            "max_tokens": TEXT_MAX_TOKENS,
            "chat": {"user": CHAT_USER, "prompt_ids": chat_prompt, "completion_ids": chat_gen, "content": chat_text,
                     "finish_reason": "length" if len(chat_gen) == TEXT_MAX_TOKENS else "stop"},
            "completion": {"prompt": COMPLETION_PROMPT, "prompt_ids": comp_prompt, "completion_ids": comp_gen,
                           "text": comp_text,
                           "finish_reason": "length" if len(comp_gen) == TEXT_MAX_TOKENS else "stop"},
        }
    return case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/golden/generate")
    ap.add_argument("--cases", default=None,
                    help="comma-separated case names: rewrite only these, keeping the other entries of the "
                         "existing expected.json")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.cases is None:
        cases = [make_case(n, c, args.out) for n, c in CASES.items()]
    else:
        names = args.cases.split(",")
        assert all(n in CASES for n in names), f"unknown case in {names}; known: {list(CASES)}"
        with open(os.path.join(args.out, "expected.json")) as f:
            old = {c["model"]: c for c in json.load(f)["cases"]}
        missing = [n for n in CASES if n not in names and n not in old]
        assert not missing, f"expected.json has no {missing}; run without --cases"
        new = {n: make_case(n, CASES[n], args.out) for n in names}
        cases = [new[n] if n in new else old[n] for n in CASES]
    meta = {"torch_version": torch.__version__, "transformers_version": transformers.__version__,
            "sentencepiece_version": spm.__version__, "cases": cases}
    with open(os.path.join(args.out, "expected.json"), "w") as f:  # one line per case
        head = {k: v for k, v in meta.items() if k != "cases"}
        f.write(json.dumps(head)[:-1] + ', "cases": [\n')
        f.write(",\n".join(json.dumps(c) for c in cases) + "\n]}\n")
    for c in cases:
        print(c["model"], "prompt", len(c["prompt_ids"]), "tokens;", len(c["expected_ids"]), "new; min gap",
              c["min_top1_gap_float64"])
        if "text" in c:
            print("  chat:", repr(c["text"]["chat"]["content"]), c["text"]["chat"]["finish_reason"])
            if "completion" in c["text"]:
                print("  completion:", repr(c["text"]["completion"]["text"]), c["text"]["completion"]["finish_reason"])


if __name__ == "__main__":
    main()
