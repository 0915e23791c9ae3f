#!/usr/bin/env python3
"""Regenerate the chat-template reference renders in tests/data/chat_templates/refs/.

Usage (from the repository root):

    python3 tools/chat_template_refs.py --templates ../shared/data/templates \
        --out tests/data/chat_templates/refs
    python3 tools/chat_template_refs.py --check     # compare with a real tokenizer's apply_chat_template

Needs transformers (5.x), jinja2 (>= 3.1.6) and tokenizers; no network. The template files are read in place
and never copied into the repository.

What is rendered
----------------
For every `*.jinja` file under --templates (sorted by name), every conversation of --conversations (file order)
and add_generation_prompt in (false, true), the text `tokenizer.apply_chat_template(messages, tools=tools,
add_generation_prompt=agp, tokenize=False, **chat_template_kwargs)` returns, reproduced without a tokenizer:

  1. `_normalize_chat_messages(messages)`: message objects become dicts and every message key whose value is None is
     dropped (so `"content": null` on an assistant tool-call message is *absent* in the template, not none).
  2. template variables = `{**tokenizer.special_tokens_map, **chat_template_kwargs}` (kwargs win on a clash).
     In transformers 5.x `special_tokens_map` holds only the named tokens that are set, among bos_token, eos_token,
     unk_token, sep_token, pad_token, cls_token, mask_token, each converted with str() (plain strings, never
     AddedToken objects). We mirror a tokenizer built with bos_token="<s>", eos_token="</s>", unk_token="<unk>",
     pad_token="<pad>", i.e. exactly these four string variables; sep/cls/mask_token are undefined.
     additional/extra special tokens are not passed.
  3. `render_jinja_template(conversations=[messages], tools=tools or None, documents=None, chat_template=text,
     add_generation_prompt=agp, continue_final_message=False, **variables)`; this builds the sandboxed environment
     (trim_blocks, lstrip_blocks, loopcontrols, `{% generation %}`), the `tojson` override
     (json.dumps, ensure_ascii=False, default separators), the globals raise_exception/strftime_now/dict/namespace,
     converts inputs to plain JSON data and aliases reasoning fields (`thinking`/`reasoning_content`, see
     `_alias_reasoning_fields`).

Templates whose text contains `{% generation %}` are rendered with return_assistant_tokens_mask=True (which
`apply_chat_template` only allows with tokenize=True, so we call render_jinja_template directly; the text is the
same) and the generation spans are recorded, converted from Python str (code point) offsets to UTF-8 byte offsets.

Clock: `strftime_now` calls `datetime.now()` of transformers.utils.chat_template_utils; we replace that module's
`datetime` by a subclass whose now() returns the naive datetime 2026-12-07 12:00:00, so every render is
deterministic (e.g. `strftime_now("%d %b %Y")` == "07 Dec 2026").

Output
------
refs/<template stem>.jsonl, one line per (conversation, add_generation_prompt), in conversation order with false
before true:
    {"conversation": name, "add_generation_prompt": bool, "text": "..."[, "generation": [[start, end], ...]]}
or, when transformers raises:
    {"conversation": name, "add_generation_prompt": bool, "error": str(exc), "error_type": type(exc).__name__}
JSON written with ensure_ascii=False, UTF-8, "\\n" line ends. refs/MANIFEST.json records the versions, the frozen
date, the special tokens and, per template, the sha256 of the template text, the number of renders and of errors.
The output is deterministic: running the script twice gives identical files.
"""

import argparse
import copy
import datetime as _dt
import hashlib
import json
import os
import re
import sys
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FROZEN_NOW = _dt.datetime(2026, 12, 7, 12, 0, 0)
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
GENERATION_RE = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # the test render_jinja_template itself uses
CHECK_TEMPLATES = [
    "Qwen-Qwen3-0.6B.jinja",
    "openai-gpt-oss-120b.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "poolside-Laguna-XS.2.jinja",
]


