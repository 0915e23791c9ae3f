#!/usr/bin/env python3
"""Reference tokenizations for tests/test_tokenizer_json.cpp, from Hugging Face `tokenizers` and
`transformers` (pip install tokenizers transformers).  Run from the repository root:

    python3 tools/make_tokenizer_json_reference.py

Writes (committed; the tests never run Python):
  tests/data/tiny-bytelevel-tokenizer.json   a byte-level BPE (vocab 800) trained here by `tokenizers`
      with GPT-2's ByteLevel pre-tokenizer (use_regex=true), no normalizer, the ChatML special tokens
      and two non-special added tokens with lstrip/rstrip/single_word set, so the second pattern path
      and the added-token flags are covered;
  tests/data/tokenizer_json_reference.json   for the tiny tokenizer and (when present) the Qwen
      vocabulary at ../shared/data/qwen-tokenizer.json (referenced in place, never copied):
      texts -> ids (encode, add_special_tokens=False), HF's decode(ids, skip_special_tokens=True),
      NFC(text); ChatML conversations -> apply_chat_template(tokenize=True) ids and the assistant
      mask (return_assistant_tokens_mask, {% generation %} around content + <|im_end|>).
"""
import hashlib
import json
import os
import sys
import unicodedata

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "data", "tiny-bytelevel-tokenizer.json")
OUT = os.path.join(ROOT, "tests", "data", "tokenizer_json_reference.json")
QWEN = os.path.join(ROOT, "..", "shared", "data", "qwen-tokenizer.json")

# ChatML in the Qwen2.5 form (without Qwen's default system prompt, which moetron's chatml does not
# insert), with the generation markers transformers needs for the assistant mask.
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TEXTS = [
    "",
    "Hello world, 12345!",
    "今日は良い天気ですね。東京タワーに行きましょう！カタカナとひらがな。",
    "我们在北京学习机器学习，数字123和4567。《红楼梦》",
    "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "def f(x):\r\n\treturn x  +  1\r\n\r\n\tif x:\n\t\tpass\n\n\n    # comment\t\n",
    "3.14159265358979323846 and 1,000,000 and 2024-01-01T12:00 and 00000000000000000001",
    "I \u2764\ufe0f \U0001F916 and \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 family \U0001F1EF\U0001F1F5!",
    "e\u0301cole, Cafe\u0301 vs \u00e9cole, Caf\u00e9; n\u0303 A\u030a o\u0308\u0301 a\u0328\u0301 q\u0307\u0323 \u1100\u1161\u11a8 \u1112\u1161\u11ab",
    "\u212b \u2126 \u00c5 \u0041\u030a \u1e0b\u0323 \u0344 \u0958 \uf900 \U0002f800 \u0f73",
    "a" * 3000,
    "ab" * 600,
    " " * 100 + "x",
    "!!!!" * 50 + "\n" * 20 + "0" * 200,
    "   leading and trailing   ",
    " x",
    "x ",
    "  \n  ",
    "\t\t",
    "  hello\n\n\nworld  \r\n",
    "...\n\n?!\r\n(x)\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<|im_end|><|im_start|>",
    "<|im_end <|im_start |im_end|> <|im_end|>x",
    "I'm you're he's they'll we've I'd don't DON'T 'S 'Ll it\u2019s 'x x'\u017fx '\u017f '\u212ax",
    "a\u00a0b\u3000c\u2003d\x1ce\x85f\u2028g\u200bh",
    "Ελληνικά عربى עברית हिन्दी ไทย 한국어 ქართული",
    "tab\tsep\tvalues\n1\t2\t3\n",
    "mixed123abc 4five 6 seven8",
    "   \n\n   \n",
    "email: test@example.com, url: https://example.com/a?b=c&d=e#f",
    "x <extra> y  <extra>  z <word>  a<word>b <word>",
    "\u00ad\u00a0\u0085\u007f\x00\x01end",
]



