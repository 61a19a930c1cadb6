#!/usr/bin/env python3
"""Create the tiny test models under tests/fixtures/ and their golden outputs.

Usage (from the repository root, CPU only, about 15 seconds):

    python3 -m pip install -r scripts/requirements-golden.txt   # pinned versions
    python3 scripts/make_golden.py                               # writes tests/fixtures/{llama,mistral,qwen2,qwen3}/

Options: --out DIR (default tests/fixtures), --only NAME[,NAME...].

What it does, for each of four architectures (llama, mistral, qwen2, qwen3):

  1. trains a small tokenizer with the `tokenizers` library on scripts/corpus.txt
     (byte-level BPE like Qwen/GPT-2, or a Llama/SentencePiece-like BPE with byte fallback),
     saved in real Hugging Face format (tokenizer.json + tokenizer_config.json);
  2. builds a 2-layer, hidden-64 model from its transformers config class with seeded
     random weights (random RMSNorm weights and attention biases too), casts it to
     bfloat16 and saves it with save_pretrained (model.safetensors, config.json,
     generation_config.json);
  3. reloads the saved folder with AutoModelForCausalLM in float32 (the bf16 weights are
     upcast exactly), eager attention, and records for four prompts the prompt token ids,
     the float32 logits at the last prompt position, 32 greedy tokens (never stopping at
     EOS) and the top1-top2 logit margin of every greedy step, in golden.json.

Phi-3 (`--only phi3,phi3-longrope`): Phi3Config models with fused qkv/gate_up projections, a
real SentencePiece tokenizer.model (which llama.cpp's phi3 converter needs) with tokenizer.json
converted from it, a sliding window (phi3) or LongRoPE with partial rotary (phi3-longrope, whose
prompts never cross the LongRoPE boundary while generating; kv_cache_crossing.json records what
transformers' KV cache computes for one that does).

Everything is seeded: running the script twice gives byte-identical files. It fails if any
greedy margin is below MIN_MARGIN (so that an f32 reimplementation with a different summation
order cannot flip an argmax), if any prompt is too long, or if a sanity check fails: the bare
tokenizer.json must agree with AutoTokenizer; sdpa attention + KV cache must give the same greedy
tokens; Mistral's sliding window must change the long-prompt logits (and a prompt of exactly
`sliding_window` tokens must not); the llama config rewritten in the older top-level `rope_theta`
form must load to identical logits. tests/fixtures/README.md describes the output.
"""

import os as _os
import sys as _sys

# scripts/profile.py would shadow the standard library's `profile` (torch imports it):
# keep this folder off the module path before anything else is imported.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import argparse
import inspect
import json
import math
import os
import shutil
import sys

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    LlamaTokenizer,
    MistralConfig,
    Phi3Config,
    PhiConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)
from transformers.models.qwen3_5 import Qwen3_5TextConfig

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CORPUS = os.path.join(HERE, "corpus.txt")

MIN_MARGIN = 1e-3
N_GREEDY = 32
MAX_POS = 512
PREFILL_BLOCK = 64
# original_max_position_embeddings of the phi3-longrope fixture: the long prompt is longer, the
# other prompts stay within it for all of their greedy steps (make_one asserts both).
PHI3_ORIGINAL = 128