class _FrozenDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        if tz is not None:
            return FROZEN_NOW.replace(tzinfo=tz)
        return FROZEN_NOW

    @classmethod
    def today(cls):
        return FROZEN_NOW

    @classmethod
    def utcnow(cls):
        return FROZEN_NOW


def _import_transformers():
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import jinja2
    import transformers
    from transformers.utils import chat_template_utils as ctu

    ctu.datetime = _FrozenDatetime  # strftime_now reads this module global at call time
    return transformers, jinja2, ctu


def _load_conversations(path):
    convs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                convs.append(json.loads(line))
    names = [c["name"] for c in convs]
    if len(set(names)) != len(names):
        raise SystemExit(f"duplicate conversation names in {path}")
    return convs


def _template_files(templates_dir):
    files = sorted(f for f in os.listdir(templates_dir) if f.endswith(".jinja"))
    if not files:
        raise SystemExit(f"no *.jinja files in {templates_dir}")
    return files


def _byte_offsets(text, spans):
    """Python str (code point) offsets -> UTF-8 byte offsets."""
    out = []
    for start, end in spans:
        b0 = len(text[:start].encode("utf-8"))
        b1 = b0 + len(text[start:end].encode("utf-8"))
        out.append([b0, b1])
    return out


def render_one(ctu, template, conv, add_generation_prompt, want_generation):
    """Render like apply_chat_template(tokenize=False); returns (text, spans_or_None)."""
    messages = ctu._normalize_chat_messages(copy.deepcopy(conv["messages"]))
    tools = copy.deepcopy(conv.get("tools"))
    kwargs = copy.deepcopy(conv.get("chat_template_kwargs", {}))
    template_kwargs = {**SPECIAL_TOKENS, **kwargs}
    rendered, indices = ctu.render_jinja_template(
        conversations=[messages],
        tools=tools,
        documents=None,
        chat_template=template,
        return_assistant_tokens_mask=want_generation,
        continue_final_message=False,
        add_generation_prompt=add_generation_prompt,
        **template_kwargs,
    )
    text = rendered[0]
    spans = [list(s) for s in indices[0]] if want_generation else None
    return text, spans


def record_for(ctu, template, conv, agp, want_generation):
    rec = {"conversation": conv["name"], "add_generation_prompt": agp}
    try:
        text, spans = render_one(ctu, template, conv, agp, want_generation)
    except Exception as exc:  # noqa: BLE001 - every failure is reference data
        rec["error"] = str(exc)
        rec["error_type"] = type(exc).__name__
        return rec
    rec["text"] = text
    if want_generation:
        rec["generation"] = _byte_offsets(text, spans)
    return rec


