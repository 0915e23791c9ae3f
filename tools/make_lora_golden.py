#!/usr/bin/env python3
"""Write the PEFT LoRA reference cases under tests/golden/lora/ (see tests/golden/README.md, "LoRA").

For each case: a tiny random HF model from make_golden.py's recipe with its weights rounded to
bfloat16-representable values (so a bf16-stored frozen base is exact), saved with save_pretrained;
then, in float64 with make_golden's float64_numerics, PEFT LoRA (r, alpha) on q/k/v/o_proj
(target_modules) and on the fused experts' gate_up_proj and down_proj (target_parameters) with
PEFT's default initialisation (A kaiming-uniform, B zero), and 5 AdamW steps on the adapters:
the loss and every adapter gradient of each step, the logits of the base, of the initial adapter
(equal: B = 0) and of the final one.  The initial and the final adapters are written by PEFT's
save_pretrained (float32 copies), so the C++ tests read real PEFT directories.

Development tool only: the C++ tests read the committed outputs. Usage:
    python3 tools/make_lora_golden.py --out tests/golden/lora
"""

import argparse
import copy
import os
import shutil
import sys

import numpy as np
import peft
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_golden as mg  # noqa: E402

ADAMW = dict(lr=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0, steps=5)
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

CASES = {
    # Mixtral as mixtral_gqa, LoRA r 4, alpha 8 (scale 2).
    "mixtral": dict(base="mixtral_gqa", override=dict(seed=42), r=4, alpha=8, init_seed=101),
    # Qwen3-MoE as qwen3_moe_mixed: a dense layer (no experts to adapt) between sparse ones, head_dim 12.
    "qwen3_moe": dict(base="qwen3_moe_mixed", override=dict(seed=32), r=3, alpha=12, init_seed=102),
    # Qwen2-MoE as qwen2_moe_shared (q/k/v biases, shared experts in layers 0, 1, layer 2 dense), and LoRA
    # on the dense MLP and the shared experts too (gate_proj / up_proj / down_proj match both).
    "qwen2_moe": dict(base="qwen2_moe_shared", override=dict(seed=62), r=4, alpha=8, init_seed=103,
                      modules=TARGET_MODULES + ["gate_proj", "up_proj", "down_proj"]),
    # The mixtral case's base with LoRA on the router as well (target_parameters mlp.gate.weight): the
    # adapters move the routing probabilities (and their gradient is the aux loss's and the weights').
    "mixtral_router": dict(base="mixtral_gqa", override=dict(seed=42), r=4, alpha=8, init_seed=104,
                           parameters=["mlp.gate.weight"] + TARGET_PARAMETERS),
}


def peft_grads(pm):
    """{file name: float32 gradient} for every adapter parameter."""
    out = {}
    for name, p in pm.named_parameters():
        if p.requires_grad:
            assert "lora_" in name, name
            out[name.replace(".default", "")] = mg.f32(p.grad)
    return out


def save_adapter(pm, path):
    pm32 = copy.deepcopy(pm).float()
    pm32.save_pretrained(path, safe_serialization=True)


def make_case(name, spec, out_root):
    c = dict(mg.CASES[spec["base"]], **spec.get("override", {}))
    case_dir = os.path.join(out_root, name)
    if os.path.isdir(case_dir):
        shutil.rmtree(case_dir)
    os.makedirs(case_dir)
    model32 = mg.build_model(c)
    with torch.no_grad():
        for p in model32.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    model32.save_pretrained(case_dir, safe_serialization=True)
    kw = {"experts_implementation": "eager"}
    loaded = type(model32).from_pretrained(case_dir, dtype=torch.float32, attn_implementation="eager", **kw)
    inputs = mg.build_inputs(c)
    mg.save_safetensors(os.path.join(case_dir, "input.safetensors"), {k: v.numpy() for k, v in inputs.items()})

    with mg.float64_numerics():
        model = copy.deepcopy(loaded).double().train()
        model.loss_function = mg._causal_lm_loss
        with torch.no_grad():
            base_logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        lc = peft.LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=0.0,
                             target_modules=spec.get("modules", TARGET_MODULES),
                             target_parameters=spec.get("parameters", TARGET_PARAMETERS), bias="none",
                             task_type="CAUSAL_LM")
        torch.manual_seed(spec["init_seed"])
        pm = peft.get_peft_model(model, lc)
        trainable = [p for p in pm.parameters() if p.requires_grad]
        n_adapters = sum(1 for n, _ in pm.named_parameters() if "lora_" in n)
        assert len(trainable) == n_adapters > 0
        save_adapter(pm, os.path.join(case_dir, "adapter_init"))
        with torch.no_grad():
            init_logits = pm(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        assert torch.equal(init_logits, base_logits), "PEFT's initial adapter changed the logits"
        opt = torch.optim.AdamW(trainable, lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]), eps=ADAMW["eps"],
                                weight_decay=ADAMW["weight_decay"], foreach=False)
        expected = {"logits_base": mg.f32(base_logits)}
        losses, norms, gaps = [], [], []
        for step in range(ADAMW["steps"]):
            pm.zero_grad(set_to_none=True)
            out = pm(**inputs, output_router_logits=True)
            out.loss.backward()
            gaps += mg.check_routing(pm.base_model.model, out, c, f"lora step {step}")
            losses.append(out.loss.item())
            for k, g in peft_grads(pm).items():
                expected[f"grad.{step}.{k}"] = g
            norms.append(torch.nn.utils.clip_grad_norm_(trainable, ADAMW["grad_clip"]).item())
            opt.step()
        with torch.no_grad():
            final_logits = pm(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        save_adapter(pm, os.path.join(case_dir, "adapter_final"))
    # Step 0's A gradients are zero (B = 0); later steps exercise them.
    a_grads = [v for k, v in expected.items() if k.startswith("grad.1.") and "lora_A" in k]
    assert a_grads and all(np.abs(a).max() > 0 for a in a_grads), "step 1 has a zero A gradient"
    # The final adapter's file holds the values the final logits came from (float32 copies).
    expected["logits_final"] = mg.f32(final_logits)
    expected["lora_loss"] = np.array(losses, dtype=np.float32)
    expected["lora_grad_norm"] = np.array(norms, dtype=np.float32)
    meta = {k: repr(v) if isinstance(v, float) else str(v) for k, v in ADAMW.items()}
    meta.update(r=str(spec["r"]), lora_alpha=str(spec["alpha"]), torch_version=torch.__version__,
                transformers_version=transformers.__version__, peft_version=peft.__version__,
                reference_dtype="float64", base_case=spec["base"], weight_decay_on="every adapter tensor")
    mg.save_safetensors(os.path.join(case_dir, "expected.safetensors"), expected, meta)
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(case_dir) for f in fs)
    assert size < 2_000_000, f"{name}: {size} bytes"
    print(f"{name}: loss {['%.6f' % x for x in losses]} grad_norm {['%.4f' % x for x in norms]} "
          f"min_gap {min(gaps):.4f} size {size} "
          f"final-vs-base logits {mg.rel_err(final_logits, base_logits):.3e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/golden/lora")
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")
    for name in args.case or CASES:
        make_case(name, CASES[name], args.out)


if __name__ == "__main__":
    sys.exit(main())
