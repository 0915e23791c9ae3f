#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (tests/fuzz/seeds/<target>/): small valid files of each
input kind and near-valid variants (truncated, a field of the wrong type, sizes that do not add up).
Run from the repository root; the output is committed, so this runs only when the seeds change."""
import json
import os
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fuzz", "seeds")


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    header, blob = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + blob


def seeds_safetensors():
    f32 = struct.pack("<4f", 1, 2, 3, 4)
    put("fuzz_safetensors", "valid_f32", safetensors({"w": ("F32", [2, 2], f32)}, {"format": "pt"}))
    put("fuzz_safetensors", "valid_mixed", safetensors({
        "a": ("BF16", [2, 1, 2], f32), "b": ("F16", [4], f32[:8]), "c": ("I64", [1], struct.pack("<q", 7)),
        "d": ("U8", [0, 3], b""), "e": ("BOOL", [], b"\x01")}))
    good = safetensors({"w": ("F32", [4], f32)})
    put("fuzz_safetensors", "truncated", good[:-3])
    put("fuzz_safetensors", "bad_offsets", safetensors({"w": ("F32", [4], f32)}).replace(b"[0, 16]", b"[8, 16]"))
    put("fuzz_safetensors", "shape_overflow", safetensors({"w": ("F32", [2**62, 4], f32)}))
    put("fuzz_safetensors", "header_too_long", struct.pack("<Q", 2**40) + b"{}")


def seeds_index():
    wm = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
          "model.norm.weight": "model-00001-of-00002.safetensors",
          "lm_head.weight": "model-00002-of-00002.safetensors"}
    put("fuzz_model_index", "valid", json.dumps({"metadata": {"total_size": 40}, "weight_map": wm}))
    put("fuzz_model_index", "symlinked", json.dumps({"weight_map": {"linked.weight": "linked.safetensors"}}))
    put("fuzz_model_index", "escape", json.dumps({"weight_map": {"secret": "../outside.safetensors"}}))
    put("fuzz_model_index", "absolute", json.dumps({"weight_map": {"secret": "/etc/passwd"}}))
    put("fuzz_model_index", "wrong_file", json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    put("fuzz_model_index", "not_object", json.dumps({"weight_map": ["a"]}))


def seeds_hf_config():
    for d in sorted(os.listdir(os.path.join(ROOT, "tests", "golden"))):
        p = os.path.join(ROOT, "tests", "golden", d, "config.json")
        if os.path.exists(p):
            put("fuzz_hf_config", d, open(p, "rb").read())
    for m in sorted(os.listdir(os.path.join(ROOT, "configs", "models"))):
        p = os.path.join(ROOT, "configs", "models", m, "config.json")
        if os.path.exists(p):
            put("fuzz_hf_config", "models_" + m, open(p, "rb").read())
    base = json.load(open(os.path.join(ROOT, "tests", "golden", "mixtral_gqa", "config.json")))
    for field, value in [("hidden_size", 10**9), ("num_local_experts", 10**6), ("num_attention_heads", 2**24),
                         ("vocab_size", "32000"), ("rope_theta", -1), ("num_experts_per_tok", 99)]:
        c = dict(base)
        c[field] = value
        put("fuzz_hf_config", "bad_" + field, json.dumps(c))


def seeds_train_config():
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        p = os.path.join(ROOT, "configs", name)
        if name.endswith(".yaml"):
            text = open(p).read()
            put("fuzz_train_config", name, text)
            put("fuzz_train_config", name + ".overrides",
                text + "\n#overrides\ntrain.max_steps=3\nparallel.tp=2\noptim.lr=1e-4\n")
    put("fuzz_train_config", "alias", "model:\n  config: &a {x: [1, 2]}\ndata: {path: *a}\n")
    put("fuzz_train_config", "bad_types", "train:\n  max_steps: ten\n  epochs: 1e300\n")


def seeds_jsonl():
    lines = open(os.path.join(ROOT, "tests", "data", "chat_cases.jsonl"), "rb").read().splitlines()
    for i, line in enumerate(lines[:12]):
        put("fuzz_jsonl_record", f"chat_{i:02d}", bytes([1]) + line)
    for i, line in enumerate(open(os.path.join(ROOT, "tests", "data", "chat_error_cases.jsonl"), "rb").read().splitlines()):
        put("fuzz_jsonl_record", f"chat_error_{i:02d}", bytes([0]) + line)
    put("fuzz_jsonl_record", "prompt_completion", bytes([2]) + json.dumps({"prompt": "2+2?", "completion": " 4"}).encode())
    put("fuzz_jsonl_record", "text", bytes([3]) + json.dumps({"text": "Hello world \u00e9\u4e2d"}).encode())
    put("fuzz_jsonl_record", "system", bytes([0]) + json.dumps({"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}]}).encode())
    put("fuzz_jsonl_record", "bad_utf8", bytes([3]) + b'{"text": "\xff\xfe"}')


def mmidx(sizes, docs, dtype=4):
    itemsize = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}[dtype]
    ptrs, p = [], 0
    for s in sizes:
        ptrs.append(p)
        p += s * itemsize
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QB", 1, dtype) + struct.pack("<QQ", len(sizes), len(docs))
    idx += struct.pack(f"<{len(sizes)}i", *sizes) + struct.pack(f"<{len(ptrs)}q", *ptrs)
    idx += struct.pack(f"<{len(docs)}q", *docs)
    return idx, b"\x01" * p


def seeds_indexed():
    for name, (sizes, docs, dtype) in {"valid_i32": ([3, 1, 4], [0, 2, 3], 4), "valid_u16": ([2, 5], [0, 2], 8),
                                       "empty": ([], [0], 4), "valid_i64": ([1, 2], [0, 1, 2], 5)}.items():
        idx, b = mmidx(sizes, docs, dtype)
        put("fuzz_indexed_dataset", name, struct.pack("<I", len(idx)) + idx + b)
    idx, b = mmidx([3, 1], [0, 2], 4)
    put("fuzz_indexed_dataset", "short_bin", struct.pack("<I", len(idx)) + idx + b[:-2])
    put("fuzz_indexed_dataset", "bad_pointer", struct.pack("<I", len(idx)) + idx[:-16 - 8] + struct.pack("<q", 99) + idx[-16:] + b)


def seeds_checkpoint():
    st = safetensors({"model.norm.weight": ("F32", [4], struct.pack("<4f", 1, 2, 3, 4))})
    state = {"format": "moetron-checkpoint", "format_version": 1, "step": 2, "consumed_samples": 16,
             "optimizer_steps": 2, "loader_state": {"epoch": 0, "position": 16},
             "files": {"model.safetensors": {"size": len(st), "xxh64": "0000000000000000"},
                       "config.json": {"size": 3, "xxh64": "0000000000000000"}},
             "trainer_state_xxh64": "0000000000000000"}
    put("fuzz_checkpoint", "valid_unsealed", "step-000002\n" + json.dumps(state))
    for k, v in [("step", -5), ("optimizer_steps", "many"), ("files", {}), ("loader_state", None)]:
        s = dict(state)
        s[k] = v
        put("fuzz_checkpoint", "field_" + k, "step-000002\n" + json.dumps(s))
    s = dict(state)
    s["files"] = {"../outside.txt": {"size": 22, "xxh64": "0"}}
    put("fuzz_checkpoint", "escape", "step-000002\n" + json.dumps(s))
    put("fuzz_checkpoint", "latest_escape", "../../etc\n" + json.dumps(state))


def seeds_openai():
    chat = {"model": "m", "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "Hi"}],
            "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n", "END"],
            "stream": True, "stream_options": {"include_usage": True}}
    put("fuzz_openai_request", "chat", b"\x00" + json.dumps(chat).encode())
    put("fuzz_openai_request", "chat_parts", b"\x00" + json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}).encode())
    put("fuzz_openai_request", "completion", b"\x01" + json.dumps({"prompt": "Once", "max_tokens": 4, "stop": "x"}).encode())
    put("fuzz_openai_request", "bad_max_tokens", b"\x00" + json.dumps({"messages": [], "max_tokens": -1}).encode())
    put("fuzz_openai_request", "bad_temperature", b"\x01" + json.dumps({"prompt": "a", "temperature": 1e-45}).encode())


def seeds_tokenizer():
    model = open(os.path.join(ROOT, "tests", "golden", "generate", "mixtral_gqa", "tokenizer.model"), "rb").read()
    for i, text in enumerate(["Hello world", " [INST] What? [/INST] \u00e9\u4e2d\U0001F600", "", "a\x00b\ttab"]):
        t = text.encode()
        put("fuzz_tokenizer", f"tiny_{i}", struct.pack("<H", len(t)) + t + model)
    put("fuzz_tokenizer", "truncated", struct.pack("<H", 5) + b"Hello" + model[: len(model) // 2])


def byte_level_chars():
    """GPT-2's bytes_to_unicode: the character standing for each byte."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def seeds_tokenizer_json():
    """Small tokenizer.json files: both split patterns, NFC, merges in both spellings, added tokens
    with each flag, plus the committed tiny vocabulary and near-valid variants."""
    ch = byte_level_chars()
    vocab = {ch[b]: b for b in range(256)}
    merges = []
    for a, b in [("h", "e"), ("l", "l"), ("he", "ll"), (" ", "w"), ("o", "r"), ("\u00c3", "\u00a9")]:
        ea, eb = "".join(ch[x] for x in a.encode("latin-1")), "".join(ch[x] for x in b.encode("latin-1"))
        vocab.setdefault(ea + eb, len(vocab))
        merges.append(f"{ea} {eb}")
    qwen = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    n = len(vocab)
    added = [{"id": n, "content": "<|im_start|>", "special": True, "normalized": False},
             {"id": n + 1, "content": "<|im_end|>", "special": True, "normalized": False},
             {"id": n + 2, "content": "<x>", "lstrip": True, "rstrip": True, "special": False, "normalized": True},
             {"id": n + 3, "content": "w", "single_word": True, "special": False, "normalized": False}]
    qwen_style = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                  "normalizer": {"type": "NFC"},
                  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                      {"type": "Split", "pattern": {"Regex": qwen}, "behavior": "Isolated",
                       "invert": False},
                      {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
                  "post_processor": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"},
                  "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": False,
                            "ignore_merges": True, "vocab": vocab, "merges": merges}}
    gpt2_style = json.loads(json.dumps(qwen_style))
    gpt2_style["normalizer"] = None
    gpt2_style["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    gpt2_style["model"]["merges"] = [m.split(" ") for m in merges]
    gpt2_style["model"]["ignore_merges"] = False
    texts = ["hello world", "<|im_start|>user\nhe'S <x> w ww\r\n\t\u00e9e\u0301 123 \U0001F600<|im_end|>",
             "  \n\n  x  ", "\xff\xfe"]
    for name, doc in (("qwen", qwen_style), ("gpt2", gpt2_style)):
        body = json.dumps(doc).encode()
        for i, t in enumerate(texts):
            tb = t.encode("utf-8", "surrogateescape") if not t.startswith("\xff") else b"\xff\xfe"
            put("fuzz_tokenizer_json", f"{name}_{i}", struct.pack("<H", len(tb)) + tb + body)
        put("fuzz_tokenizer_json", f"{name}_truncated", struct.pack("<H", 5) + b"hello" + body[: len(body) // 2])
    bad = json.loads(json.dumps(qwen_style))
    bad["model"]["merges"].append("zz q")
    put("fuzz_tokenizer_json", "bad_merge", struct.pack("<H", 2) + b"hi" + json.dumps(bad).encode())
    bad = json.loads(json.dumps(qwen_style))
    bad["pre_tokenizer"]["pretokenizers"][1]["type"] = "Metaspace"
    put("fuzz_tokenizer_json", "metaspace", struct.pack("<H", 2) + b"hi" + json.dumps(bad).encode())
    tiny = open(os.path.join(ROOT, "tests", "data", "tiny-bytelevel-tokenizer.json"), "rb").read()
    put("fuzz_tokenizer_json", "tiny", struct.pack("<H", 11) + b"hello <|im_" + tiny)


def seeds_peft_adapter():
    src = os.path.join(ROOT, "tests", "golden", "lora", "mixtral", "adapter_init", "adapter_config.json")
    cfg = json.load(open(src))
    put("fuzz_peft_adapter", "golden", json.dumps(cfg, indent=2))
    for name, edit in [("rank8", {"r": 8}), ("dora", {"use_dora": True}), ("regex", {"target_modules": ".*proj"}),
                       ("attention_only", {"target_parameters": None}), ("rslora", {"use_rslora": True}),
                       ("rank_pattern", {"rank_pattern": {"q_proj": 2}}), ("no_type", {"peft_type": None})]:
        put("fuzz_peft_adapter", name, json.dumps(dict(cfg, **edit)))
    put("fuzz_peft_adapter", "with_weights", json.dumps(cfg).encode() + b"\n@@SAFETENSORS@@\n" +
        safetensors({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ("F32", [1, 1], b"\0" * 4)}))


def seeds_http():
    body = b'{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4}'
    h = "Host: x\r\n".encode()
    seeds = {  # the first byte: the size of the pieces the target feeds (minus one)
        "get_health": b"\x07GET /health HTTP/1.1\r\n" + h + b"\r\n",
        "post_cl": b"\x10POST /v1/chat/completions HTTP/1.1\r\n" + h + b"Content-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body,
        "post_chunked": b"\x03POST /v1/completions HTTP/1.1\r\n" + h + b"Transfer-Encoding: chunked\r\n\r\n"
                        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\n",
        "pipelined": b"\x20GET /v1/models HTTP/1.1\r\n" + h + b"\r\nGET /v1/models/moetron%20x?q=1 HTTP/1.1\r\n" + h +
                     b"Connection: close\r\n\r\n",
        "http10": b"\x01GET / HTTP/1.0\r\n\r\n",
        "expect": b"\x05POST /v1/completions HTTP/1.1\r\n" + h + b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n{}",
        "cl_te": b"\x09POST / HTTP/1.1\r\n" + h + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "huge_chunk": b"\x02POST / HTTP/1.1\r\n" + h + b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n",
        "leading_crlf": b"\x01\r\n\r\nGET /health HTTP/1.1\r\n" + h + b"\r\n",
    }
    for name, data in seeds.items():
        put("fuzz_http_request", name, data)


def gguf(kvs, tensors, alignment=32):
    """A GGUF v3 file: kvs [(key, type, payload bytes)], tensors [(name, ne, type, data bytes)]."""
    st = lambda x: struct.pack("<Q", len(x)) + x.encode()
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for k, t, v in kvs:
        out += st(k) + struct.pack("<I", t) + v
    off, datas = 0, b""
    for name, ne, t, data in tensors:
        out += st(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) + struct.pack("<IQ", t, off)
        pad = (-len(data)) % alignment
        datas += data + b"\0" * pad
        off += len(data) + pad
    out += b"\0" * ((-len(out)) % alignment)
    return out + datas


def seeds_gguf():
    st = lambda x: struct.pack("<Q", len(x)) + x.encode()
    kvs = [("general.architecture", 8, st("llama")), ("llama.block_count", 4, struct.pack("<I", 1)),
           ("llama.rope.freq_base", 6, struct.pack("<f", 10000.0)),
           ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + st("<s>") + st("a"))]
    f32 = struct.pack("<4f", 1, 2, 3, 4)
    bf16 = struct.pack("<4H", 0x3F80, 0x4000, 0x4040, 0x4080)
    put("fuzz_gguf", "valid", gguf(kvs, [("w", [2, 2], 0, f32), ("b", [4], 30, bf16), ("h", [2], 1, struct.pack("<2H", 0x3C00, 0x4000))]))
    put("fuzz_gguf", "truncated", gguf(kvs, [("w", [2, 2], 0, f32)])[:-5])
    put("fuzz_gguf", "huge_dims", gguf(kvs, [("w", [2**40, 2**30], 0, f32)]))
    put("fuzz_gguf", "unknown_type", gguf(kvs, [("w", [4], 77, f32)]))
    put("fuzz_gguf", "bad_alignment", gguf(kvs + [("general.alignment", 4, struct.pack("<I", 24))], [("w", [4], 0, f32)]))
    put("fuzz_gguf", "huge_string", b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**62) + b"k")


def seeds_jinja():
    """Chat-template snippets (our own, not the real templates): the first line is the JSON context,
    the rest the template.  Loops, macros, filters, namespaces, whitespace control, strings, the
    transformers globals, and near-valid or runaway variants."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \u00e9\u4e2d"},
            {"role": "assistant", "content": "Hello", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "42"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "d",
                                               "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
    ctx = json.dumps({"messages": msgs, "tools": tools, "add_generation_prompt": True, "bos_token": "<s>",
                      "eos_token": "</s>"}, ensure_ascii=False)
    seeds = {
        "loops": "{% for m in messages if m.role != 'tool' %}{{ loop.index }}/{{ loop.length }} {{ m.role }}"
                 "{% if loop.first %}!{% endif %}{% if not loop.last %}, {% endif %}{{ loop.cycle('a', 'b') }}"
                 "{% if m.role == 'assistant' %}{% break %}{% endif %}{% else %}none{% endfor %}",
        "macros": "{% macro say(who, what='hi', sep=': ') %}{{ who }}{{ sep }}{{ what }}{{ caller() if caller }}"
                  "{% endmacro %}{% macro fact(n) %}{{ 1 if n <= 1 else n * fact(n - 1) | int }}{% endmacro %}"
                  "{{ say('a') }} {{ say('b', sep='=') }} {% call say('c') %}[body]{% endcall %} {{ fact(5) }}",
        "filters": "{{ tools | tojson(indent=2) }}\n{{ messages | map(attribute='role') | join(',') }} "
                   "{{ messages | selectattr('role', 'equalto', 'user') | list | length }} "
                   "{{ {'b': 1, 'a': 2} | dictsort }} {{ ['x', 'X', 'y'] | unique | list }} {{ none | default('d', true) }} "
                   "{{ '  t  ' | trim }} {{ '42' | int + '1.5' | float }} {{ 'a\nb' | indent(2, true) }} {{ 'ab' | title }}",
        "namespace": "{% set ns = namespace(last=-1, text='') %}{% for m in messages %}{% if m.role == 'user' %}"
                     "{% set ns.last = loop.index0 %}{% endif %}{% set ns.text = ns.text ~ m.role[0] %}{% endfor %}"
                     "{{ ns.last }} {{ ns.text }}{% set x %}captured {{ ns.text | upper }}{% endset %} {{ x }}",
        "whitespace": "  {%- if true -%}  a  {%- endif %}\n  {% for i in range(2) %}\n    {{ i }}\n  {% endfor %}\n"
                      "{#- comment -#}  {%+ if true %}b{% endif +%}\r\n{% raw %}{{ raw }}{% endraw %}\n",
        "strings": "{% set s = messages[1].content %}{{ s[::-1] }} {{ s[1:3] }} {{ s | length }} {{ s.split() }} "
                   "{{ 'a,b,c'.rsplit(',', 1) }} {{ s.startswith(('Hi', 'x')) }} {{ '{} {}'.format(1, 'x') }} "
                   "{{ s.find('\u4e2d') }} {{ 'xaxx'.strip('x') }} {{ '%s-%d' % ('a', 3) }} {{ [1, 'a', none, 1.5e-5] }}",
        "globals": "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                   "{{ eos_token }}{% endgeneration %}{% elif m.role not in ['system', 'user', 'tool'] %}"
                   "{{ raise_exception('bad role ' ~ m.role) }}{% else %}[{{ m.content }}]{% endif %}{% endfor %}"
                   "{{ strftime_now('%d %b %Y') }} {{ dict(a=1, b=[2]) }}",
        "tools": "{% for t in tools %}{% for k, v in t.function.items() %}{{ k }}={{ v | tojson }};{% endfor %}"
                 "{{ t.function.parameters.properties.keys() | list }}{{ t.function.get('missing', 'dflt') }}{% endfor %}"
                 "{% for m in messages %}{% if m.tool_calls is defined %}{{ m.tool_calls[0].function.arguments | tojson(sort_keys=true) }}"
                 "{% endif %}{% endfor %}{{ {512: 'k'}[512] }}{{ ('<b>' | safe) + '<i>' }}",
        "errors": "{% if messages %}{{ messages[0].content | nosuchfilter }}{% endif %}\n{% for x in y %}{{ x",
        "runaway": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                   "{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}{{ range(10**9) | length }}"
                   "{{ ((((((((((1)))))))))) }}",
        "no_context": "{{ messages | length }}{{ undefined_thing is defined }}{{ 7 // 2 }} {{ 2 ** 10 }} {{ 1 < 2 < 3 }}",
    }
    for name, tmpl in seeds.items():
        first = "not json" if name == "no_context" else ctx
        put("fuzz_jinja", name, first + "\n" + tmpl)


if __name__ == "__main__":
    for f in [seeds_safetensors, seeds_index, seeds_hf_config, seeds_train_config, seeds_jsonl, seeds_indexed,
              seeds_checkpoint, seeds_openai, seeds_tokenizer, seeds_tokenizer_json, seeds_peft_adapter, seeds_http,
              seeds_gguf, seeds_jinja]:
        f()
    print("seeds written under", OUT, file=sys.stderr)