def random_texts(n=400, seed=1234):
    """Random strings over characters the split patterns treat differently (letters of several
    scripts, digits, punctuation, ASCII and Unicode spaces, \r \n, combining marks, emoji, apostrophe
    contractions, the special tokens), for the pattern matchers' corner cases."""
    import random
    rng = random.Random(seed)
    atoms = list("aZk09 .,;!?'\"()-_/\\\t\r\n") + [
        " ", "  ", "\r\n", "\n\n", "'s", "'S", "'ll", "'Re", "'ve", "'d", "'m", "'t", "\u017f", "\u212a",
        "\u00e9", "e\u0301", "\u0301", "\u0323\u0307", "\u00a0", "\u3000", "\u2003", "\u0085", "\x1c", "\x0b", "\x0c",
        "東", "京", "の", "カ", "한", "\u1100\u1161", "\u11a8", "П", "ё", "\u0660", "\u00b2", "\u2167", "\u00bd",
        "\U0001F600", "\u2764\ufe0f", "\u200d", "\U0001F1EF\U0001F1F5", "<|im_end|>", "<|im_start|>", "<|endoftext|>",
        "\u0627\u0644", "\u05e9", "\u0915\u093f", "\u0e01\u0e34", "\u200b", "\ufeff", "\u2028", "$", "€", "\u00ad"]
    out = []
    for _ in range(n):
        k = rng.randint(1, 24)
        out.append("".join(rng.choice(atoms) for _ in range(k)))
    return out


TEXTS += random_texts()

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi! How can I help?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "2+2=?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "日本語で答えて"}, {"role": "assistant", "content": "はい、四です。"}],
    [{"role": "user", "content": "Code?"},
     {"role": "assistant", "content": "\n```python\ndef f():\n\treturn 1\n```\n"}],
    [{"role": "user", "content": "  spaces  "}, {"role": "assistant", "content": "  and more  \n\n"}],
    [{"role": "user", "content": "e\u0301 and caf\u00e9"}, {"role": "assistant", "content": "Cafe\u0301 \U0001F600"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a question"}],
]


def train_tiny():
    corpus = [t for t in TEXTS if t] * 3 + [
        "The quick brown fox jumps over the lazy dog. " * 20,
        "Machine learning models tokenize text into subword units before training. " * 10,
        "def main():\n    print('hello world')\n    return 0\n" * 10,
        "東京 北京 Москва Paris 12345 67890 " * 10,
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken("<extra>", lstrip=True, rstrip=True, normalized=True),
                    AddedToken("<word>", single_word=True, normalized=False)])
    tok.save(TINY)
    return tok


def reference(path, sha):
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(path)
    has_nfc = json.load(open(path, encoding="utf-8")).get("normalizer") is not None
    texts = []
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=False).ids
        texts.append({"text": t, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True),
                      "nfc": unicodedata.normalize("NFC", t) if has_nfc else t})
    fast = PreTrainedTokenizerFast(tokenizer_file=path)
    fast.chat_template = CHATML
    chats = []
    for conv in CONVERSATIONS:
        gen = conv[-1]["role"] != "assistant"
        r = fast.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                     add_generation_prompt=gen)
        ids = list(r["input_ids"])
        mask = list(r["assistant_masks"])
        assert len(ids) == len(mask)
        chats.append({"messages": conv, "add_generation_prompt": gen, "ids": ids, "mask": mask})
    specials = {s: tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    return {"sha256": sha, "vocab_size": tok.get_vocab_size(with_added_tokens=True), "specials": specials,
            "texts": texts, "chats": chats}


def main():
    train_tiny()
    out = {"unicode_version": unicodedata.unidata_version}
    tiny_sha = hashlib.sha256(open(TINY, "rb").read()).hexdigest()
    out["tiny"] = reference(TINY, tiny_sha)
    if os.path.exists(QWEN):
        out["qwen"] = reference(QWEN, hashlib.sha256(open(QWEN, "rb").read()).hexdigest())
    else:
        print(f"note: {QWEN} is absent; no Qwen references written", file=sys.stderr)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, indent=None)
        f.write("\n")
    print(f"wrote {TINY} and {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