# The GPT-2 style split regex as used by Qwen2/Qwen2.5/Qwen3 (tokenizer.json "Split" pre-tokenizer).
QWEN_SPLIT_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PROMPTS = [
    # short English sentence
    "The capital of France is Paris, and the weather today is lovely.",
    # accents, CJK, emoji (the llama-style tokenizer byte-falls-back on most of the emoji)
    "Café crème à Zürich — naïve 東京の天気は晴れです 🌞🦀 ¡Qué día!",
    # code snippet
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\nprint(",
    # long prompt: > 100 tokens with every tokenizer (several 64-row prefill blocks, beyond the
    # Mistral sliding window of 24)
    "In the small harbour town where I grew up, every morning began with the sound of gulls and the smell of "
    "salt. My grandmother ran a bakery on the market square, and before sunrise she was already kneading "
    "dough. Years later, when I studied computer science in a distant city, I often thought about those quiet "
    "hours. Writing a compiler is a little like baking bread: you follow the recipe step by step, and at the "
    "end something useful comes out of the oven. Here is the first function I wrote for it:\n\n"
    "fn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n\n"
    "And here is what my grandmother said about it:",
]


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------

def corpus_lines():
    with open(CORPUS, encoding="utf-8") as f:
        return f.read().splitlines(keepends=True)


def train_bytelevel_tokenizer(vocab_size=1000):
    """Byte-level BPE laid out like Qwen's tokenizer.json: NFC normalizer, Split(regex) + ByteLevel
    pre-tokenizer, ByteLevel post-processor/decoder, special tokens appended after the BPE vocab."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_RE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return tok


def train_gpt2_tokenizer(vocab_size=1000):
    """Byte-level BPE laid out like GPT-2's own tokenizer.json: no normalizer, a ByteLevel
    pre-tokenizer with GPT-2's regex (use_regex, add_prefix_space false), ByteLevel post-processor
    and decoder, and `<|endoftext|>` appended after the BPE vocabulary (GPT-2's last id)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def deterministic_alphabet_limit(pre_tokenizer, wanted):
    """BpeTrainer keeps the `limit_alphabet` most frequent characters, breaking ties between equal
    counts in hash-map order (different on every run). Return the largest limit <= wanted that
    falls between two different counts, so that the kept alphabet is always the same."""
    counts = {}
    for line in corpus_lines():
        for word, _ in pre_tokenizer.pre_tokenize_str(line):
            for ch in word:
                counts[ch] = counts.get(ch, 0) + 1
    ordered = sorted(counts.values(), reverse=True)
    limit = min(wanted, len(ordered))
    while 0 < limit < len(ordered) and ordered[limit - 1] == ordered[limit]:
        limit -= 1
    assert limit > 0
    return limit


def train_llama_tokenizer(vocab_size=1000):
    """Llama/SentencePiece-like BPE: <unk>=0 <s>=1 </s>=2, <0x00>..<0xFF>=3..258, then the learned
    pieces; byte_fallback, Metaspace pre-tokenizer, Llama's decoder, and a TemplateProcessing
    post-processor adding <s>."""
    n_fixed = 3 + 256
    tmp = Tokenizer(models.BPE(unk_token="<unk>"))
    # split=True only while training (merges never cross a word start); the saved tokenizer uses
    # split=False like transformers' Llama conversion, which gives the same pieces.
    tmp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_fixed,
        min_frequency=2,
        # rare characters (most emoji, some CJK, a few ASCII letters) go through byte fallback
        limit_alphabet=deterministic_alphabet_limit(tmp.pre_tokenizer, 150),
        special_tokens=[],
        show_progress=False,
    )
    tmp.train_from_iterator(corpus_lines(), trainer)
    trained = json.loads(tmp.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0",
        pair="<s>:0 $A:0 <s>:1 $B:1",
        special_tokens=[("<s>", 1)],
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok


# Phi-3's added tokens (ids 32000, 32001, 32007, 32010 in Phi-3-mini), after the SentencePiece
# vocabulary; the chat markers swallow the whitespace after them (`rstrip`), as Phi-3's do.
PHI3_ADDED = [("<|endoftext|>", False), ("<|assistant|>", True), ("<|end|>", True), ("<|user|>", True)]


def train_spm_tokenizer(vocab_size=1000):
    """A real SentencePiece BPE model (Phi-3 ships Llama 2's tokenizer.model, which llama.cpp's
    phi3 converter reads), trained with the `sentencepiece` package like Llama's: <unk>=0 <s>=1
    </s>=2, the 256 byte pieces, byte fallback, identity normalisation, dummy prefix, digits split,
    whitespace kept. tokenizer.json is transformers' conversion of that model (LlamaTokenizer
    loaded from tokenizer.model), so both files tokenise alike (make_one checks it per prompt).
    Returns the transformers tokenizer and the model's bytes."""
    import io
    import tempfile
    import sentencepiece as spm
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line.rstrip("\n") for line in corpus_lines()]), model_writer=model,
        model_type="bpe", vocab_size=vocab_size, byte_fallback=True, character_coverage=0.98,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, shuffle_input_sentence=False, minloglevel=2)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "tokenizer.model"), "wb") as f:
            f.write(model.getvalue())
        tok = LlamaTokenizer.from_pretrained(tmp, add_bos_token=True, add_eos_token=False, legacy=False,
                                             model_max_length=MAX_POS, clean_up_tokenization_spaces=False)
    tok.add_special_tokens({"additional_special_tokens": [
        tokenizers.AddedToken(t, rstrip=r, lstrip=False, normalized=False, special=True) for t, r in PHI3_ADDED]})
    tok.pad_token = "<|endoftext|>"
    tok.eos_token = "<|endoftext|>"  # Phi-3's tokenizer_config names it, not </s>
    return tok, model.getvalue()


