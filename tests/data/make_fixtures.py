"""Regenerates the small tokenizer fixtures used by text/src/tokenizer tests.

Run from this folder: python3 make_fixtures.py   (needs the `tokenizers` Python package).
"""
import json
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran away.",
    "Hello world! Hello there, how are you today? I am fine, thank you very much for asking.",
    "def main():\n    print('hello, world')\n    return 0\n\nfn main() { println!(\"{}\", 1 + 2); }",
    "Les élèves étudient à l'école. Ça va très bien, merci! Naïve café, crème brûlée, déjà vu.",
    "Ich möchte ein Stück Kuchen. Größe, Übung, Straße, schön, müde.",
    "你好，世界。我们今天学习中文。日本語のテキストも少しあります。こんにちは。",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2024-01-01",
    "  indented text\twith tabs\nand new lines\r\n and spaces   at the end   ",
] * 20

HERE = os.path.dirname(os.path.abspath(__file__))


def save(tok, name, config):
    d = os.path.join(HERE, name)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def added(content, id_):
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}


# 1. A Llama-2 / TinyLlama style SentencePiece-BPE with byte fallback, in the "legacy" tokenizer.json layout
#    (Prepend+Replace normalizer, no pre-tokenizer, TemplateProcessing adding <s>, Strip decoder).
specials = ["<unk>", "<s>", "</s>"]
byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
spm = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
spm.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials + byte_tokens, show_progress=False,
                              limit_alphabet=120)
spm.train_from_iterator(CORPUS, trainer)
spm.pre_tokenizer = None
spm.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
spm.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
spm.add_special_tokens([AddedToken("<|user|>", special=True, normalized=False), AddedToken("<|assistant|>", special=True, normalized=False)])
llama_cfg = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
    "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
    "unk_token": "<unk>",
    "legacy": False,
    "clean_up_tokenization_spaces": False,
    "tokenizer_class": "LlamaTokenizer",
    "added_tokens_decoder": {
        "0": added("<unk>", 0), "1": added("<s>", 1), "2": added("</s>", 2),
    },
    "chat_template": "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
}
for tok in ("<|user|>", "<|assistant|>"):
    llama_cfg["added_tokens_decoder"][str(spm.token_to_id(tok))] = added(tok, 0)
save(spm, "llama-spm", llama_cfg)
# As in Llama-2's tokenizer.json, the <0xNN> byte pieces live in the model's vocab only, not among the added tokens.
path = os.path.join(HERE, "llama-spm", "tokenizer.json")
with open(path, encoding="utf-8") as f:
    j = json.load(f)
j["added_tokens"] = [t for t in j["added_tokens"] if not t["content"].startswith("<0x")]
with open(path, "w", encoding="utf-8") as f:
    json.dump(j, f, ensure_ascii=False)

# 2. A Qwen2 style byte-level BPE.
QWEN_RE = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
bl = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
bl.normalizer = normalizers.NFC()
bl.pre_tokenizer = pre_tokenizers.Sequence([
    pre_tokenizers.Split(Regex(QWEN_RE), behavior="isolated", invert=False),
    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
])
trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
bl.train_from_iterator(CORPUS, trainer)
bl.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
bl.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
qwen_specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
bl.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in qwen_specials])
bl.add_tokens([AddedToken("<think>", special=False, normalized=False)])
qwen_cfg = {
    "add_bos_token": False,
    "add_prefix_space": False,
    "added_tokens_decoder": {str(bl.token_to_id(t)): added(t, 0) for t in qwen_specials},
    "bos_token": None,
    "chat_template": [
        {"name": "default", "template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"},
        {"name": "tool_use", "template": "TOOLS"},
    ],
    "clean_up_tokenization_spaces": False,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "split_special_tokens": False,
    "tokenizer_class": "Qwen2Tokenizer",
    "unk_token": None,
}
qwen_cfg["added_tokens_decoder"][str(bl.token_to_id("<think>"))] = dict(added("<think>", 0), special=False)
save(bl, "qwen-bpe", qwen_cfg)
