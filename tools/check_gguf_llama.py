#!/usr/bin/env python3
"""moetron's GGUF export run in llama.cpp: greedy tokens of llama.cpp beside `moetron generate`'s.

    LLAMA_CPP_DIR=/path/to/llama.cpp python3 tools/check_gguf_llama.py [--moetron build/moetron]
    python3 tools/check_gguf_llama.py --llama-dir /path/to/llama.cpp [--llama-build DIR]

For each case: `moetron export gguf` writes the model, tools/gguf_llama_greedy.cpp (compiled here
against the llama.cpp tree's include/ and its built libllama, LLAMA_DIR/build/bin by default) decodes
the prompt ids greedily in llama.cpp, `moetron generate --prompt-ids` does the same in moetron, and
the two token lists are printed with PASS (equal) or FAIL. Exit 1 when any case fails.
A reference tool: llama.cpp is never a build or test dependency of moetron. Python standard library
only; the derived models (a layer dropped, a config field changed) are written by hand below.

The cases use the committed generation goldens (tests/golden/generate, prompts from expected.json):
- mixtral_gqa (SentencePiece) in bf16 and f16: its sliding_window is 16, which llama.cpp's llama
  graph does not apply, so it is exported with --sliding-window-as-context and run for 5 new tokens
  (11 prompt + 5 = 16 positions); and a copy with the window removed (another model, computed
  without a window on both sides) for 32 tokens. Five tokens are a weak test: with the q/k
  permutation left out they still agreed, the 32-token runs did not (tried once by hand).
- qwen3_moe (byte-level BPE): the golden has a dense layer (mlp_only_layers [1]) and
  norm_topk_prob false, which llama.cpp's qwen3moe graph cannot compute (the export refuses it;
  shown); the case drops layer 1 and sets norm_topk_prob true, in bf16 and f32, 32 tokens.
- llama_dense and olmoe (clip_qkv removed: llama.cpp does not clamp) with a small generated
  byte-level tokenizer (the goldens ship none), 32 tokens.
- q8_0: mixtral_gqa without its window, and the trained model of tests/golden/perplexity, 32 tokens,
  moetron with --quantize q8_0 (the same int8 weights as the exported file).
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "generate")


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", None)
    tensors = {}
    for name, h in header.items():
        b, e = h["data_offsets"]
        tensors[name] = (h["dtype"], h["shape"], data[b:e])
    return meta, tensors


def write_safetensors(path, meta, tensors):
    header, blobs, at = {}, [], 0
    if meta:
        header["__metadata__"] = meta
    for name in sorted(tensors):
        dtype, shape, blob = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def derive(src, dst, edit, keep=None):
    """A copy of model `src` in `dst`: config.json edited by `edit`, only decoder layers `keep`
    (renumbered from 0), tensors byte for byte, tokenizer files copied."""
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if keep is not None:
        cfg["num_hidden_layers"] = len(keep)
    edit(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    meta, tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if keep is not None and name.startswith("model.layers."):
            layer = int(parts[2])
            if layer not in keep:
                continue
            parts[2] = str(keep.index(layer))
        out[".".join(parts)] = t
    write_safetensors(os.path.join(dst, "model.safetensors"), meta, out)
    for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))


def small_tokenizer(dst):
    """A byte-level BPE tokenizer.json of 66 ids (3 special tokens, letters, digits, "Ġ"), for
    models that ship no tokenizer: only the vocabulary's presence matters to the check."""
    vocab, i = {}, 3
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789":
        vocab[c] = i
        i += 1
    vocab["\u0120"] = i
    # The special tokens are vocabulary pieces too, at the ids they declare (Hugging Face tokenizers
    # gives added tokens that are not pieces the ids after the vocabulary's: moetron refuses a file
    # whose declared ids disagree).
    for k, c in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]):
        vocab[c] = k
    added = [{"id": k, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for k, c in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])]
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
           "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
           "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": False, "vocab": vocab, "merges": []}}
    path = os.path.join(dst, "tokenizer.json")
    with open(path, "w") as f:
        json.dump(tok, f)
    return path


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, p.stdout.strip(), p.stderr.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-dir", default=os.environ.get("LLAMA_CPP_DIR"),
                    help="the llama.cpp source tree (default: $LLAMA_CPP_DIR)")
    ap.add_argument("--llama-build", default=None, help="its build directory (default: LLAMA_DIR/build)")
    ap.add_argument("--moetron", default=os.environ.get("MOETRON", os.path.join(ROOT, "build", "moetron")))
    args = ap.parse_args()
    if not args.llama_dir:
        sys.exit("give the llama.cpp directory: --llama-dir DIR or LLAMA_CPP_DIR=DIR")
    llama = os.path.abspath(args.llama_dir)
    build = os.path.abspath(args.llama_build or os.path.join(llama, "build"))
    libdir = os.path.join(build, "bin")
    for need in (os.path.join(llama, "include", "llama.h"), os.path.join(libdir, "libllama.so"), args.moetron):
        if not os.path.exists(need):
            sys.exit(f"missing {need}")

    work = tempfile.mkdtemp(prefix="moetron-gguf-check-")
    try:
        greedy = os.path.join(work, "gguf_llama_greedy")
        rc, _, err = run(["g++", "-O2", "-std=c++17", "-I" + os.path.join(llama, "include"),
                          "-I" + os.path.join(llama, "ggml", "include"),
                          os.path.join(ROOT, "tools", "gguf_llama_greedy.cpp"), "-L" + libdir, "-lllama",
                          "-lggml", "-lggml-base", "-Wl,-rpath," + libdir, "-o", greedy])
        if rc != 0:
            sys.exit("building tools/gguf_llama_greedy.cpp against llama.cpp failed:\n" + err)
        rc, head, _ = run(["git", "-C", llama, "rev-parse", "--short", "HEAD"])
        print(f"llama.cpp: {llama}" + (f" ({head})" if rc == 0 and head else ""))
        print(f"moetron:   {args.moetron}\n")

        with open(os.path.join(GOLDEN, "expected.json")) as f:
            golden = {c["model"]: c for c in json.load(f)["cases"]}

        m_nowin = os.path.join(work, "mixtral_gqa_no_window")
        derive(os.path.join(GOLDEN, "mixtral_gqa"), m_nowin, lambda c: c.update(sliding_window=None))
        q3 = os.path.join(work, "qwen3_moe_all_moe")
        derive(os.path.join(GOLDEN, "qwen3_moe"), q3, lambda c: c.update(mlp_only_layers=[], norm_topk_prob=True),
               keep=[0, 2])
        olmoe = os.path.join(work, "olmoe_no_clip")
        derive(os.path.join(GOLDEN, "olmoe"), olmoe, lambda c: c.update(clip_qkv=None))
        # GLM-4.5 (glm4moe): llama.cpp's graph searches every expert, so the golden's two groups (one
        # searched) become one; everything else as committed (sigmoid router with the selection bias,
        # shared expert, a leading dense layer, partial RoPE, q/k norms and biases).
        glm = os.path.join(work, "glm4_moe_one_group")
        derive(os.path.join(GOLDEN, "glm4_moe"), glm, lambda c: c.update(n_group=1, topk_group=1))
        tok = small_tokenizer(work)

        mixtral = os.path.join(GOLDEN, "mixtral_gqa")
        swa = ["--sliding-window-as-context"]
        window = "sliding_window 16: 11 prompt + 5 new tokens = 16 positions, within the window"
        own_tok = "a generated small byte-level tokenizer.json (the golden ships none)"
        # (label, --type, model dir, golden case of the prompt, new tokens, export flags, note, whether
        # the model is the golden as committed, so transformers' tokens are printed beside)
        cases = [
            ("mixtral_gqa", "bf16", mixtral, "mixtral_gqa", 5, swa, window, True),
            ("mixtral_gqa", "f16", mixtral, "mixtral_gqa", 5, swa, window, True),
            ("mixtral_gqa, sliding_window removed", "bf16", m_nowin, "mixtral_gqa", 32, [],
             "another model than the golden: no window on either side", False),
            ("qwen3_moe, layer 1 dropped, norm_topk_prob true", "bf16", q3, "qwen3_moe", 32, [], "", False),
            ("qwen3_moe, layer 1 dropped, norm_topk_prob true", "f32", q3, "qwen3_moe", 32, [], "", False),
            ("llama_dense", "bf16", os.path.join(GOLDEN, "llama_dense"), "llama_dense", 32, ["--tokenizer", tok],
             own_tok, True),
            ("olmoe, clip_qkv removed", "bf16", olmoe, "olmoe", 32, ["--tokenizer", tok], own_tok, False),
            ("glm4_moe, one expert group", "bf16", glm, "glm4_moe", 32, ["--tokenizer", tok], own_tok, False),
            # Q8_0: the same int8 weights on both sides (moetron --quantize q8_0 quantizes at load by the
            # rule the export writes); the inputs are quantized per block on both sides too.
            ("mixtral_gqa, sliding_window removed", "q8_0", m_nowin, "mixtral_gqa", 32, [],
             "moetron generate --quantize q8_0", False),
            ("the trained model of tests/golden/perplexity", "q8_0", os.path.join(ROOT, "tests", "golden", "perplexity"),
             "perplexity", 32, [], "moetron generate --quantize q8_0; prompt: BOS + 'This License'", False),
        ]
        golden["perplexity"] = {"prompt_ids": [1, 312, 337, 321, 270, 294, 302]}

        # The golden Qwen3-MoE itself is refused: llama.cpp's qwen3moe graph cannot compute it.
        rc, _, err = run([args.moetron, "export", "gguf", "--model", os.path.join(GOLDEN, "qwen3_moe"),
                          "--output", os.path.join(work, "refused.gguf")])
        print("== qwen3_moe golden as committed: export exit %d (expected 2, refused)\n%s\n" % (rc, err))
        results = []
        for k, (label, typ, model, case, n_new, extra, note, as_committed) in enumerate(cases):
            prompt = golden[case]["prompt_ids"]
            hf = golden[case]["expected_ids"][:n_new] if as_committed else None
            out = os.path.join(work, f"case{k}.gguf")
            print(f"== {label} [{typ}]" + (f" -- {note}" if note else ""))
            rc, msg, err = run([args.moetron, "export", "gguf", "--model", model, "--output", out, "--type", typ]
                               + extra)
            if rc != 0:
                print("export failed:", err, "\nFAIL\n")
                results.append(False)
                continue
            print("export    :", msg.splitlines()[0])
            ids = ",".join(map(str, prompt))
            rc1, ours, err1 = run([args.moetron, "generate", "--model", model, "--prompt-ids", ids,
                                   "--max-new-tokens", str(n_new), "--threads", "1"]
                                  + (["--quantize", "q8_0"] if typ == "q8_0" else []))
            rc2, theirs, err2 = run([greedy, out, ids, str(n_new)])
            print("prompt    :", ids)
            print("moetron   :", ours if rc1 == 0 else "error: " + err1)
            print("llama.cpp :", theirs if rc2 == 0 else "error: " + err2)
            if hf is not None:
                print("HF        :", ",".join(map(str, hf)), "(tests/golden/generate/expected.json, for reference)")
            ok = rc1 == 0 and rc2 == 0 and ours == theirs and ours != ""
            if not ok and rc1 == 0 and rc2 == 0:
                a, b = ours.split(","), theirs.split(",")
                first = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
                print(f"first difference at new token {first}")
            print("PASS\n" if ok else "FAIL\n")
            results.append(ok)
        print(f"{sum(results)} of {len(results)} cases PASS")
        return 0 if all(results) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
