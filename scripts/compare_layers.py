#!/usr/bin/env python3
"""Layer-by-layer numerical check of Kiln against a float32 reference, in the manner of SipLLM's
golden compare.

    python3 scripts/compare_layers.py MODEL.gguf --prompt "..." [--chat] [--kiln target/release/kiln]
                                      [--dequantize f32] [--out report.md]

The reference is Hugging Face `transformers` in float32, built from the GGUF file itself: every
tensor is dequantised with the `gguf` package (independently of Kiln's dequantisers), the
llama-architecture q/k rows are put back from llama.cpp's RoPE order into Hugging Face's, and the
model is run with forward hooks capturing the residual stream after the embedding and after each
decoder layer. Kiln (`kiln debug --all-tokens`) processes the very same token ids. For each layer
the script reports max |Δ|, the largest |Δ| relative to the reference's largest magnitude, and the
cosine similarity over all tokens, then the same for the logits; a Markdown report is printed and,
with --out, written.
"""

import os as _os
import sys as _sys

# scripts/profile.py would shadow the standard library's `profile` (torch imports it):
# keep this folder off the module path before anything else is imported.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import argparse
import datetime
import importlib.metadata
import json
import subprocess
import sys

import numpy as np


def read_gguf(path):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    r = GGUFReader(path)

    def meta(key, default=None):
        f = r.fields.get(key)
        if f is None:
            return default
        v = f.parts[f.data[0]]
        if f.types and f.types[0].name == "STRING":
            return bytes(v).decode()
        return v.tolist()[0] if len(v) == 1 else v.tolist()

    tensors = {}
    for t in r.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists innermost first
        tensors[t.name] = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
    return meta, tensors


def unpermute(w, n_head):
    # llama.cpp: w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build_reference(path):
    import torch
    import transformers
    meta, t = read_gguf(path)
    arch = meta("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        sys.exit(f"unsupported architecture {arch}")
    p = lambda k, d=None: meta(f"{arch}.{k}", d)
    n_head, n_kv = p("attention.head_count"), p("attention.head_count_kv")
    hidden = p("embedding_length")
    head_dim = p("attention.key_length", hidden // n_head)
    vocab = t["token_embd.weight"].shape[0]
    tied = "output.weight" not in t
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=p("feed_forward_length"),
                  num_hidden_layers=p("block_count"), num_attention_heads=n_head, num_key_value_heads=n_kv,
                  head_dim=head_dim, max_position_embeddings=p("context_length"),
                  rms_norm_eps=p("attention.layer_norm_rms_epsilon"), rope_theta=p("rope.freq_base", 10000.0),
                  tie_word_embeddings=tied)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    config = cls(**common)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    per_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                 "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                 "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
                 "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    state = {}
    for name, w in t.items():
        if name in names:
            hf = names[name]
        elif name.startswith("blk."):
            _, i, part, kind = name.split(".", 3)
            if part not in per_layer:
                continue
            hf = f"model.layers.{i}.{per_layer[part]}.{kind}"
            if arch == "llama" and part in ("attn_q", "attn_k"):
                w = unpermute(w, n_head if part == "attn_q" else n_kv)
        else:
            continue
        state[hf] = torch.from_numpy(np.ascontiguousarray(w))
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    if missing or unexpected:
        sys.exit(f"reference model mismatch: missing {missing}, unexpected {unexpected}")
    model.eval()
    return model, arch


def reference_residuals(model, ids):
    import torch
    captured = []
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, i, o: captured.append(o[0].detach().numpy()))]
    for layer in model.model.layers:
        hooks.append(layer.register_forward_hook(
            lambda m, i, o: captured.append((o[0] if isinstance(o, tuple) else o)[0].detach().numpy())))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].numpy()
    for h in hooks:
        h.remove()
    return captured, logits


def stats(a, b):
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    d = np.abs(a - b)
    cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))
    return float(d.max()), float(d.max() / (np.abs(b).max() + 1e-30)), cos


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--dequantize", choices=["f32", "bf16"], help="let Kiln dequantise at load instead of using its quantised kernels")
    ap.add_argument("--out")
    args = ap.parse_args()

    cmd = [args.kiln, "debug", args.model, "--prompt", args.prompt, "--all-tokens"]
    if args.chat:
        cmd.append("--chat")
    if args.dequantize:
        cmd += ["--dequantize", args.dequantize]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kiln debug failed: {r.stderr}")
    kiln = json.loads(r.stdout)
    ids = kiln["prompt_token_ids"]

    model, arch = build_reference(args.model)
    ref, ref_logits = reference_residuals(model, ids)
    if len(ref) != len(kiln["residuals"]):
        sys.exit(f"layer count differs: reference {len(ref)}, kiln {len(kiln['residuals'])}")

    mode = f"dequantised to {args.dequantize} at load" if args.dequantize else "quantised kernels"
    lines = [
        f"# Layer-by-layer check: `{args.model.split('/')[-1]}`",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- reference: transformers {__import__('transformers').__version__} float32 (eager attention), weights dequantised "
        f"by gguf-py {importlib.metadata.version('gguf')} from the same file"
        f"{', q/k rows un-permuted' if arch == 'llama' else ''}",
        f"- Kiln: {mode}; {len(ids)} prompt tokens ({'chat template' if args.chat else 'raw text'}): {args.prompt!r}",
        "",
        "| residual after | max abs diff | max diff / max abs | cosine |",
        "|---|---:|---:|---:|",
    ]
    for i, (k, rf) in enumerate(zip(kiln["residuals"], ref)):
        mx, rel, cos = stats(k, rf)
        label = "embedding" if i == 0 else f"layer {i - 1}"
        lines.append(f"| {label} | {mx:.3e} | {rel:.3e} | {cos:.9f} |")
    mx, rel, cos = stats(kiln["logits"], ref_logits)
    lines.append(f"| **logits (last token)** | {mx:.3e} | {rel:.3e} | {cos:.9f} |")
    top_k, top_r = int(np.argmax(kiln["logits"])), int(np.argmax(ref_logits))
    lines += ["", f"Next token: Kiln {top_k}, reference {top_r} ({'same' if top_k == top_r else 'DIFFERENT'}).", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
