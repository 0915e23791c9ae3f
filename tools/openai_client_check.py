#!/usr/bin/env python3
"""The official `openai` Python client against `moetron serve`: plain and streaming chat completions and
completions, the model list, logit_bias, refused parameters and errors, checked against transformers' replies on the committed tiny
model (tests/golden/generate/expected.json, written by tools/make_generate_reference.py).

    pip install openai
    python3 tools/openai_client_check.py --binary build/moetron          # starts and stops a server
    python3 tools/openai_client_check.py --base-url http://127.0.0.1:8000/v1 --model-name NAME   # a running one

Exit status 0 when every check passes. Development tool (the CI covers the same exchanges in
tests/test_serve.cpp with a C++ client).
"""

import argparse
import json
import os
import subprocess
import sys

import openai
from openai import OpenAI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "moetron"))
    ap.add_argument("--model-dir", default=os.path.join(ROOT, "tests", "golden", "generate", "mixtral_gqa"))
    ap.add_argument("--expected", default=os.path.join(ROOT, "tests", "golden", "generate", "expected.json"))
    ap.add_argument("--base-url", help="an already running server (then --binary is not started)")
    ap.add_argument("--model-name", default="tiny-mixtral")
    args = ap.parse_args()
    t = json.load(open(args.expected))["cases"][0]["text"]

    proc = None
    base_url = args.base_url
    if not base_url:
        proc = subprocess.Popen([args.binary, "serve", "--model", args.model_dir, "--port", "0", "--model-name",
                                 args.model_name, "--quiet"], stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline().strip()
        if "listening on" not in line:
            sys.exit(f"moetron serve did not start: {line!r}")
        base_url = line.split("listening on ")[1] + "/v1"
        print(f"started: {line}")
    failures = []

    def check(name, got, want):
        ok = got == want
        print(f"{'PASS' if ok else 'FAIL'} {name}: {got!r}" + ("" if ok else f" (expected {want!r})"))
        if not ok:
            failures.append(name)

    try:
        client = OpenAI(base_url=base_url, api_key="not-needed", max_retries=0)
        print(f"openai {openai.__version__} client, {base_url}")
        models = client.models.list()
        check("models.list ids", [m.id for m in models.data], [args.model_name])

        messages = [{"role": "user", "content": t["chat"]["user"]}]
        r = client.chat.completions.create(model=args.model_name, messages=messages, max_tokens=t["max_tokens"],
                                           temperature=0)
        check("chat plain content", r.choices[0].message.content, t["chat"]["content"])
        check("chat plain role", r.choices[0].message.role, "assistant")
        check("chat plain finish_reason", r.choices[0].finish_reason, t["chat"]["finish_reason"])
        check("chat plain usage", (r.usage.prompt_tokens, r.usage.completion_tokens),
              (len(t["chat"]["prompt_ids"]), len(t["chat"]["completion_ids"])))

        stream = client.chat.completions.create(model=args.model_name, messages=messages,
                                                max_tokens=t["max_tokens"], temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        pieces, finish, usage = [], None, None
        for chunk in stream:
            if chunk.usage:
                usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for c in chunk.choices:
                if c.delta.content:
                    pieces.append(c.delta.content)
                if c.finish_reason:
                    finish = c.finish_reason
        print(f"     chat stream: {len(pieces)} content chunks")
        check("chat stream content", "".join(pieces), t["chat"]["content"])
        check("chat stream finish_reason", finish, t["chat"]["finish_reason"])
        check("chat stream usage", usage, (len(t["chat"]["prompt_ids"]), len(t["chat"]["completion_ids"])))

        r = client.completions.create(model=args.model_name, prompt=t["completion"]["prompt"],
                                      max_tokens=t["max_tokens"], temperature=0)
        check("completion plain text", r.choices[0].text, t["completion"]["text"])
        check("completion plain finish_reason", r.choices[0].finish_reason, t["completion"]["finish_reason"])
        stream = client.completions.create(model=args.model_name, prompt=t["completion"]["prompt"],
                                           max_tokens=t["max_tokens"], temperature=0, stream=True)
        pieces, finish = [], None
        for chunk in stream:
            for c in chunk.choices:
                pieces.append(c.text)
                finish = c.finish_reason or finish
        print(f"     completion stream: {len(pieces)} chunks")
        check("completion stream text", "".join(pieces), t["completion"]["text"])
        check("completion stream finish_reason", finish, t["completion"]["finish_reason"])

        stop = t["completion"]["text"][len(t["completion"]["text"]) // 2:][:3]
        r = client.completions.create(model=args.model_name, prompt=t["completion"]["prompt"],
                                      max_tokens=t["max_tokens"], temperature=0, stop=[stop])
        want = t["completion"]["text"][:t["completion"]["text"].find(stop)]
        check(f"completion stop={stop!r}", (r.choices[0].text, r.choices[0].finish_reason), (want, "stop"))

        try:
            client.chat.completions.create(model=args.model_name, messages=messages, max_tokens=-1)
            check("max_tokens=-1 rejected", "accepted", "BadRequestError")
        except openai.BadRequestError as e:
            check("max_tokens=-1 rejected", (e.status_code, e.body.get("param"), e.body.get("code")),
                  (400, "max_tokens", "invalid_value"))
        try:
            client.chat.completions.create(model=args.model_name, messages=[], max_tokens=4)
            check("empty messages rejected", "accepted", "BadRequestError")
        except openai.BadRequestError as e:
            check("empty messages rejected", (e.status_code, e.body.get("param")), (400, "messages"))

        # logit_bias, as the client sends it ({"token id": bias}): +100 on one id makes the greedy reply
        # that id six times over (tests/test_serve.cpp checks the text against the tokenizer's).
        r = client.completions.create(model=args.model_name, prompt=t["completion"]["prompt"], max_tokens=6,
                                      temperature=0, logit_bias={"100": 100})
        check("logit_bias +100: 6 tokens, another reply", (r.usage.completion_tokens,
                                                           r.choices[0].text != t["completion"]["text"]), (6, True))
        # Parameters moetron would not honour are refused naming them, never ignored.
        for name, kwargs in [("response_format json_object", {"response_format": {"type": "json_object"}}),
                             ("tool_choice required", {"tool_choice": "required"}),
                             ("an unknown parameter", {"extra_body": {"frobnicate": 1}})]:
            want_param = {"response_format json_object": "response_format", "tool_choice required": "tool_choice",
                          "an unknown parameter": "frobnicate"}[name]
            try:
                client.chat.completions.create(model=args.model_name, messages=messages, max_tokens=4, **kwargs)
                check(f"{name} refused", "accepted", "BadRequestError")
            except openai.BadRequestError as e:
                check(f"{name} refused", (e.status_code, e.body.get("param")), (400, want_param))
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=10)
            print(f"server stopped (exit status {proc.returncode})")
    print("ALL PASSED" if not failures else f"{len(failures)} FAILED: {failures}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