def train_gemma_tokenizer(vocab_size=1000):
    """Gemma-style SentencePiece BPE: <pad>=0 <eos>=1 <bos>=2 <unk>=3 <mask>=4, user-defined
    <start_of_turn>=5 <end_of_turn>=6, <0x00>..<0xFF>, then learned pieces; byte fallback, no dummy
    prefix, identity normalisation, digits split, whitespace-only pieces allowed (Gemma's trainer
    options). Trained with `sentencepiece` (deterministic with one thread); transformers'
    GemmaTokenizer converts tokenizer.model to tokenizer.json. Returns the tokenizer and the bytes of
    tokenizer.model (which llama.cpp's converter reads)."""
    import tempfile

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "tokenizer")
        spm.SentencePieceTrainer.train(
            input=CORPUS, model_prefix=prefix, model_type="bpe", vocab_size=vocab_size,
            pad_id=0, eos_id=1, bos_id=2, unk_id=3,
            pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
            user_defined_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"], byte_fallback=True,
            add_dummy_prefix=False, normalization_rule_name="identity", remove_extra_whitespaces=False,
            split_digits=True, allow_whitespace_only_pieces=True, character_coverage=0.995,
            num_threads=1, minloglevel=2, max_sentence_length=100000)
        proto = sentencepiece_model_pb2.ModelProto()
        with open(prefix + ".model", "rb") as f:
            proto.ParseFromString(f.read())
        # no paths of this machine in the file
        proto.trainer_spec.input[:] = ["corpus.txt"]
        proto.trainer_spec.model_prefix = "tokenizer"
        model_bytes = proto.SerializeToString()
        folder = os.path.join(tmp, "tok")
        os.makedirs(folder)
        with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
            f.write(model_bytes)
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "GemmaTokenizer", "model_max_length": MAX_POS, "add_bos_token": True,
                       "add_eos_token": False, "clean_up_tokenization_spaces": False}, f)
        tok = AutoTokenizer.from_pretrained(folder)
        for key in ("vocab_file", "is_local", "local_files_only"):
            tok.init_kwargs.pop(key, None)
    assert type(tok).__name__ == "GemmaTokenizer" and len(tok) == vocab_size, (type(tok), len(tok))
    return tok, model_bytes


def wrap_tokenizer(kind, eos_token):
    if kind == "spm":
        return train_spm_tokenizer()
    if kind == "gemma":
        return train_gemma_tokenizer()
    if kind == "llama":
        tok = train_llama_tokenizer()
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<s>",
            eos_token="</s>",
            unk_token="<unk>",
            model_max_length=MAX_POS,
            clean_up_tokenization_spaces=False,
        )
    if kind == "gpt2":
        # as GPT-2's tokenizer_config: <|endoftext|> is bos, eos and unk; no pad token
        return PreTrainedTokenizerFast(
            tokenizer_object=train_gpt2_tokenizer(),
            bos_token="<|endoftext|>",
            eos_token="<|endoftext|>",
            unk_token="<|endoftext|>",
            model_max_length=MAX_POS,
            clean_up_tokenization_spaces=False,
        )
    tok = train_bytelevel_tokenizer()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=eos_token,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=MAX_POS,
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

COMMON = dict(
    hidden_size=64,
    intermediate_size=136,  # not a multiple of 16 on purpose
    num_hidden_layers=2,
    max_position_embeddings=MAX_POS,
    hidden_act="silu",
)