def generate(args):
    transformers, jinja2, ctu = _import_transformers()
    convs = _load_conversations(args.conversations)
    files = _template_files(args.templates)
    os.makedirs(args.out, exist_ok=True)
    manifest_templates = {}
    for fname in files:
        with open(os.path.join(args.templates, fname), encoding="utf-8") as f:
            template = f.read()
        want_generation = bool(GENERATION_RE.search(template))
        stem = fname[: -len(".jinja")]
        lines = []
        errors = 0
        for conv in convs:
            for agp in (False, True):
                rec = record_for(ctu, template, conv, agp, want_generation)
                errors += "error" in rec
                lines.append(json.dumps(rec, ensure_ascii=False))
        with open(os.path.join(args.out, stem + ".jsonl"), "w", encoding="utf-8", newline="\n") as f:
            f.write("\n".join(lines) + "\n")
        manifest_templates[stem] = {
            "file": fname,
            "sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
            "renders": len(lines),
            "errors": errors,
            "generation": want_generation,
        }
        print(f"{stem}: {len(lines)} renders, {errors} errors{' (generation spans)' if want_generation else ''}")
    manifest = {
        "generator": "tools/chat_template_refs.py",
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "frozen_now": FROZEN_NOW.isoformat(sep=" "),
        "special_tokens": SPECIAL_TOKENS,
        "conversations": [c["name"] for c in convs],
        "add_generation_prompt": [False, True],
        "generation_offsets": "UTF-8 byte offsets [start, end) into text",
        "templates": manifest_templates,
    }
    with open(os.path.join(args.out, "MANIFEST.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(manifest, ensure_ascii=False, indent=1) + "\n")
    total = sum(t["renders"] for t in manifest_templates.values())
    errs = sum(t["errors"] for t in manifest_templates.values())
    print(f"{len(files)} templates, {total} renders, {errs} errors -> {args.out}")
    return 0


def check(args):
    """Compare render_one with a real PreTrainedTokenizerFast.apply_chat_template(tokenize=False)."""
    transformers, jinja2, ctu = _import_transformers()
    from transformers import PreTrainedTokenizerFast

    convs = _load_conversations(args.conversations)
    tok = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer, **SPECIAL_TOKENS)
    if tok.special_tokens_map != SPECIAL_TOKENS:
        print(f"special_tokens_map differs: {tok.special_tokens_map!r} vs {SPECIAL_TOKENS!r}")
        return 1
    names = args.check_templates or CHECK_TEMPLATES
    bad = 0
    n = 0
    for fname in names:
        with open(os.path.join(args.templates, fname), encoding="utf-8") as f:
            template = f.read()
        tok.chat_template = template
        want_generation = bool(GENERATION_RE.search(template))
        for conv in convs:
            for agp in (False, True):
                n += 1
                try:
                    ref = tok.apply_chat_template(
                        copy.deepcopy(conv["messages"]),
                        tools=copy.deepcopy(conv.get("tools")),
                        add_generation_prompt=agp,
                        tokenize=False,
                        **copy.deepcopy(conv.get("chat_template_kwargs", {})),
                    )
                    ref = ("text", ref)
                except Exception as exc:  # noqa: BLE001
                    ref = ("error", type(exc).__name__, str(exc))
                for gen in sorted({False, want_generation}):
                    try:
                        mine = ("text", render_one(ctu, template, conv, agp, gen)[0])
                    except Exception as exc:  # noqa: BLE001
                        mine = ("error", type(exc).__name__, str(exc))
                    if mine != ref:
                        bad += 1
                        print(f"MISMATCH {fname} {conv['name']} agp={agp} generation={gen}:\n  ref={ref!r}\n  mine={mine!r}")
                if want_generation and ref[0] == "text":
                    # the token mask through the tokenizer must cover the same characters as our spans
                    out = tok.apply_chat_template(
                        copy.deepcopy(conv["messages"]), tools=copy.deepcopy(conv.get("tools")),
                        add_generation_prompt=agp, tokenize=True, return_dict=True,
                        return_assistant_tokens_mask=True, **copy.deepcopy(conv.get("chat_template_kwargs", {})),
                    )
                    text, spans = render_one(ctu, template, conv, agp, True)
                    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
                    expect = [int(any(e > s0 and s < s1 for s0, s1 in spans)) for s, e in enc["offset_mapping"]]
                    if list(out["assistant_masks"]) != expect:
                        bad += 1
                        print(f"MASK MISMATCH {fname} {conv['name']} agp={agp}")
    print(f"check: {n} apply_chat_template renders compared over {len(names)} templates, {bad} mismatches")
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--templates", default=os.path.join(REPO_ROOT, "..", "shared", "data", "templates"))
    p.add_argument("--out", default=os.path.join(REPO_ROOT, "tests", "data", "chat_templates", "refs"))
    p.add_argument("--conversations",
                   default=os.path.join(REPO_ROOT, "tests", "data", "chat_templates", "conversations.jsonl"))
    p.add_argument("--check", action="store_true",
                   help="compare with PreTrainedTokenizerFast.apply_chat_template instead of writing refs")
    p.add_argument("--check-templates", nargs="*", help=f"template file names for --check (default {CHECK_TEMPLATES})")
    p.add_argument("--tokenizer", default=os.path.join(REPO_ROOT, "..", "shared", "data", "qwen-tokenizer.json"))
    args = p.parse_args()
    warnings.simplefilter("ignore")
    return check(args) if args.check else generate(args)


if __name__ == "__main__":
    sys.exit(main())
