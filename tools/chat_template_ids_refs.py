#!/usr/bin/env python3
"""Token ids and assistant masks of rendered chat templates, as transformers gives them, for
`moetron template render --ids` (tests/test_template_cli.cpp).

Usage (from the repository root):  python3 tools/chat_template_ids_refs.py

For each case below: a PreTrainedTokenizerFast over ../shared/data/qwen-tokenizer.json with the
case's special tokens and chat template, then for every conversation of
tests/data/chat_templates/conversations.jsonl (add_generation_prompt false):
apply_chat_template(messages, tools=..., tokenize=True, return_dict=True,
return_assistant_tokens_mask=<template has {% generation %}>, **chat_template_kwargs).
Writes tests/data/chat_templates/ids/<case>.jsonl: {"conversation", "ids", "assistant_mask", "mask_rule"} or
{"conversation", "error"}.  The clock is frozen at 2026-12-07 12:00.

The mask: a generation template's is transformers' assistant_masks ("generation"); for the others it is the
prefix rule of moetron's jinja/chat_context.h, computed here independently with transformers: for each
assistant message i, P = render(messages[:i], add_generation_prompt=True), Q = render(messages[:i+1]); when
Q starts with P and the whole rendering starts with Q, the tokens whose offsets (the tokenizer's
offset_mapping) overlap [len(P), len(Q)) are 1 ("prefix"); otherwise no mask ("unstable").  Offsets are in
characters here and in bytes in moetron; both locate the same tokens.
"""
import datetime as _dt
import json
import os
import re

import transformers.utils.chat_template_utils as ctu
from transformers import PreTrainedTokenizerFast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "data")


class _Frozen(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 12, 7, 12, 0, 0)


ctu.datetime = _Frozen

CASES = {
    # name: (template file, special tokens)
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "qwen25": ("Qwen-Qwen2.5-7B-Instruct.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "lfm25": ("LFM2.5-8B-A1B.jinja", {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
}


def render(tok, c, messages, agp):
    return tok.apply_chat_template(messages, tools=c.get("tools"), tokenize=False, add_generation_prompt=agp,
                                   **c.get("chat_template_kwargs", {}))


def prefix_mask(tok, c, ids):
    full = render(tok, c, c["messages"], False)
    spans = []
    for i, m in enumerate(c["messages"]):
        if m.get("role") != "assistant":
            continue
        try:
            p = render(tok, c, c["messages"][:i], True)
            q = render(tok, c, c["messages"][: i + 1], False)
        except Exception:  # noqa: BLE001 - a prefix the template refuses
            return None, "unstable"
        if not q.startswith(p) or not full.startswith(q) or len(q) == len(p):
            return None, "unstable"
        spans.append((len(p), len(q)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == ids
    return [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]], "prefix"


def main():
    convs = [json.loads(l) for l in open(os.path.join(ROOT, "tests/data/chat_templates/conversations.jsonl"), encoding="utf-8")]
    out_dir = os.path.join(ROOT, "tests/data/chat_templates/ids")
    os.makedirs(out_dir, exist_ok=True)
    for case, (tfile, specials) in CASES.items():
        tmpl = open(os.path.join(SHARED, "templates", tfile), encoding="utf-8").read()
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(SHARED, "qwen-tokenizer.json"), **specials)
        tok.chat_template = tmpl
        gen = re.search(r"\{\%-?\s*generation\s*-?\%\}", tmpl) is not None
        lines = []
        for c in convs:
            rec = {"conversation": c["name"]}
            try:
                enc = tok.apply_chat_template(c["messages"], tools=c.get("tools"), tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=gen, **c.get("chat_template_kwargs", {}))
                rec["ids"] = list(enc["input_ids"])
                if gen:
                    rec["assistant_mask"] = list(enc["assistant_masks"])
                    rec["mask_rule"] = "generation"
                else:
                    mask, rule = prefix_mask(tok, c, rec["ids"])
                    rec["mask_rule"] = rule
                    if mask is not None:
                        rec["assistant_mask"] = mask
            except Exception as e:  # noqa: BLE001 - the reference records what transformers does
                rec["error"] = f"{type(e).__name__}: {e}"
            lines.append(json.dumps(rec, ensure_ascii=False))
        with open(os.path.join(out_dir, case + ".jsonl"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        print(case, len(lines), "conversations,", sum("error" in json.loads(l) for l in lines), "errors")


# Prompts a server builds (add_generation_prompt=True) for a Qwen3-style and a GPT-OSS-style model
# directory (tests/test_serve.cpp: the tiny Qwen3-MoE of tests/golden/generate/qwen3_moe, its own small
# byte-level tokenizer.json, with these templates): every conversation without its final assistant message.
PROMPT_CASES = {
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "gptoss": ("openai-gpt-oss-120b.jinja", {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
}


def prompts():
    convs = [json.loads(l) for l in open(os.path.join(ROOT, "tests/data/chat_templates/conversations.jsonl"), encoding="utf-8")]
    lines = []
    for case, (tfile, specials) in PROMPT_CASES.items():
        tmpl = open(os.path.join(SHARED, "templates", tfile), encoding="utf-8").read()
        tok = PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(ROOT, "tests/golden/generate/qwen3_moe/tokenizer.json"), **specials)
        tok.chat_template = tmpl
        for c in convs:
            msgs = c["messages"]
            if msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            rec = {"case": case, "conversation": c["name"]}
            try:
                enc = tok.apply_chat_template(msgs, tools=c.get("tools"), tokenize=True, return_dict=True,
                                              add_generation_prompt=True, **c.get("chat_template_kwargs", {}))
                rec["ids"] = list(enc["input_ids"])
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"
            lines.append(json.dumps(rec, ensure_ascii=False))
    with open(os.path.join(ROOT, "tests/data/chat_templates/ids/prompts.jsonl"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("prompts", len(lines), "renders,", sum("error" in json.loads(l) for l in lines), "errors")


if __name__ == "__main__":
    main()
    prompts()