MODELS = {
    "llama": dict(
        seed=1001,
        tokenizer="llama",
        config_cls=LlamaConfig,
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            initializer_range=0.2,
        ),
        tokens=dict(bos="<s>", eos="</s>"),
        gen_eos="single",
        old_style_config=True,  # rope_theta / torch_dtype at the top level, like pre-v5 checkpoints
    ),
    "mistral": dict(
        seed=2002,
        tokenizer="llama",
        config_cls=MistralConfig,
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=24,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            initializer_range=0.2,
        ),
        tokens=dict(bos="<s>", eos="</s>"),
        gen_eos="single",
        old_style_config=False,
    ),
    "qwen2": dict(
        seed=3003,
        tokenizer="bytelevel",
        config_cls=Qwen2Config,
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            initializer_range=0.2,
        ),
        tokens=dict(bos=None, eos="<|endoftext|>"),
        gen_eos="single",
        old_style_config=False,
    ),
    "qwen3": dict(
        seed=4004,
        tokenizer="bytelevel",
        config_cls=Qwen3Config,
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # != hidden_size / num_attention_heads = 16
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            attention_bias=False,
            initializer_range=0.2,
        ),
        tokens=dict(bos=None, eos="<|im_end|>"),
        gen_eos="list",  # eos_token_id = [<|im_end|>, <|endoftext|>] like Qwen3
        old_style_config=False,
    ),
    # Phi-3-mini-4k style: fused qkv_proj and gate_up_proj, MHA, untied, Llama's SentencePiece
    # tokenizer with Phi-3's added tokens, and a sliding window (2047 in the published model)
    # shorter than the long prompt, applied on every layer as transformers 5 does.
    "phi3": dict(
        seed=5005,
        tokenizer="spm",
        config_cls=Phi3Config,
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=24,
            original_max_position_embeddings=MAX_POS,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rms_norm_eps=1e-5,
            initializer_range=0.2,
        ),
        tokens=dict(bos="<s>", eos="<|endoftext|>"),
        gen_eos=["<|endoftext|>", "<|assistant|>", "<|end|>"],  # as Phi-3's generation_config
        old_style_config=False,
    ),
    # Phi-3-128k / Phi-4-mini style: LongRoPE (short factors up to PHI3_ORIGINAL positions, long
    # beyond: the long prompt takes the long ones, the others the short ones, none crosses while
    # generating), partial rotary 0.75 (12 of 16 dimensions, 6 factors each), GQA, tied
    # embeddings, no window; config.json in the published form (rope_scaling with "type",
    # top-level rope_theta, partial_rotary_factor, original_max_position_embeddings).
    "phi3-longrope": dict(
        seed=6006,
        tokenizer="spm",
        config_cls=Phi3Config,
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            original_max_position_embeddings=PHI3_ORIGINAL,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.08, 1.19, 1.37, 1.66, 2.05],
                "long_factor": [1.0, 2.7, 5.9, 11.3, 19.8, 33.6],
            },
            rms_norm_eps=1e-5,
            initializer_range=0.2,
        ),
        tokens=dict(bos="<s>", eos="<|endoftext|>"),
        gen_eos=["<|endoftext|>", "<|assistant|>", "<|end|>"],
        old_style_config="longrope",
    ),
    "gpt2": dict(
        seed=5007,
        tokenizer="gpt2",
        config_cls=GPT2Config,
        common={},  # GPT-2's own config keys
        config=dict(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=MAX_POS,
            n_ctx=MAX_POS,  # as GPT-2's config.json; llama.cpp's converter reads it
            n_inner=None,  # 4 * n_embd (llama.cpp's converter writes 4 * n_embd whatever n_inner says)
            activation_function="gelu_new",
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=True,
            initializer_range=0.2,
        ),
        tokens=dict(bos=None, eos="<|endoftext|>"),
        gen_eos="single",
        old_style_config=False,
        final_norm="transformer.ln_f.weight",
        norm_suffixes=(".ln_1.weight", ".ln_2.weight"),
        # biases everywhere: at 0.5 their position-independent sum drowns the tokens and the
        # greedy continuations repeat one or two tokens
        bias_std=0.1,
    ),
    "phi": dict(
        seed=6009,
        tokenizer="gpt2",
        config_cls=PhiConfig,
        # llama.cpp's converter writes feed_forward_length = 4 * hidden_size: keep it true
        common=dict(COMMON, intermediate_size=256, hidden_act="gelu_new"),
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            # head_dim 16, 8 rotated dimensions (rotate-half pairs 0-3 with 4-7), 8 passed through
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            tie_word_embeddings=False,
            layer_norm_eps=1e-5,
            initializer_range=0.2,
        ),
        tokens=dict(bos=None, eos="<|endoftext|>"),
        gen_eos="single",
        old_style_config=False,
        final_norm="model.final_layernorm.weight",
        norm_suffixes=("norm.weight",),
        bias_std=0.1,  # as gpt2
    ),
    # Qwen3.5 (text): three Gated DeltaNet layers, then one full-attention layer (full_attention_interval
    # 4), twice. More value heads than key heads (each key head serves two), key and value head sizes
    # that differ, partial rotary (8 of 32 dimensions), the output gate on q, (1 + w) RMSNorms and a
    # plain-w gated norm. The long prompt spans several 64-token chunks of the reference's chunked
    # delta rule and several prefill blocks.
    "qwen3_5": dict(
        seed=7007,
        tokenizer="bytelevel",
        config_cls=Qwen3_5TextConfig,
        common=dict(COMMON, num_hidden_layers=8),
        config=dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=24,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
            rms_norm_eps=1e-6,
            initializer_range=0.2,
        ),
        tokens=dict(bos=None, eos="<|im_end|>"),
        gen_eos="list",
        old_style_config=False,
        plus_one_norms=True,  # (1 + w) norms; the DeltaNet layers' gated norm is plain w (randomise_qwen35)
        qwen35=True,
        kv_check_attn="eager",
    ),
    "gemma2": dict(
        seed=5010,
        tokenizer="gemma",
        config_cls=Gemma2Config,
        config=dict(
            hidden_act=None,  # Gemma reads hidden_activation
            hidden_activation="gelu_pytorch_tanh",
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            # = head_dim: llama.cpp's gemma2 graph scales scores by head_dim^-0.5 whatever this says
            query_pre_attn_scalar=16,
            sliding_window=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=10.0,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rms_norm_eps=1e-6,
            initializer_range=0.2,
        ),
        tokens=dict(bos="<bos>", eos="<eos>"),
        gen_eos="single",
        old_style_config=False,
        gemma=True,
        kv_check_attn="eager",  # Gemma 2 has no sdpa path (soft-capping)
    ),
    "gemma3": dict(
        seed=6006,
        tokenizer="gemma",
        config_cls=Gemma3TextConfig,
        config=dict(
            hidden_act=None,
            hidden_activation="gelu_pytorch_tanh",
            num_hidden_layers=6,  # sliding_window_pattern 6: five sliding layers, then a full one
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # != hidden_size / num_attention_heads = 16
            query_pre_attn_scalar=32,  # = head_dim, as llama.cpp's gemma3 graph assumes
            sliding_window=24,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            rms_norm_eps=1e-6,
            initializer_range=0.2,
        ),
        tokens=dict(bos="<bos>", eos="<eos>", eos_extra="<end_of_turn>"),
        gen_eos="list",  # eos_token_id = [<eos>, <end_of_turn>] like Gemma 3's generation_config
        old_style_config=False,
        gemma=True,
    ),
}


