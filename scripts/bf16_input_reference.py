#!/usr/bin/env python3
"""How far transformers' own logits move when every matmul input is rounded to bf16.

    python3 scripts/bf16_input_reference.py tests/fixtures/qwen3_5

`--precision bf16` rounds the activations to bf16 at each matmul over bf16 weights; this runs a
fixture's golden prompts through transformers in float32 with every `nn.Linear` input rounded
the same way and prints, per case, the largest |logit difference| at the last prompt position
from the recorded float32 goldens. It is the independent yardstick for the bounds in
tests/precision.rs (pinned versions: scripts/requirements-golden.txt).
"""

import os as _os
import sys as _sys

# scripts/profile.py would shadow the standard library's `profile` (torch imports it).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import json  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    folder = sys.argv[1]
    golden = json.load(open(f"{folder}/golden.json"))
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()

    def rounded_input(self, x):
        return F.linear(x.to(torch.bfloat16).to(torch.float32), self.weight, self.bias)

    torch.nn.Linear.forward = rounded_input
    worst = 0.0
    for i, case in enumerate(golden["cases"]):
        with torch.no_grad():
            logits = model(torch.tensor([case["prompt_token_ids"]])).logits[0, -1]
        diff = (logits - torch.tensor(case["last_logits"])).abs().max().item()
        worst = max(worst, diff)
        print(f"case {i}: max |logit diff| {diff:.4f}")
    print(f"worst: {worst:.4f}")


if __name__ == "__main__":
    main()
