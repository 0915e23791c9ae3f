#!/usr/bin/env python3
"""Write the mistral-common reference tokenizations of the chat test cases (tests/golden/chat/).

For every conversation in tests/data/chat_cases.jsonl this runs mistral-common's v1 tokenizer
(`MistralTokenizer.encode_chat_completion`, the Mixtral-8x7B-Instruct-v0.1 format) on the
tokenizer.model.v1 file shipped inside mistral-common, which is byte-identical to
../shared/data/mixtral-tokenizer.model (checked below), and records:

  tokens     the token ids mistral-common produces.  Validation mode: `finetuning` when the
             conversation ends with an assistant message (mistral-common's mode for training data),
             `test` otherwise (a prompt awaiting generation); the same tokens are also checked
             under `agnostic` mode.
  loss_mask  1 on each assistant message's tokens and its EOS, derived from mistral-common itself:
             for a run of assistant messages starting at message i and ending before message k,
             the span is len(encode(messages[:i])) .. len(encode(messages[:k])).  Both prefix
             encodings must be prefixes of the full encoding; when a later system message changes
             an earlier user turn (the system prompt is folded into the first user message) this
             does not hold and loss_mask is null.  The prefix encodings use `agnostic` mode.
  text       mistral-common's decoded text with special tokens kept (for humans reading diffs).

For every conversation in tests/data/chat_error_cases.jsonl it records that mistral-common refuses
it (in every validation mode) and the exception it raises.

Development tool only; the C++ tests read the committed output.  Usage (from the repo root):
    python3 -m venv /tmp/mc && /tmp/mc/bin/pip install mistral-common sentencepiece
    /tmp/mc/bin/python tools/make_chat_reference.py --out tests/golden/chat/mistral_v1.json
"""

import argparse
import hashlib
import json
import os
import sys

import mistral_common
import sentencepiece
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.validator import ValidationMode
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

SHARED_TOKENIZER_SHA256 = "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055"


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_cases(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Reference:
    def __init__(self):
        self.model_path = str(MistralTokenizer._data_path() / "tokenizer.model.v1")
        digest = sha256(self.model_path)
        if digest != SHARED_TOKENIZER_SHA256:
            sys.exit(f"{self.model_path}: sha256 {digest} is not the shared Mixtral tokenizer's")
        self.tok = {mode: MistralTokenizer.from_file(self.model_path, mode=mode)
                    for mode in (ValidationMode.finetuning, ValidationMode.test, ValidationMode.agnostic)}
        version = self.tok[ValidationMode.test].instruct_tokenizer.tokenizer.version.value
        if version != "v1":
            sys.exit(f"expected the v1 instruct tokenizer, got {version}")

    def encode(self, messages, mode):
        request = ChatCompletionRequest(messages=messages)
        return self.tok[mode].encode_chat_completion(request)

    def loss_mask(self, messages, tokens):
        mask = [0] * len(tokens)
        i, n = 0, len(messages)
        while i < n:
            if messages[i]["role"] != "assistant":
                i += 1
                continue
            k = i
            while k < n and messages[k]["role"] == "assistant":
                k += 1
            if i == 0:
                return None  # mistral-common inserts an empty user turn; no prefix to measure
            before = self.encode(messages[:i], ValidationMode.agnostic).tokens
            after = self.encode(messages[:k], ValidationMode.agnostic).tokens
            if tokens[:len(before)] != before or tokens[:len(after)] != after:
                return None
            for p in range(len(before), len(after)):
                mask[p] = 1
            i = k
        return mask


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--cases", default=os.path.join(root, "tests", "data", "chat_cases.jsonl"))
    ap.add_argument("--error-cases", default=os.path.join(root, "tests", "data", "chat_error_cases.jsonl"))
    ap.add_argument("--out", default=os.path.join(root, "tests", "golden", "chat", "mistral_v1.json"))
    args = ap.parse_args()

    ref = Reference()
    out_cases = []
    for case in load_cases(args.cases):
        messages = case["messages"]
        mode = ValidationMode.finetuning if messages[-1]["role"] == "assistant" else ValidationMode.test
        enc = ref.encode(messages, mode)
        tokens = list(enc.tokens)
        agnostic = list(ref.encode(messages, ValidationMode.agnostic).tokens)
        if agnostic != tokens:
            sys.exit(f"{case['name']}: tokens differ between {mode.name} and agnostic mode")
        text = ref.tok[mode].decode(tokens, special_token_policy=SpecialTokenPolicy.KEEP)
        out_cases.append({"name": case["name"], "validation_mode": mode.name, "tokens": tokens,
                          "loss_mask": ref.loss_mask(messages, tokens), "text": text})

    out_errors = []
    for case in load_cases(args.error_cases):
        errors = []
        for mode in (ValidationMode.finetuning, ValidationMode.test, ValidationMode.agnostic):
            try:
                ref.encode(case["messages"], mode)
            except Exception as e:  # noqa: BLE001 - any refusal counts; its type is recorded
                errors.append(f"{type(e).__name__}: {e}".splitlines()[0])
            else:
                sys.exit(f"{case['name']}: mistral-common accepted it in {mode.name} mode")
        out_errors.append({"name": case["name"], "error": errors[-1]})

    doc = {
        "generator": "tools/make_chat_reference.py",
        "mistral_common_version": mistral_common.__version__,
        "sentencepiece_version": sentencepiece.__version__,
        "tokenizer_sha256": SHARED_TOKENIZER_SHA256,
        "cases": out_cases,
        "error_cases": out_errors,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    # One case per line keeps the file small and its diffs readable.
    def lines(items):
        return ",\n".join("  " + json.dumps(x, ensure_ascii=False) for x in items)
    head = {k: v for k, v in doc.items() if k not in ("cases", "error_cases")}
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(json.dumps(head, ensure_ascii=False, indent=1)[:-2] + ",\n")
        f.write(' "cases": [\n' + lines(doc["cases"]) + "\n ],\n")
        f.write(' "error_cases": [\n' + lines(doc["error_cases"]) + "\n ]\n}\n")
    masked = sum(c["loss_mask"] is not None for c in out_cases)
    print(f"wrote {args.out}: {len(out_cases)} cases ({masked} with a loss mask), {len(out_errors)} error cases")


if __name__ == "__main__":
    main()
