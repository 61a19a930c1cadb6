#!/usr/bin/env python3
"""GGUF versions of the tiny golden models, made by llama.cpp's own tools.

    python3 scripts/make_gguf_golden.py [--only NAME[,NAME...]]

Converts tests/fixtures/{llama,qwen2,...} (see CONVERTED: Hugging Face folders with goldens from
transformers, see make_golden.py) to GGUF with llama.cpp's `convert_hf_to_gguf.py` (bf16: the
weights are exactly the safetensors' bf16 values, and llama-architecture q/k rows are permuted
the way every llama.cpp file is), then quantises the llama one with llama.cpp's quantiser to
Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1. Writes tests/fixtures/gguf/. The Rust tests check that the bf16
files reproduce the transformers goldens (so the permutation is undone correctly) and that the
quantised kernels give the same numbers as dequantising at load.

Converting needs only llama.cpp's sources (the `llama-cpp-python` source distribution, fetched
from PyPI by llama_cpp_sources.py), `gguf`, `sentencepiece`, `torch` and `transformers`; the
quantised files also need the installed `llama-cpp-python` (its quantiser), and are skipped with
a message when it is absent.
"""

import os as _os
import sys as _sys

# scripts/profile.py would shadow the standard library's `profile` (torch imports it):
# keep this folder off the module path before anything else is imported.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import ctypes
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gguf"


def llama_cpp_sources(version):
    import importlib.util
    spec = importlib.util.spec_from_file_location("llama_cpp_sources", pathlib.Path(__file__).resolve().parent / "llama_cpp_sources.py")
    sources = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sources)
    return sources.llama_cpp_dir(version)


# The llama-cpp-python release whose vendored llama.cpp converts (and, installed, quantises).
LLAMA_CPP_PYTHON = "0.3.36"

# The fixtures converted, each with the `tokenizer.ggml.pre` name its byte-level tokenizer follows
# (None: a SentencePiece vocabulary, which has no pre-tokenizer type). Our tiny fixtures use
# tokenizers trained for the tests, whose pre-tokenizer hashes llama.cpp's converter does not
# know, so the converter is told which scheme each follows. (Not mistral: llama.cpp's converter
# drops its sliding window, so the result would not be comparable with the transformers goldens.)
CONVERTED = {
    "llama": "qwen2",
    "qwen2": "qwen2",
    # Phi-3: llama.cpp's phi3 converter reads the SentencePiece tokenizer.model (and the added
    # tokens of tokenizer.json); it keeps the sliding window and writes the LongRoPE factors.
    "phi3": None,
    "phi3-longrope": None,
    "gpt2": "gpt-2",
    "phi": "phi-2",  # what the converter names phi-2's own tokenizer (GPT-2's regex)
    "gemma2": None,  # SentencePiece (tokenizer.model)
    "gemma3": None,
    # Qwen3.5 (Gated DeltaNet hybrid, llama.cpp's `qwen35`): the converter stores the (1 + w)
    # norms as 1 + w, A_log as -exp(A_log), the conv weight squeezed, the value heads reordered
    # "tiled" (this fixture has 4 value heads over 2 key heads) and one recurrent flag per layer.
    "qwen3_5": "qwen2",
}

# Extra converter options per fixture. Qwen3.5's converter expects multi-token-prediction layers
# (`mtp.*`, which the released checkpoints carry and transformers does not make) unless told there
# are none.
CONVERT_OPTIONS = {
    "qwen3_5": ["--no-mtp"],
}

CONVERT = r"""
import sys
pre = sys.argv[1]
sys.argv = sys.argv[2:]
sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])
import conversion.base as base
import convert_hf_to_gguf as c
if pre != "-":
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
c.main()
"""


def convert(src, name, llama_cpp_dir, outtype="bf16"):
    out = OUT / f"{name}-{outtype}.gguf"
    env = dict(os.environ, PYTHONPATH=str(llama_cpp_dir / "gguf-py"))
    pre = CONVERTED[name] or "-"
    subprocess.run([sys.executable, "-c", CONVERT, pre, str(llama_cpp_dir / "convert_hf_to_gguf.py"), str(src),
                    "--outtype", outtype, "--outfile", str(out), *CONVERT_OPTIONS.get(name, [])], check=True, env=env, stdout=subprocess.DEVNULL)
    return out


