"""OpenVINO GenAI as a peer engine of scripts/bench_peers.py.

Import it by path, as bench_peers.py does (the scripts keep their own folder off sys.path).

OpenVINO lives in a virtual environment of its own, created on first use under
$KILN_SCRIPTS_CACHE (`openvino-<version>-venv`, the versions pinned in PINS): optimum-intel
needs a transformers older than the one the repository's tests need in the main environment.
The Hugging Face folder is exported once with `optimum-cli export openvino --weight-format fp16`
(a stateful model: its KV cache is model state, which the SDPA backend needs), cached by the
folder's content hash. Each measurement is then one fresh process that runs
`openvino_genai.LLMPipeline` on the CPU with the SDPA attention backend (the stateful pipeline:
no paged attention, no continuous batching, no prefix cache), Kiln's thread count, arithmetic
precision and KV cache type, on Kiln's prompt token ids, decoding greedily with EOS ignored.

Whatever goes wrong (setup, export, a pipeline that does not support the architecture) raises
NotRun with a one-line reason, so that the table says so instead of showing a number.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

OPENVINO_VERSION = "2026.4.1"
OPTIMUM_INTEL_VERSION = "2.2.0"
# Verified together on Python 3.11. transformers 5.2: optimum-intel exports Qwen3.5 only with
# 5.2.x (and needs < 5.6). torch and torchvision only serve the export (PyPI's build:
# download.pytorch.org, where the CPU-only build lives, is not always reachable).
PINS = [
    f"openvino=={OPENVINO_VERSION}",
    f"openvino-genai=={OPENVINO_VERSION}.0",
    f"openvino-tokenizers=={OPENVINO_VERSION}.0",
    f"optimum-intel=={OPTIMUM_INTEL_VERSION}",
    "optimum==2.3.0",
    "nncf==3.4.0",
    "transformers==5.2.0",
    "torch==2.15.0",
    "torchvision==0.29.2",
]

# Kiln's --precision as OpenVINO's INFERENCE_PRECISION_HINT. It must be given: on CPUs with
# AVX512_BF16 or AMX the CPU plugin's default is bf16. Kiln's q8 has no counterpart.
INFERENCE_PRECISION = {"exact": "f32", "bf16": "bf16"}

# Exports are keyed by the pins too: another exporter may write another model.
PINS_TAG = hashlib.sha256("\n".join(PINS).encode()).hexdigest()[:8]


class NotRun(Exception):
    """OpenVINO has no number in this table; the message is the one-line reason."""


def skip_reason(model, precision, quant, avx2):
    """Why OpenVINO cannot take part in this comparison at all, or None."""
    if model.suffix == ".gguf":
        return "the input is a GGUF file; OpenVINO is exported from a Hugging Face folder"
    if quant:
        return f"--quant {quant} is llama.cpp's quantisation, which OpenVINO does not read"
    if precision not in INFERENCE_PRECISION:
        return f"--precision {precision} is unsupported (OpenVINO has f32 and bf16 arithmetic over fp16 weights)"
    if avx2:
        return ("--avx2: release builds of OpenVINO cap only oneDNN to AVX2 (ONEDNN_MAX_CPU_ISA), "
                "not their own kernels (OV_CPU_MAX_ISA is for debug builds)")
    return None


def one_line(output):
    """The reason in a failed process's output, on one line: from the last line that names an
    exception (Python's, or OpenVINO's multi-line messages under it) to the end, else the last
    line."""
    lines = [l.strip() for l in output.strip().splitlines() if l.strip()]
    if not lines:
        return "no output"
    start = len(lines) - 1
    for i, line in enumerate(lines):
        if re.match(r"[\w.]*(Error|Exception)\b", line):
            start = i
    text = " ".join(lines[start:])
    return text if len(text) <= 300 else text[:297] + "..."


def venv_env():
    """The environment of the venv's processes: no PYTHONPATH (the main environment's packages
    must not leak in) and no Hugging Face hub (models come from local folders)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return env


def checked(cmd, what):
    """Runs `cmd`, raising NotRun with the reason from its output when it fails."""
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=venv_env())
    if r.returncode != 0:
        raise NotRun(f"{what} failed (exit {r.returncode}): {one_line(r.stderr + r.stdout)}")
    return r