# Gemma's final norm, w of (1 + w): scales of both signs, so that with tied embeddings a token's own
# embedding does not dominate its logits (a random model would otherwise repeat its last token).
GEMMA_FINAL_NORM = (-3.0, 1.0)


def randomise_norms_and_biases(model, gen, final_norm="model.norm.weight", norm_suffixes=("norm.weight",),
                               bias_std=0.5, gemma=False):
    """Non-trivial norm weights and biases so that bugs in those paths change the output.
    Gemma's norms scale by (1 + w): w in [-0.5, 0.5] there, the final one GEMMA_FINAL_NORM."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if gemma and name.endswith("norm.weight"):
                lo, hi = GEMMA_FINAL_NORM if name == final_norm else (-0.5, 0.5)
                p.copy_(torch.empty(p.shape).uniform_(lo, hi, generator=gen))
            elif name == final_norm:
                # larger final norm: logits with std ~5, so greedy top1-top2 margins are not tiny
                p.copy_(torch.empty(p.shape).uniform_(2.0, 4.0, generator=gen))
            elif name.endswith(tuple(norm_suffixes)):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * bias_std)


def randomise_qwen35(model, gen):
    """The DeltaNet layers' own parameters: the gated norm scales by plain w (so w in [0.5, 1.5],
    not the (1 + w) range), dt_bias and A_log spread so that every head decays at its own rate."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 4.0, generator=gen).log())


def build_model(name, spec, folder):
    tok = wrap_tokenizer(spec["tokenizer"], spec["tokens"]["eos"])
    spm_model = None
    if isinstance(tok, tuple):
        tok, spm_model = tok
    vocab_size = len(tok)
    if spec["tokens"]["bos"]:
        bos_id = tok.convert_tokens_to_ids(spec["tokens"]["bos"])
    else:
        # like Qwen2.5/Qwen3's config.json: bos_token_id = <|endoftext|> although the tokenizer adds no BOS
        bos_id = tok.convert_tokens_to_ids("<|endoftext|>")
    eos_id = tok.convert_tokens_to_ids(spec["tokens"]["eos"])
    pad_id = tok.pad_token_id
    if isinstance(spec["gen_eos"], list):
        eos = [tok.convert_tokens_to_ids(t) for t in spec["gen_eos"]]
    elif spec["gen_eos"] == "list":
        eos = [eos_id, tok.convert_tokens_to_ids(spec["tokens"].get("eos_extra", "<|endoftext|>"))]
    else:
        eos = eos_id

    fields = {**spec.get("common", COMMON), **spec["config"]}
    fields = {k: v for k, v in fields.items() if not (k == "hidden_act" and v is None)}
    cfg = spec["config_cls"](
        vocab_size=vocab_size,
        bos_token_id=bos_id,
        eos_token_id=eos,
        pad_token_id=pad_id,
        **fields,
    )
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(spec["seed"] + 7)
    randomise_norms_and_biases(
        model, gen, spec.get("final_norm", "model.norm.weight"), spec.get("norm_suffixes", ("norm.weight",)),
        spec.get("bias_std", 0.5), gemma=spec.get("gemma", False) or spec.get("plus_one_norms", False))
    if spec.get("qwen35"):
        randomise_qwen35(model, gen)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id,
        eos_token_id=eos,
        pad_token_id=pad_id,
        do_sample=False,
    )
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16

    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.makedirs(folder)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    if spm_model is not None:
        with open(os.path.join(folder, "tokenizer.model"), "wb") as f:
            f.write(spm_model)
    return cfg


