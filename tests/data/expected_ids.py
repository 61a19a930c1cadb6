"""Prints the expected ids used by text/src/tokenizer/tests.rs, computed with transformers'
AutoTokenizer (5.x) on the fixtures of this folder and on the variants the tests derive from them.

Run from this folder: python3 expected_ids.py > ../../text/src/tokenizer/expected.rs
"""
import json
import logging
import os
import shutil
import sys
import tempfile

logging.disable(logging.WARNING)
from transformers import AutoTokenizer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

STRINGS = [
    "Hello world",
    " Hello world",
    "  two spaces",
    "",
    " ",
    "Hello<|user|>world",
    "<|user|>\nHello world</s>\n<|assistant|>\n",
    "<s>Hi</s>",
    "Naïve café 🦀 你好, 世界!",
    "a\n\nb\tc  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x<think>y",
    "Größe ÜBUNG straße — 3.14159 == 2024-01-01",
    "def main():\n    print('hello')\n",
    "🦀🎉👍🏽 日本語のテキスト",
    "I'm sure they'll say it's \"fine\"",
]

# Must match the modifications in tests.rs.
BOS_TEMPLATE = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
             {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [594], "tokens": ["<|endoftext|>"]}},
}
TRUNCATION = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}

VARIANTS = [
    ("LLAMA", "llama-spm", {}, {}),
    ("LLAMA_LEGACY", "llama-spm", {"legacy": True}, {}),
    ("LLAMA_NO_PREFIX_SPACE", "llama-spm", {"add_prefix_space": False}, {}),
    ("LLAMA_AS_FAST", "llama-spm", {"tokenizer_class": "PreTrainedTokenizerFast"}, {}),
    ("LLAMA_ADD_BOS_FALSE", "llama-spm", {"add_bos_token": False, "add_eos_token": True}, {}),
    ("QWEN", "qwen-bpe", {}, {}),
    ("QWEN_BOS_TEMPLATE", "qwen-bpe", {"add_bos_token": False, "bos_token": "<|endoftext|>"},
     {"post_processor": BOS_TEMPLATE}),
    ("QWEN_TRUNCATION", "qwen-bpe", {}, {"truncation": TRUNCATION}),
]


def rust_str(s):
    out = []
    for ch in s:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch in "\"\\":
            out.append("\\" + ch)
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def load(src, config_mod, json_mod):
    d = tempfile.mkdtemp()
    with open(os.path.join(HERE, src, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    tj.update(json_mod)
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    with open(os.path.join(HERE, src, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.update(config_mod)
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, ensure_ascii=False)
    tok = AutoTokenizer.from_pretrained(d)
    shutil.rmtree(d)
    return tok


print("//! Expected ids and texts for the tokenizer tests. Do not edit: regenerate with")
print("//! `python3 expected_ids.py > ../../text/src/tokenizer/expected.rs` in tests/data/.")
print("//! Computed with transformers' AutoTokenizer on the fixtures of tests/data/.")
print()
print("pub(super) const STRINGS: &[&str] = &[")
for s in STRINGS:
    print(f"    {rust_str(s)},")
print("];")
for name, src, cfg, tj in VARIANTS:
    tok = load(src, cfg, tj)
    print(f"// {name}: {src}, config {json.dumps(cfg)}, tokenizer.json {sorted(tj)} -> {type(tok).__name__}")
    print(f"pub(super) const {name}: &[&[u32]] = &[")
    for s in STRINGS:
        print(f"    &{tok(s)['input_ids']},")
    print("];")
    if name in ("LLAMA", "QWEN"):
        print(f"pub(super) const {name}_NO_SPECIAL: &[&[u32]] = &[")
        for s in STRINGS:
            print(f"    &{tok(s, add_special_tokens=False)['input_ids']},")
        print("];")
        print(f"/// decode(ids with special tokens), without and with skip_special_tokens.")
        print(f"pub(super) const {name}_DECODED: &[(&str, &str)] = &[")
        for s in STRINGS:
            ids = tok(s)["input_ids"]
            print(f"    ({rust_str(tok.decode(ids))}, {rust_str(tok.decode(ids, skip_special_tokens=True))}),")
        print("];")
        print(f"pub(super) const {name}_INFO: (Option<u32>, Option<u32>, usize) = "
              f"({'Some(%d)' % tok.bos_token_id if tok.bos_token_id is not None else 'None'}, "
              f"Some({tok.eos_token_id}), {len(tok)});")
