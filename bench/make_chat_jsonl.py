#!/usr/bin/env python3
"""Generate a synthetic chat JSONL (No Robots / OpenAI "messages" schema) for `moetron bench data`.

Deterministic for a given --seed.  Conversations have 1-4 exchanges, a system prompt in about a third
of them, and text mixing English prose with some Japanese, French, code, numbers and emoji, so the
tokenizer sees byte fallback and multi-byte UTF-8 as in real data.  Not committed data: generate it.

    python3 bench/make_chat_jsonl.py --out /tmp/chat50.jsonl --mb 50
"""

import argparse
import json
import random

EN = ("the a of to and in is that for it as with was on be by this are from at or have an they which one you "
      "had not but what all were when we there can more if will out so up said about into than them could "
      "model expert router token layer attention training data gradient sparse mixture network language "
      "answer question explain example simple important different between because through however").split()
JA = ["東京", "日本語", "専門家", "モデル", "学習", "データ", "質問", "答え", "今日は", "ありがとう", "です", "ます", "した"]
FR = ["bonjour", "données", "modèle", "réseau", "très", "déjà", "être", "où", "français", "problème"]
EMOJI = ["🙂", "🎉", "👍🏽", "🚀", "✅", "🇯🇵", "👨‍👩‍👧"]
CODE = ["def f(x):\n    return x * 2\n", "for i in range(10):\n    print(i)\n", "```cpp\nint main() { return 0; }\n```"]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly and precisely.", "You are a poet. Answer in verse.",
           "あなたは親切なアシスタントです。", "Réponds en français."]


def sentence(r):
    n = r.randint(5, 22)
    words = []
    for _ in range(n):
        x = r.random()
        if x < 0.86:
            words.append(r.choice(EN))
        elif x < 0.93:
            words.append(r.choice(JA))
        elif x < 0.97:
            words.append(r.choice(FR))
        elif x < 0.985:
            words.append(str(r.randint(0, 100000)))
        else:
            words.append(r.choice(EMOJI))
    s = " ".join(words)
    return s[0].upper() + s[1:] + r.choice([".", ".", ".", "?", "!"])


def paragraph(r, lo, hi):
    parts = [sentence(r) for _ in range(r.randint(lo, hi))]
    if r.random() < 0.1:
        parts.append("\n" + r.choice(CODE))
    text = " ".join(parts)
    if r.random() < 0.2:
        text = text.replace(". ", ".\n\n", 1)
    return text


def conversation(r):
    msgs = []
    if r.random() < 0.33:
        msgs.append({"role": "system", "content": r.choice(SYSTEMS)})
    for _ in range(r.randint(1, 4)):
        msgs.append({"role": "user", "content": paragraph(r, 1, 4)})
        msgs.append({"role": "assistant", "content": paragraph(r, 2, 14)})
    return {"messages": msgs}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mb", type=float, default=50.0, help="approximate size in MB")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    r = random.Random(args.seed)
    target = int(args.mb * 1e6)
    written = lines = 0
    with open(args.out, "w", encoding="utf-8") as f:
        while written < target:
            line = json.dumps(conversation(r), ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            lines += 1
    print(f"wrote {args.out}: {lines} conversations, {written / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
