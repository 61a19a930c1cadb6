#!/usr/bin/env python3
"""Greedy output of Kiln and llama.cpp on the same GGUF file, token by token.

    python3 scripts/compare_llama_cpp.py MODEL.gguf [--tokens 32] [--kiln target/release/kiln]
                                         [--prompt TEXT ...] [--chat] [--out report.md]

For each prompt both engines start from the same token ids (Kiln's tokenisation, which the GGUF
tests check equals llama.cpp's) and decode greedily for a fixed number of tokens without
stopping at EOS. Where the continuations first differ, the report gives the position, both
tokens, and each engine's logit margin there (top-1 minus top-2 of its own logits): a small
margin means the two engines' (legitimately different) arithmetic decided a near-tie. llama.cpp
quantises activations to 8 bits in its quantised dot products while Kiln keeps them in f32, so
near-ties can go either way. At each difference the float32 reference (transformers on the
file's dequantised weights, as in compare_layers.py) says which token it prefers.

Needs `llama-cpp-python`, `gguf`, `torch` and `transformers` (PyPI).
"""

import os as _os
import sys as _sys

# scripts/profile.py would shadow the standard library's `profile` (torch imports it):
# keep this folder off the module path before anything else is imported.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import argparse
import datetime
import json
import subprocess
import sys

import numpy as np

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "def fibonacci(n):",
]


def kiln_greedy(kiln, model, prompt, tokens, chat):
    cmd = [kiln, "run", model, "--prompt", prompt, "--temperature", "0", "--max-tokens", str(tokens), "--ignore-eos",
           "--json", "-q"]
    if chat:
        cmd.append("--chat")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kiln run failed: {r.stderr}")
    j = json.loads(r.stdout)
    return j["prompt_token_ids"], j["token_ids"]


def load_compare_layers():
    import importlib.util
    spec = importlib.util.spec_from_file_location("compare_layers", _os.path.join(_here, "compare_layers.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kiln_logits(kiln, model, ids):
    r = subprocess.run([kiln, "debug", model, "--ids", ",".join(map(str, ids))], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kiln debug failed: {r.stderr}")
    return np.array(json.loads(r.stdout)["logits"], dtype=np.float64)


def margin(logits):
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def last_logits(llm):
    """The logits of the last evaluated token (llama-cpp-python keeps them only with
    logits_all, which would also compute every prompt position's)."""
    import llama_cpp
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).astype(np.float64)


def llama_greedy(llm, prompt_ids, tokens):
    llm.reset()
    llm.eval(prompt_ids)
    out, margins = [], []
    for _ in range(tokens):
        logits = last_logits(llm)
        tok = int(np.argmax(logits))
        out.append(tok)
        margins.append(margin(logits))
        llm.eval([tok])
    return out, margins


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--prompt", action="append", help="prompt (repeatable); default: a fixed set of four")
    ap.add_argument("--chat", action="store_true", help="send each prompt as a user turn through the chat template")
    ap.add_argument("--out")
    args = ap.parse_args()

    from llama_cpp import Llama, __version__ as llama_version
    llm = Llama(model_path=args.model, n_ctx=2048, n_threads=2, verbose=False, logits_all=False)
    lines = [
        f"# Greedy output: Kiln vs llama.cpp — `{args.model.split('/')[-1]}`",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- llama.cpp: llama-cpp-python {llama_version}; Kiln: `{args.kiln}` (quantised kernels, f32 activations)",
        f"- {args.tokens} tokens per prompt, greedy, EOS ignored, {'chat template' if args.chat else 'raw prompts'}; "
        "both engines start from the same prompt token ids",
        "",
        "| prompt | identical tokens | first difference at | Kiln token / margin | llama.cpp token / margin | float32 reference prefers |",
        "|---|---:|---:|---|---|---|",
    ]
    layers = load_compare_layers()
    reference, _ = layers.build_reference(args.model)
    details = []
    for prompt in args.prompt or PROMPTS:
        prompt_ids, kiln_out = kiln_greedy(args.kiln, args.model, prompt, args.tokens, args.chat)
        llama_out, llama_margins = llama_greedy(llm, prompt_ids, args.tokens)
        same = next((i for i, (a, b) in enumerate(zip(kiln_out, llama_out)) if a != b), None)
        if same is None:
            lines.append(f"| {prompt!r} | {args.tokens}/{args.tokens} | — | — | — | — |")
        else:
            context = prompt_ids + kiln_out[:same]
            logits = kiln_logits(args.kiln, args.model, context)
            _, ref_logits = layers.reference_residuals(reference, context)
            ref = int(np.argmax(ref_logits))
            who = "Kiln's" if ref == kiln_out[same] else "llama.cpp's" if ref == llama_out[same] else f"neither ({ref})"
            lines.append(f"| {prompt!r} | {same}/{args.tokens} | {same} | {kiln_out[same]} / {margin(logits):.4f} | "
                         f"{llama_out[same]} / {llama_margins[same]:.4f} | {who} (margin {margin(ref_logits):.4f}) |")
        text_k = llm.detokenize(kiln_out).decode(errors="replace")
        text_l = llm.detokenize(llama_out).decode(errors="replace")
        details += [f"**{prompt!r}**", "", f"- Kiln: {text_k!r}", f"- llama.cpp: {text_l!r}", ""]
    text = "\n".join(lines + ["", "## Continuations", ""] + details)
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
