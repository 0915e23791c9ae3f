#!/usr/bin/env python3
"""Parameter counts of the Hub configs under configs/models/, from transformers' own modules.

Builds each model on the meta device (no memory) from its config.json and counts its parameters
(transformers' count: buffers such as e_score_correction_bias excluded; multi-token-prediction layers
are not built, as transformers does not build them), the routed experts' share and the active count
per token (total - (E - K)/E x experts). tests/test_plan.cpp compares `moetron plan` with these
numbers. Development tool only. Usage: python3 tools/count_params_hf.py
"""
import json
import os
import sys

import torch
import transformers
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM)

MODELS = [("deepseek-v3", DeepseekV3Config, DeepseekV3ForCausalLM),
          ("kimi-k2-instruct", DeepseekV3Config, DeepseekV3ForCausalLM),
          ("glm-4.5", Glm4MoeConfig, Glm4MoeForCausalLM),
          ("glm-4.5-air", Glm4MoeConfig, Glm4MoeForCausalLM)]
SKIP = ("architectures", "model_type", "transformers_version", "torch_dtype", "quantization_config", "auto_map")


def main():
    transformers.logging.set_verbosity_error()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "models")
    print(f"transformers {transformers.__version__}")
    for name, config_class, model_class in MODELS:
        with open(os.path.join(root, name, "config.json")) as f:
            j = json.load(f)
        cfg = config_class(**{k: v for k, v in j.items() if k not in SKIP})
        with torch.device("meta"):
            model = model_class(cfg)
        total = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
        e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        active = total - experts // e * (e - k)
        embedding = model.model.embed_tokens.weight.numel()
        print(f"{name}: total {total} experts {experts} active {active} active_without_embedding {active - embedding}")


if __name__ == "__main__":
    sys.exit(main())
