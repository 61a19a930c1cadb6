#!/usr/bin/env python3
"""GGUF versions of the tiny golden models, made by llama.cpp's own tools.

    python3 scripts/make_gguf_golden.py

Converts tests/fixtures/{llama,qwen2} (Hugging Face folders with goldens from
transformers, see make_golden.py) to GGUF with llama.cpp's `convert_hf_to_gguf.py` (bf16: the
weights are exactly the safetensors' bf16 values, and llama-architecture q/k rows are permuted
the way every llama.cpp file is), then quantises the llama one with llama.cpp's quantiser to
Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1. Writes tests/fixtures/gguf/. The Rust tests check that the bf16
files reproduce the transformers goldens (so the permutation is undone correctly) and that the
quantised kernels give the same numbers as dequantising at load.

Needs `llama-cpp-python` (PyPI; provides the quantiser and, in its source distribution,
convert_hf_to_gguf.py), `gguf`, `sentencepiece`, `torch`, `transformers`.
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


# Our tiny fixtures use tokenizers trained for the tests, whose pre-tokenizer hashes llama.cpp's
# converter does not know; they follow Qwen2's byte-level scheme, so name that one.
CONVERT = r"""
import sys
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])
import conversion.base as base
import convert_hf_to_gguf as c
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
c.main()
"""


def convert(src, name, llama_cpp_dir, outtype="bf16"):
    out = OUT / f"{name}-{outtype}.gguf"
    env = dict(os.environ, PYTHONPATH=str(llama_cpp_dir / "gguf-py"))
    subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp_dir / "convert_hf_to_gguf.py"), str(src),
                    "--outtype", outtype, "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL)
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
    import llama_cpp
    src_dir = llama_cpp_sources(llama_cpp.__version__)
    OUT.mkdir(parents=True, exist_ok=True)
    made = []
    # Not mistral: llama.cpp's converter drops its sliding window, so the result would not be
    # comparable with the transformers goldens.
    for name in ["llama", "qwen2"]:
        made.append(convert(ROOT / "tests" / "fixtures" / name, name, src_dir))
    for ftype in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]:
        made.append(quantize(OUT / "llama-bf16.gguf", ftype))
    readme = OUT / "README.md"
    readme.write_text(
        "# GGUF golden fixtures\n\n"
        "Made by `python3 scripts/make_gguf_golden.py` with llama.cpp's own converter and quantiser "
        f"(llama-cpp-python {llama_cpp.__version__}) from the Hugging Face fixtures next to this folder:\n\n"
        + "".join(f"- `{p.name}` ({p.stat().st_size} bytes)\n" for p in made)
        + "\nThe `-bf16` files hold exactly the safetensors weights (llama-architecture q/k rows permuted as "
        "llama.cpp permutes them), so Kiln must reproduce the transformers goldens of the source folder. The "
        "quantised files check Kiln's quantised kernels against dequantising at load.\n")
    for p in made:
        print(p, p.stat().st_size)


if __name__ == "__main__":
    main()