FUSE_QKV = r"""
import sys
import numpy as np
import gguf
src, out = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(src)
w = gguf.GGUFWriter(out, arch=r.fields["general.architecture"].contents())
for f in r.fields.values():
    if f.name == "general.architecture" or f.name.startswith("GGUF."):
        continue
    vtype = f.types[0]
    w.add_key_value(f.name, f.contents(), vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
by_name = {t.name: t for t in r.tensors}
for t in r.tensors:
    name = t.name
    if ".attn_k." in name or ".attn_v." in name:
        continue
    data, dtype = t.data, t.tensor_type
    if ".attn_q." in name:
        parts = [by_name[name.replace(".attn_q.", f".attn_{p}.")].data for p in "qkv"]
        data = np.concatenate(parts, axis=0)  # rows (outermost) of q, then k, then v
        name = name.replace(".attn_q.", ".attn_qkv.")
    w.add_tensor(name, data, raw_dtype=dtype)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
"""


def fuse_qkv(src, out, llama_cpp_dir):
    """A copy of `src` with each layer's attn_q/k/v weights and biases stored as one attn_qkv
    tensor (rows of q, then k, then v), as llama.cpp's converter writes the original phi-2
    checkpoints (`mixer.Wqkv`), written with gguf-py."""
    env = dict(os.environ, PYTHONPATH=str(llama_cpp_dir / "gguf-py"))
    subprocess.run([sys.executable, "-c", FUSE_QKV, str(src), str(out)], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return out


def quantize(src, ftype_name):
    import llama_cpp
    out = OUT / src.name.replace("-bf16", f"-{ftype_name.lower()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"quantising {src} to {ftype_name} failed ({rc})")
    return out


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(CONVERTED), help="fixtures to convert (default: all)")
    args = ap.parse_args()
    src_dir = llama_cpp_sources(LLAMA_CPP_PYTHON)
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        out = convert(ROOT / "tests" / "fixtures" / name, name, src_dir)
        print(out, out.stat().st_size)
        if name == "phi":
            fused = fuse_qkv(out, OUT / "phi-fused-qkv.gguf", src_dir)
            print(fused, fused.stat().st_size)
        if name == "llama":
            try:
                import llama_cpp
            except ImportError:
                print("llama-cpp-python is not installed: the quantised llama files are left as they are")
                continue
            assert llama_cpp.__version__ == LLAMA_CPP_PYTHON, llama_cpp.__version__
            for ftype in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]:
                out = quantize(OUT / "llama-bf16.gguf", ftype)
                print(out, out.stat().st_size)
    made = sorted(OUT.glob("*.gguf"))
    readme = OUT / "README.md"
    readme.write_text(
        "# GGUF golden fixtures\n\n"
        "Made by `python3 scripts/make_gguf_golden.py` with llama.cpp's own converter and quantiser "
        f"(llama-cpp-python {LLAMA_CPP_PYTHON}) from the Hugging Face fixtures next to this folder:\n\n"
        + "".join(f"- `{p.name}` ({p.stat().st_size} bytes)\n" for p in made)
        + "\nThe `-bf16` files hold exactly the safetensors weights (llama-architecture q/k rows permuted as "
        "llama.cpp permutes them), so Kiln must reproduce the transformers goldens of the source folder. The "
        "quantised files check Kiln's quantised kernels against dequantising at load. `phi-fused-qkv.gguf` is "
        "`phi-bf16.gguf` rewritten by gguf-py with each layer's q, k and v in one `attn_qkv` tensor, the form "
        "llama.cpp's converter gives the original phi-2 checkpoints (`mixer.Wqkv`). `qwen3_5-bf16.gguf` (llama.cpp's "
        "`qwen35`, converted with `--no-mtp`) holds the converter's forms of the Gated DeltaNet tensors: `1 + w` norms "
        "(not `ssm_norm`), `ssm_a` = -exp(A_log), the conv weight squeezed, the 4 value heads reordered from grouped "
        "to tiled over the 2 key heads, and one recurrent flag per layer (`qwen35.attention.recurrent_layers`).\n")


if __name__ == "__main__":
    main()
