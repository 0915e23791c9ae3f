#!/usr/bin/env python3
"""The official `openai` Python client against `moetron serve` on a Qwen3-style and a GPT-OSS-style model
directory: the tiny Qwen3-MoE of tests/golden/generate/qwen3_moe with Qwen3's and gpt-oss's real chat
templates (../shared/data/templates) in its tokenizer_config.json.  Every committed conversation
(tests/data/chat_templates/conversations.jsonl, its final assistant turn removed) goes through
client.chat.completions.create with its tools, assistant tool calls, tool results, reasoning and
chat_template_kwargs (extra_body); the prompt the server reports (usage.prompt_tokens) must be the length of
transformers' apply_chat_template(add_generation_prompt=True) (tests/data/chat_templates/ids/prompts.jsonl),
and what the template refuses must come back as a 400 BadRequestError naming 'messages'.

    pip install openai
    python3 tools/openai_template_check.py --binary build/moetron

Exit status 0 when every check passes.  Development tool (tests/test_serve.cpp covers the same exchanges
in CI with a C++ client).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import openai
from openai import OpenAI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "gptoss": ("openai-gpt-oss-120b.jinja", {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "moetron"))
    args = ap.parse_args()
    data = os.path.join(ROOT, "tests", "data", "chat_templates")
    convs = {c["name"]: c for c in map(json.loads, open(os.path.join(data, "conversations.jsonl"), encoding="utf-8"))}
    prompts = [json.loads(l) for l in open(os.path.join(data, "ids", "prompts.jsonl"), encoding="utf-8")]
    golden = os.path.join(ROOT, "tests", "golden", "generate", "qwen3_moe")
    failures, passed = [], 0
    print(f"openai {openai.__version__} client")
    for case, (tfile, specials) in CASES.items():
        tmp = tempfile.mkdtemp(prefix=f"moetron_{case}_")
        try:
            for f in ("generation_config.json", "model.safetensors", "tokenizer.json"):
                shutil.copy(os.path.join(golden, f), tmp)
            # 4096 positions instead of 512, so the tool conversations (long system prompts) fit.
            mc = json.load(open(os.path.join(golden, "config.json")))
            mc["max_position_embeddings"] = 4096
            json.dump(mc, open(os.path.join(tmp, "config.json"), "w"))
            cfg = dict(specials)
            cfg["chat_template"] = open(os.path.join(ROOT, "..", "shared", "data", "templates", tfile), encoding="utf-8").read()
            json.dump(cfg, open(os.path.join(tmp, "tokenizer_config.json"), "w"))
            proc = subprocess.Popen([args.binary, "serve", "--model", tmp, "--port", "0", "--model-name", "tiny",
                                     "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            line = proc.stdout.readline().strip()
            if "listening on" not in line:
                sys.exit(f"moetron serve did not start: {line!r} {proc.stderr.read()}")
            client = OpenAI(base_url=line.split("listening on ")[1] + "/v1", api_key="not-needed", max_retries=0)
            try:
                for want in (p for p in prompts if p["case"] == case):
                    c = convs[want["conversation"]]
                    msgs = list(c["messages"])
                    if msgs and msgs[-1]["role"] == "assistant":
                        msgs = msgs[:-1]
                    kw = {}
                    if "tools" in c:
                        kw["tools"] = c["tools"]
                    if "chat_template_kwargs" in c:
                        kw["extra_body"] = {"chat_template_kwargs": c["chat_template_kwargs"]}
                    name = f"{case}/{want['conversation']}"
                    try:
                        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, temperature=0, **kw)
                        got = ("ok", r.usage.prompt_tokens)
                    except openai.BadRequestError as e:
                        body = e.body if isinstance(e.body, dict) else {}
                        got = ("400", body.get("param"), body.get("code"))
                    if "error" in want:
                        ok = got[0] == "400" and got[1] == "messages"
                    else:
                        ok = got == ("ok", len(want["ids"]))
                    print(f"{'PASS' if ok else 'FAIL'} {name}: {got}")
                    passed += ok
                    if not ok:
                        failures.append(name)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{passed} passed, {len(failures)} failed" + (f": {failures}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
