#!/usr/bin/env python3
"""How far `transformers` float32's own prefill and decode of one prompt differ on a recurrent
fixture: its prefill runs the Gated DeltaNet in chunks (`torch_chunk_gated_delta_rule`), its
decode one token at a time (`torch_recurrent_gated_delta_rule`). Kiln does the same, and
`tests/common/goldens.rs::split_bound` is judged against this figure.

    python3 scripts/recurrent_split_reference.py tests/fixtures/qwen3_5

Prints the largest difference over all positions of the longest golden prompt (the logits of
prefilling it whole against prefilling its first token and decoding the rest) and the
difference at the positions the golden tests compare.
"""
import os as _os
import sys

# scripts/profile.py would shadow the standard library's `profile` (torch imports it).
_here = _os.path.dirname(_os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if _os.path.abspath(p or '.') != _here]

import json  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    folder = sys.argv[1]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with open(f"{folder}/golden.json") as f:
        cases = json.load(f)["cases"]
    ids = max((c["prompt_token_ids"] for c in cases), key=len)
    with torch.no_grad():
        whole = model(torch.tensor([ids])).logits[0]
        out = model(torch.tensor([ids[:1]]), use_cache=True)
        decoded = [out.logits[0, -1]]
        for t in ids[1:]:
            out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
            decoded.append(out.logits[0, -1])
    diff = (whole - torch.stack(decoded)).abs().max(dim=-1).values
    print(f"{folder}: {len(ids)} tokens, prefill vs decode max |diff| = {diff.max().item():.3e}")
    for t in [1, 7, 63, 64, 65, 130, len(ids) - 1]:
        print(f"  position {t}: {diff[t].item():.3e}")


if __name__ == "__main__":
    main()