def ensure_venv(venv, log):
    """The venv's python, the venv created and filled with PINS on first use. The list of pins is
    written into it last, so that a venv an interrupted install left behind, or one of other
    pins, is built again rather than used."""
    python = venv / "bin" / "python"
    marker = venv / "kiln-pins.txt"
    if marker.exists() and marker.read_text() == "\n".join(PINS):
        return python
    shutil.rmtree(venv, ignore_errors=True)
    log(f"creating {venv} for OpenVINO GenAI ({' '.join(PINS)}; minutes, about 6 GB with PyPI's torch)")
    checked([sys.executable, "-m", "venv", venv], "creating the OpenVINO venv")
    checked([python, "-m", "pip", "install", "-q", *PINS], "pip install of OpenVINO")
    marker.write_text("\n".join(PINS))
    return python


def export(python, model_dir, out, log):
    """`model_dir` exported by optimum-intel to an OpenVINO model with fp16 weights in `out`,
    once: written to a sibling folder and renamed only when the export succeeded."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"exporting {model_dir} to OpenVINO (fp16 weights) in {out}")
    try:
        checked([python.parent / "optimum-cli", "export", "openvino", "--model", model_dir,
                 "--task", "text-generation-with-past", "--weight-format", "fp16", tmp], "optimum-cli export")
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


RUNNER = r"""
import json, sys
import numpy as np
import openvino as ov
import openvino_genai as ov_genai
path, threads, prompt, gen = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
precision, kv = sys.argv[5], sys.argv[6]
pipe = ov_genai.LLMPipeline(path, "CPU", ATTENTION_BACKEND="SDPA", INFERENCE_NUM_THREADS=threads,
                            INFERENCE_PRECISION_HINT=precision, KV_CACHE_PRECISION=kv,
                            DYNAMIC_QUANTIZATION_GROUP_SIZE=0)
# The first token comes from prefill, then `gen` decode steps, as in kiln bench; TPOT is the
# mean time of those steps (the first token is not in it).
config = ov_genai.GenerationConfig(max_new_tokens=gen + 1, ignore_eos=True, do_sample=False)
ids = ov.Tensor(np.array([prompt], dtype=np.int64))
def once():
    result = pipe.generate(ids, config)
    made = len(result.tokens[0])
    if made != gen + 1:
        sys.exit(f"RuntimeError: generated {made} tokens, not {gen + 1}")
    m = result.perf_metrics
    return len(prompt) * 1000 / m.get_ttft().mean, 1000 / m.get_tpot().mean
once()  # warm-up, as kiln bench does
p, d = once()
print(json.dumps({"prefill_tok_s": p, "decode_tok_s": d}))
"""


class OpenVINO:
    """The exported model and the venv that runs it."""

    def __init__(self, work, model_dir, digest, source_dtype, log):
        self.python = ensure_venv(work / f"openvino-{OPENVINO_VERSION}-venv", log)
        self.source_dtype = source_dtype
        out = work / "openvino" / f"{model_dir.name}-{digest}-fp16-{PINS_TAG}"
        self.model = export(self.python, model_dir, out, log)

    def run(self, threads, prompt, gen, precision, kv_dtype):
        """One fresh process: a warm-up generation, then the measured one."""
        r = subprocess.run([str(self.python), "-c", RUNNER, str(self.model), str(threads), json.dumps(prompt),
                            str(gen), INFERENCE_PRECISION[precision], kv_dtype],
                           capture_output=True, text=True, env=venv_env())
        if r.returncode != 0:
            raise NotRun(f"LLMPipeline failed (exit {r.returncode}): {one_line(r.stderr)}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def describe(self, precision, kv_dtype):
        """The header line that says how OpenVINO ran."""
        return (f"GenAI {OPENVINO_VERSION} reads `{self.model.name}`: fp16 weights converted from "
                f"{self.source_dtype} by optimum-intel {OPTIMUM_INTEL_VERSION} (`--weight-format fp16`); "
                f"LLMPipeline on CPU, ATTENTION_BACKEND SDPA (stateful: no paged attention, no prefix cache), "
                f"INFERENCE_PRECISION_HINT {INFERENCE_PRECISION[precision]}, KV_CACHE_PRECISION {kv_dtype}, "
                f"DYNAMIC_QUANTIZATION_GROUP_SIZE 0, EOS ignored; prefill = prompt / TTFT, "
                f"decode = 1 / TPOT (the decode steps after the first token); pins: {', '.join(PINS)}")