def rewrite_config_old_style(folder):
    """Rewrite config.json the way pre-v5 transformers wrote it: rope_theta and torch_dtype at the
    top level instead of rope_parameters / dtype."""
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    rope = cfg.pop("rope_parameters")
    out = {}
    for k, v in cfg.items():
        if k == "dtype":
            out["torch_dtype"] = v
        else:
            out[k] = v
    out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") == "longrope":
        # as Phi-3-128k / Phi-4-mini publish it: {"type", "short_factor", "long_factor"}, with
        # partial_rotary_factor and original_max_position_embeddings at the top level
        out["rope_scaling"] = {"long_factor": rope["long_factor"], "short_factor": rope["short_factor"],
                               "type": "longrope"}
        out["partial_rotary_factor"] = rope["partial_rotary_factor"]
        assert out["original_max_position_embeddings"] == rope["original_max_position_embeddings"], (out, rope)
    else:
        assert rope.get("rope_type", "default") == "default", rope
        out["rope_scaling"] = None
    out = dict(sorted(out.items()))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2, sort_keys=True)
        f.write("\n")


# --------------------------------------------------------------------------------------------
# Reference computation
# --------------------------------------------------------------------------------------------

def load_f32(folder, **overrides):
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", **overrides
    )
    model.eval()
    return model


@torch.no_grad()
def last_logits(model, ids):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0, -1].to(torch.float32)


def margin(logits):
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


@torch.no_grad()
def greedy(model, prompt_ids, n):
    """Greedy decoding by hand, full forward (no KV cache) at every step, never stopping at EOS."""
    ids = list(prompt_ids)
    first = None
    out, margins = [], []
    for step in range(n):
        logits = last_logits(model, ids)
        if step == 0:
            first = logits
        nxt = int(torch.argmax(logits))
        margins.append(margin(logits))
        out.append(nxt)
        ids.append(nxt)
    return first, out, margins


@torch.no_grad()
def greedy_cached(model, prompt_ids, n):
    """Same greedy decoding through the KV cache (prefill, then one token per step)."""
    # transformers 5.2x renamed past_key_values -> cache (argument and output field)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([prompt_ids], dtype=torch.long), use_cache=True)
    past, logits = getattr(out, key), out.logits[0, -1]
    first, toks = logits, []
    for _ in range(n):
        nxt = int(torch.argmax(logits))
        toks.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), use_cache=True, **{key: past})
        past, logits = getattr(out, key), out.logits[0, -1]
    return first, toks


def f32_list(t):
    # repr of the Python float of each float32 value: exact round trip to f32
    return [float(x) for x in t.numpy().astype(np.float32)]


def make_one(name, spec, out_root):
    folder = os.path.join(out_root, name)
    build_model(name, spec, folder)
    if spec["old_style_config"]:
        before = load_f32(folder)
        rewrite_config_old_style(folder)

    tok = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    assert len(tok) == raw.get_vocab_size(with_added_tokens=True)
    model = load_f32(folder)
    assert all(p.dtype == torch.float32 for p in model.parameters())

    if spec["old_style_config"]:
        # the older top-level config must load to the same model
        assert model.config.rope_parameters["rope_theta"] == before.config.rope_parameters["rope_theta"], (
            model.config.rope_parameters, before.config.rope_parameters)
        probe = tok(PROMPTS[3])["input_ids"]
        assert torch.equal(last_logits(model, probe), last_logits(before, probe)), "old-style config changed logits"
        del before

    spm_proc = None
    if os.path.exists(os.path.join(folder, "tokenizer.model")):
        import sentencepiece as spm
        spm_proc = spm.SentencePieceProcessor(model_file=os.path.join(folder, "tokenizer.model"))
    cases = []
    for prompt in PROMPTS:
        enc = tok(prompt)
        prompt_ids = list(enc["input_ids"])
        # the bare tokenizer.json (what a `tokenizers`-crate consumer sees) must agree with AutoTokenizer
        raw_ids = raw.encode(prompt, add_special_tokens=True).ids
        assert raw_ids == prompt_ids, (name, prompt, raw_ids, prompt_ids)
        assert raw.decode(prompt_ids, skip_special_tokens=True) == prompt, (name, prompt)
        if spm_proc is not None:
            # tokenizer.model (what llama.cpp's converter reads) splits like tokenizer.json
            assert [tok.bos_token_id] + spm_proc.encode(prompt) == prompt_ids, (name, prompt)
        if spec["tokens"]["bos"]:
            assert prompt_ids[0] == tok.bos_token_id and prompt_ids.count(tok.bos_token_id) == 1, prompt_ids[:4]
        else:
            assert tok.bos_token_id is None or prompt_ids[0] != tok.bos_token_id
        assert len(prompt_ids) + N_GREEDY < MAX_POS, (name, len(prompt_ids))
        first, out, margins = greedy(model, prompt_ids, N_GREEDY)
        greedy_text = tok.decode(out, skip_special_tokens=False)
        assert greedy_text == raw.decode(out, skip_special_tokens=False), (name, out)
        cases.append({
            "prompt": prompt,
            "prompt_token_ids": prompt_ids,
            "greedy_token_ids": out,
            "greedy_text": greedy_text,
            "last_logits": f32_list(first),
            "step_logits_argmax_margin": margins,
        })

    # Cross-check: sdpa attention + KV cache (another summation order) must give the same tokens.
    other = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=spec.get("kv_check_attn", "sdpa")).eval()
    worst = 0.0
    for c in cases:
        first, toks = greedy_cached(other, c["prompt_token_ids"], N_GREEDY)
        assert toks == c["greedy_token_ids"], (name, c["prompt"], toks, c["greedy_token_ids"])
        worst = max(worst, float((first - torch.tensor(c["last_logits"])).abs().max()))
    checks = {"sdpa_kv_cache_same_tokens_last_logits_max_abs_diff": worst}
    del other

    rope = getattr(model.config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        checks.update(check_longrope_cases(name, model, cases))
        checks.update(record_longrope_crossing(folder, model, tok))

    long_len = len(cases[3]["prompt_token_ids"])
    assert long_len > 2 * PREFILL_BLOCK, (name, long_len)

    if spec.get("gemma"):
        checks.update(check_gemma(folder, model, tok, spec))
    elif spec["config"].get("sliding_window"):
        checks.update(check_sliding_window(folder, model, tok, spec["config"]["sliding_window"]))

    golden = {
        "model": name,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__,
        "safetensors_version": safetensors.__version__,
        "seed": spec["seed"],
        "cases": cases,
    }
    with open(os.path.join(folder, "golden.json"), "w", encoding="utf-8") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")

    mins = [min(c["step_logits_argmax_margin"]) for c in cases]
    return {
        "name": name,
        "vocab_size": len(tok),
        "prompt_lens": [len(c["prompt_token_ids"]) for c in cases],
        "min_margin": min(mins),
        "min_margin_per_prompt": mins,
        "distinct_greedy": [len(set(c["greedy_token_ids"])) for c in cases],
        "checks": checks,
    }


def check_longrope_cases(name, model, cases):
    """transformers picks LongRoPE's long factors per forward call, when the call's last position
    passes original_max_position_embeddings; a KV cache keeps the keys rotated before. The goldens
    recompute every position (full forward), so no case may cross the boundary while generating
    (the sdpa + KV-cache check above would fail too): each prompt is either longer than the
    boundary, or stays within it for all its greedy steps. Both kinds must occur."""
    original = model.config.rope_parameters["original_max_position_embeddings"]
    assert original == PHI3_ORIGINAL, (name, original)
    lens = [len(c["prompt_token_ids"]) for c in cases]
    for n in lens:
        assert n > original or n + N_GREEDY - 1 <= original, (name, n, original)
    assert any(n > original for n in lens) and any(n <= original for n in lens), (name, lens, original)
    return {"longrope_original_max_position_embeddings": original,
            "longrope_prompts_using_long_factors": sum(n > original for n in lens)}


LONGROPE_CROSSING_STEPS = 120


@torch.no_grad()
def record_longrope_crossing(folder, model, tok):
    """What transformers computes when a sequence crosses LongRoPE's boundary while decoding with
    a KV cache: the prompt (within the boundary) is prefilled with the short factors, each later
    forward call takes the long factors once its position passes the boundary, and the cached keys
    keep their short-factor rotation. Greedy through the cache (eager attention, plain forward
    calls: not `generate`, whose Phi-3 override drops the cache at the crossing) from the code
    prompt, past the boundary; writes kv_cache_crossing.json with the tokens, every step's margin
    and the logits of the last step, which Kiln's KV cache must reproduce."""
    original = model.config.rope_parameters["original_max_position_embeddings"]
    ids = tok(PROMPTS[2])["input_ids"]
    n = LONGROPE_CROSSING_STEPS
    assert len(ids) <= original < len(ids) + n - 1, (len(ids), original)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True)
    past, logits = getattr(out, key), out.logits[0, -1]
    toks, margins = [], []
    for _ in range(n):
        nxt = int(torch.argmax(logits))
        toks.append(nxt)
        margins.append(margin(logits))
        out = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), use_cache=True, **{key: past})
        past, logits = getattr(out, key), out.logits[0, -1]
    assert min(margins) >= MIN_MARGIN, ("crossing margins", min(margins))
    # The crossing matters: recomputing the whole sequence (every key with the long factors)
    # gives other logits at the last step.
    full = last_logits(model, ids + toks)
    recompute_diff = float((full - logits).abs().max())
    assert recompute_diff > 1e-3, recompute_diff
    record = {
        "prompt": PROMPTS[2],
        "prompt_token_ids": ids,
        "original_max_position_embeddings": original,
        "greedy_token_ids": toks,
        "step_logits_argmax_margin": margins,
        "final_logits": f32_list(logits),
        "final_position": len(ids) + n - 1,
    }
    with open(os.path.join(folder, "kv_cache_crossing.json"), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return {"longrope_crossing_min_margin": min(margins),
            "longrope_crossing_vs_full_recompute_last_logits_max_abs_diff": recompute_diff}


@torch.no_grad()
def check_sliding_window(folder, model, tok, window):
    """HF must really apply the window in float32 eager attention: the long prompt's logits must
    change when the window is removed, and a prompt of exactly `window` tokens must not."""
    full = load_f32(folder, sliding_window=None)
    assert full.config.sliding_window is None
    long_ids = tok(PROMPTS[3])["input_ids"]
    a, b = last_logits(model, long_ids), last_logits(full, long_ids)
    long_diff = float((a - b).abs().max())
    assert long_diff > 1e-3, f"sliding window not applied (max |diff| {long_diff})"
    # window semantics: query i sees keys j with i - window < j <= i
    n_eq = last_logits(model, long_ids[:window]), last_logits(full, long_ids[:window])
    n_gt = last_logits(model, long_ids[: window + 1]), last_logits(full, long_ids[: window + 1])
    eq_diff = float((n_eq[0] - n_eq[1]).abs().max())
    gt_diff = float((n_gt[0] - n_gt[1]).abs().max())
    assert eq_diff == 0.0, f"window={window} tokens should match full attention ({eq_diff})"
    assert gt_diff > 0.0, f"window+1 tokens should differ from full attention ({gt_diff})"
    # sdpa applies the same window (up to rounding)
    sdpa = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    sdpa_diff = float((last_logits(sdpa, long_ids) - a).abs().max())
    assert sdpa_diff < 1e-3, f"sdpa and eager disagree on the sliding window ({sdpa_diff})"
    return {
        "sliding_window_sdpa_vs_eager_long_prompt_diff": sdpa_diff,
        "sliding_window_long_prompt_max_abs_logit_diff": long_diff,
        "sliding_window_len_eq_window_diff": eq_diff,
        "sliding_window_len_window_plus_1_diff": gt_diff,
    }


@torch.no_grad()
def check_gemma(folder, model, tok, spec):
    """The Gemma features must matter in transformers' float32 eager reference: the sliding window
    (a window larger than any prompt changes the long prompt's logits, not a prompt of exactly
    `window` tokens, but one of `window + 1`), each soft cap, and, in Gemma 3, the separate RoPE of
    the sliding layers."""
    window = spec["config"]["sliding_window"]
    long_ids = tok(PROMPTS[3])["input_ids"]
    base = last_logits(model, long_ids)

    def diff(ids, **overrides):
        other = load_f32(folder, **overrides)
        return float((last_logits(other, ids) - last_logits(model, ids)).abs().max())

    out = {"sliding_window_long_prompt_max_abs_logit_diff": diff(long_ids, sliding_window=4 * MAX_POS)}
    assert out["sliding_window_long_prompt_max_abs_logit_diff"] > 1e-3, out
    out["sliding_window_len_eq_window_diff"] = diff(long_ids[:window], sliding_window=4 * MAX_POS)
    out["sliding_window_len_window_plus_1_diff"] = diff(long_ids[: window + 1], sliding_window=4 * MAX_POS)
    assert out["sliding_window_len_eq_window_diff"] == 0.0, out
    assert out["sliding_window_len_window_plus_1_diff"] > 0.0, out
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if spec["config"].get(key):
            out[f"{key}_removed_diff"] = diff(long_ids, **{key: None})
            assert out[f"{key}_removed_diff"] > 1e-3, out
    rope = spec["config"]["rope_parameters"]
    if "sliding_attention" in rope:
        same = {"full_attention": rope["full_attention"], "sliding_attention": rope["full_attention"]}
        out["sliding_rope_as_full_diff"] = diff(long_ids, rope_parameters=same)
        assert out["sliding_rope_as_full_diff"] > 1e-3, out
    assert torch.isfinite(base).all()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures"))
    ap.add_argument("--only", default=",".join(MODELS))
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # same summation order whatever the machine's core count

    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"tokenizers {tokenizers.__version__}, safetensors {safetensors.__version__}")
    failed = False
    overall = math.inf
    for name in args.only.split(","):
        r = make_one(name, MODELS[name], args.out)
        overall = min(overall, r["min_margin"])
        print(f"{name}: vocab {r['vocab_size']}, prompt tokens {r['prompt_lens']}, "
              f"min margin {r['min_margin']:.6f} (per prompt {[round(m, 6) for m in r['min_margin_per_prompt']]}), "
              f"distinct greedy tokens {r['distinct_greedy']}")
        for k, v in r["checks"].items():
            print(f"  {k}: {v}")
        if r["min_margin"] < MIN_MARGIN:
            print(f"ERROR: {name}: greedy margin {r['min_margin']} < {MIN_MARGIN}; change the seed or prompts",
                  file=sys.stderr)
            failed = True
    print(f"minimum greedy margin over all models: {overall:.6f}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
