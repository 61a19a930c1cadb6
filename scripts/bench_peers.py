#!/usr/bin/env python3
"""Kiln against llama.cpp and OpenVINO GenAI on the same model, same prompt tokens, same thread count.

    python3 scripts/bench_peers.py MODEL_DIR [--threads 2] [--prompt-tokens 148] [--gen-tokens 64]
                                   [--reps 5] [--rest 3] [--kiln target/release/kiln]
                                   [--quant Q4_K_M] [--avx2] [--kv-dtype f32|f16|bf16]
                                   [--precision exact|bf16|q8] [--no-openvino] [--no-phase-probe]

Sets up from PyPI what it needs (`llama-cpp-python`'s bindings without their native build, `gguf`,
and llama.cpp's sources and `convert_hf_to_gguf.py` from the llama-cpp-python source
distribution; llama.cpp itself is built here with cmake, `GGML_NATIVE` for this CPU or AVX2 only
with `--avx2`, once, cached under $KILN_SCRIPTS_CACHE), converts the
Hugging Face folder to GGUF at the same storage type (bf16 for bf16 weights; Qwen3.5 and
Qwen3-Next without their multi-token-prediction layers, `--no-mtp`), then measures the
engines interleaved: each repetition runs one fresh process per engine, the order rotated every
repetition, with a short rest between runs. Every engine gets the same synthetic prompt token ids
(the ones `kiln bench` uses) and decodes greedily for the same number of tokens.

OpenVINO GenAI (scripts/openvino_peer.py) runs from a venv of its own, made on first use under
$KILN_SCRIPTS_CACHE, on an fp16 export of the folder, with the SDPA attention backend and Kiln's
precision (f32 for exact, bf16 for bf16) and KV cache type. Where it cannot run (a GGUF input,
`--quant`, `--precision q8`, `--avx2`, a failed export or pipeline, `--no-openvino`) the table
says "OpenVINO: not run — <reason>" and the other two are measured all the same.

Writes a Markdown table (date, CPU, threads, load average, medians, Kiln's ratios to each peer)
to bench/results/ and prints it. Between every two runs it measures the read bandwidth
(`kiln probe`, about a second): the machines this runs on move between a fast and a slow memory
phase for minutes at a time (a 2-core Zen 5 EPYC: ~85 and ~50 GB/s), a bandwidth-bound decode
follows the phase and llama.cpp's less so, so the table also gives each phase's decode ratio
from the runs the probes before and after place in it. A GGUF file can be given instead of a
folder (then Kiln runs that same file too). `--quant FTYPE` quantises that GGUF with llama.cpp's own quantiser first
(`llama_model_quantize`, as `llama-quantize` does) and both engines read the quantised file.

`--avx2` compares the AVX2 code of both engines on any x86-64 machine: Kiln compiles with
`--target-cpu x86-64-v3`, and llama.cpp runs from a build of the same vendored sources made
here with cmake for AVX2 + FMA + F16C only (`GGML_NATIVE=OFF`, AVX-512 off; cached under
$KILN_SCRIPTS_CACHE, built once in about 10 minutes on 2 cores). Each table records the
instruction sets llama.cpp reports (`llama_print_system_info`).
"""

import os as _os
import sys as _sys

# scripts/profile.py would shadow the standard library's `profile` (torch imports it):
# keep this folder off the module path before anything else is imported.
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time
import importlib.util

ROOT = pathlib.Path(__file__).resolve().parent.parent
_machine_spec = importlib.util.spec_from_file_location("bench_machine", pathlib.Path(_here) / "bench_machine.py")
_machine = importlib.util.module_from_spec(_machine_spec)
_machine_spec.loader.exec_module(_machine)
cpu_name = _machine.cpu_name
_openvino_spec = importlib.util.spec_from_file_location("openvino_peer", pathlib.Path(_here) / "openvino_peer.py")
openvino_peer = importlib.util.module_from_spec(_openvino_spec)
_openvino_spec.loader.exec_module(openvino_peer)


def loadavg():
    return _machine.loadavg()[0]


WORK = pathlib.Path(os.environ.get("KILN_SCRIPTS_CACHE", pathlib.Path.home() / ".cache" / "kiln-scripts"))


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def pip_install(*pkgs):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *pkgs], check=True)


def ensure_llama_cpp():
    """llama-cpp-python's Python bindings (and `gguf`, `sentencepiece` for the converter); returns
    its version. The bindings are installed without their native build (`LLAMA_BUILD=OFF`, seconds
    instead of ~20 minutes): the libraries they load come from `llama_libs`, built here from the
    same version's vendored sources for the instruction set being compared."""
    import importlib.metadata
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        log("installing llama-cpp-python's bindings from PyPI (without its native build)")
        env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "llama-cpp-python==0.3.36"], check=True, env=env)
        version = importlib.metadata.version("llama-cpp-python")
    for module, package in (("gguf", "gguf"), ("sentencepiece", "sentencepiece")):
        # convert_hf_to_gguf.py imports sentencepiece before falling back to tokenizer.json for Qwen.
        try:
            __import__(module)
        except ImportError:
            pip_install(package)
    return version


def llama_cpp_dir(version):
    """llama.cpp's sources vendored in the llama-cpp-python sdist of this version
    (scripts/llama_cpp_sources.py, imported by path: this folder is kept off sys.path)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("llama_cpp_sources", pathlib.Path(_here) / "llama_cpp_sources.py")
    sources = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sources)
    return sources.llama_cpp_dir(version)


def converter(version):
    """llama.cpp's convert_hf_to_gguf.py from the llama-cpp-python sdist of this version."""
    return llama_cpp_dir(version) / "convert_hf_to_gguf.py"


def cmake_program():
    """A cmake (the system's, else the PyPI wheel's, installed on demand)."""
    found = shutil.which("cmake")
    if found:
        return found
    pip_install("cmake")
    beside = pathlib.Path(sys.executable).parent / "cmake"
    return str(beside) if beside.exists() else (shutil.which("cmake") or sys.exit("cmake not found after pip install"))


# llama.cpp's CPU backend per instruction set: `native` is what its own build picks for this CPU
# (GGML_NATIVE, as pip's build does); `avx2` is for AVX2 machines (Haswell and later, AMD Zen):
# no AVX-512, no VNNI.
LLAMA_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
             "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF"],
}


def host_cpu_tag():
    """A short hash of this CPU's identity (vendor, family, model, flags): a native build made on
    another CPU (the machine under this project changes between sessions) may use instructions
    this one lacks, or miss ones it has, so each CPU gets its own."""
    fields = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("vendor_id", "cpu family", "model", "model name", "flags"):
                    fields.append(line.strip())
                if not line.strip() and fields:
                    break
    except OSError:
        fields.append(platform.processor())
    return hashlib.sha256("\n".join(fields).encode()).hexdigest()[:8]


def llama_libs(version, isa):
    """The folder of libllama and its ggml libraries built for `isa` (`native` or `avx2`) from the
    sources llama-cpp-python `version` vendors (its Python bindings load them from there:
    LLAMA_CPP_LIB_PATH). The build's own `bin` folder, where cmake links them next to each
    other: copies elsewhere would still find their ggml libraries through the RUNPATH cmake
    gives them."""
    tag = f"{isa}-{host_cpu_tag()}" if isa == "native" else isa
    build = WORK / f"llama-cpp-{version}-{tag}-build"
    libs = build / "bin"
    if (libs / "libllama.so").exists():
        return libs
    src = llama_cpp_dir(version)
    cmake = cmake_program()
    log(f"building llama.cpp {version} ({isa}) in {build} (about 10 minutes on 2 cores)")
    subprocess.run([cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
                    "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", *LLAMA_FLAGS[isa]],
                   check=True, stdout=subprocess.DEVNULL)
    # libllama.so is linked last, so its presence means the build finished.
    subprocess.run([cmake, "--build", str(build), "--target", "llama", "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL)
    if not (libs / "libllama.so").exists():
        sys.exit(f"the {isa} build of llama.cpp made no {libs / 'libllama.so'}")
    return libs


QUANTISER = r"""
import sys, llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], sys.argv[3]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
sys.exit(llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params))
"""


def quantise(gguf_path, ftype, lib_dir):
    """`gguf_path` quantised to `ftype` (Q4_K_M, Q8_0, ...) by llama.cpp's own quantiser, cached."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    out = WORK / "gguf" / f"{gguf_path.stem}-{key}-{ftype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    log(f"quantising {gguf_path.name} to {ftype} with llama.cpp's quantiser")
    subprocess.run([sys.executable, "-c", QUANTISER, str(gguf_path), str(tmp), ftype], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib_dir)))
    tmp.rename(out)
    return out


def model_dtype(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    dt = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(dt, "bf16")


# Architectures whose converter (`_QwenMtpMixin`) expects multi-token-prediction layers (from
# `mtp_num_hidden_layers` or `mtp.*` tensors) and fails without them unless given --no-mtp. Kiln
# and this benchmark read the model without them either way.
NO_MTP_ARCHITECTURES = {"Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                        "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM"}


def converter_options(model_dir):
    """Extra options of convert_hf_to_gguf.py for this model."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = (cfg.get("architectures") or [""])[0]
    return ["--no-mtp"] if arch in NO_MTP_ARCHITECTURES else []


def folder_digest(model_dir):
    """A short hash of the folder's files (names, sizes, modification times): the key of the
    conversions cached from it, so that a remade model is converted again."""
    digest = hashlib.sha256()
    for f in sorted(model_dir.glob("*")):
        if f.is_file():
            st = f.stat()
            digest.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return digest.hexdigest()[:12]


def to_gguf(model_dir, version):
    outtype = model_dtype(model_dir)
    out = WORK / "gguf" / f"{model_dir.name}-{folder_digest(model_dir)}-{outtype}.gguf"
    if out.exists():
        return out, outtype
    out.parent.mkdir(parents=True, exist_ok=True)
    script = converter(version)
    env = dict(os.environ, PYTHONPATH=str(script.parent / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log(f"converting {model_dir} to {outtype} GGUF")
    tmp = out.with_suffix(".partial")
    subprocess.run([sys.executable, str(script), str(model_dir), "--outtype", outtype, "--outfile", str(tmp),
                    *converter_options(model_dir)],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    tmp.rename(out)
    return out, outtype


LLAMA_RUNNER = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
path, threads, prompt, gen = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
kv = {"f32": 0, "f16": 1, "bf16": 30}[sys.argv[5]]  # ggml_type: GGML_TYPE_F32, _F16, _BF16 (not all exported)
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + gen + 16,
            n_batch=512, n_ubatch=512, verbose=False, use_mmap=True, type_k=kv, type_v=kv)
n_vocab = llm.n_vocab()
def last():  # the last token's logits (llm.scores is only filled with logits_all)
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
def once():
    llm.reset()
    t = time.perf_counter(); llm.eval(prompt); p = time.perf_counter() - t
    tok = int(np.argmax(last()))
    t = time.perf_counter()
    for _ in range(gen):
        llm.eval([tok]); tok = int(np.argmax(last()))
    d = time.perf_counter() - t
    return len(prompt) / p, gen / d
once()  # warm-up, as kiln bench does
p, d = once()
info = llama_cpp.llama_print_system_info().decode()
print(json.dumps({"prefill_tok_s": p, "decode_tok_s": d, "system_info": info}))
"""


def run_llama(gguf_path, threads, prompt, gen, kv_dtype, lib_dir):
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib_dir))
    r = subprocess.run([sys.executable, "-c", LLAMA_RUNNER, str(gguf_path), str(threads), json.dumps(prompt), str(gen),
                        kv_dtype],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-5:])
        sys.exit(f"llama.cpp run failed (exit {r.returncode}) on {gguf_path.name}:\n{tail}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_kiln(kiln, model, threads, prompt_tokens, gen, kv_dtype, precision, target_cpu=None):
    extra = ["--target-cpu", target_cpu] if target_cpu else []
    extra += ["--precision", precision]
    extra += ["--kv-dtype", kv_dtype, "--ctx", str(prompt_tokens + gen + 16)]
    r = subprocess.run([kiln, "bench", str(model), "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen),
                        "--reps", "1", "--threads", str(threads), "--json", *extra], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kiln bench failed: {r.stderr}")
    return json.loads(r.stdout)


def kiln_prompt_ids(kiln, model, n):
    """The synthetic prompt kiln bench uses, so llama.cpp processes the very same ids."""
    r = subprocess.run([kiln, "bench", str(model), "--prompt-tokens", str(n), "--print-prompt"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kiln bench --print-prompt failed: {r.stderr}")
    return json.loads(r.stdout)


def read_probe(kiln, threads):
    """The machine's read bandwidth right now (GB/s at `threads` threads, best of 5 passes of
    `kiln probe`, about a second), or None where it cannot be had. This machine kind moves
    between a fast and a slow memory phase (on the 2-core Zen 5 EPYC ~85 and ~50 GB/s) for
    minutes at a time; the probes taken between runs say which phase each run met (`measure`).
    Its own cache folder: the stored probe `kiln bench` judges against stays the user's."""
    env = dict(os.environ, KILN_CACHE_DIR=str(WORK / "kiln-probe-cache"))
    r = subprocess.run([kiln, "probe", "--json", "--passes", "5"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        log(f"kiln probe failed (runs are reported without their phase): {r.stderr.strip()[-200:]}")
        return None
    points = [p for p in json.loads(r.stdout)["read_gb_s"] if p["threads"] <= threads]
    return max(points, key=lambda p: p["threads"])["best"] if points else None


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="Hugging Face model folder (or a .gguf file)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=148)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rest", type=float, default=3.0, help="seconds of rest between runs")
    ap.add_argument("--kiln", default=str(ROOT / "target" / "release" / "kiln"))
    ap.add_argument("--label", default=None, help="name used in the results file")
    ap.add_argument("--quant", default=None, metavar="FTYPE",
                    help="quantise the GGUF with llama.cpp's quantiser first (Q4_K_M, Q4_0, Q5_K_M, Q6_K, Q8_0, ...); "
                         "Kiln and llama.cpp then read that file (OpenVINO is not run)")
    ap.add_argument("--kv-dtype", default="f32", choices=["f32", "f16", "bf16"],
                    help="KV cache type of every engine (default f32, Kiln's default; llama.cpp's own is f16)")
    ap.add_argument("--precision", default="exact", choices=["exact", "bf16", "q8"],
                    help="Kiln's matmul arithmetic (kiln --precision: exact, bf16 over bf16 weights, q8 over GGUF block "
                         "weights; default exact); OpenVINO's INFERENCE_PRECISION_HINT is f32 for exact, bf16 for bf16")
    ap.add_argument("--avx2", action="store_true",
                    help="compare the AVX2 code: Kiln --target-cpu x86-64-v3, llama.cpp built for AVX2 "
                         "(OpenVINO is not run)")
    ap.add_argument("--no-openvino", action="store_true", help="leave OpenVINO GenAI out")
    ap.add_argument("--no-phase-probe", action="store_true",
                    help="do not measure the read bandwidth between runs (a second each; the table then has no "
                         "per-phase decode ratios)")
    return ap.parse_args()


def openvino_engine(args, model_dir):
    """OpenVINO set up for this comparison (its venv made, the model exported), and None; or None
    and the one-line reason why it is not in this comparison."""
    reason = "--no-openvino" if args.no_openvino else openvino_peer.skip_reason(
        model_dir, args.precision, args.quant, args.avx2)
    if not reason:
        try:
            return openvino_peer.OpenVINO(WORK, model_dir, folder_digest(model_dir), model_dtype(model_dir), log), None
        except openvino_peer.NotRun as e:
            reason = str(e)
    log(f"OpenVINO: not run — {reason}")
    return None, reason


def measure(engines, reps, rest, probe=None):
    """Each repetition runs every engine once, one fresh process per run, the order rotated every
    repetition. An engine that raises NotRun (only OpenVINO does; the others exit) leaves the
    comparison with its reason and without its earlier runs, and the others go on. With `probe`,
    each run records the read bandwidth measured just before and just after it
    (`probe_before_gb_s`, `probe_after_gb_s`: one probe between two runs serves both)."""
    results = {name: [] for name in engines}
    dropped = {}
    order = list(engines)
    before = probe() if probe else None
    for rep in range(reps):
        for name in list(order):
            time.sleep(rest)
            try:
                r = engines[name]()
            except openvino_peer.NotRun as e:
                log(f"{name}: not run — {e}")
                dropped[name] = str(e)
                order.remove(name)
                del results[name]
                continue
            after = probe() if probe else None
            r["probe_before_gb_s"], r["probe_after_gb_s"] = before, after
            results[name].append(r)
            phase = f" (read {before:.1f} / {after:.1f} GB/s before / after)" if before and after else ""
            before = after
            log(f"rep {rep + 1}/{reps} {name:9}: prefill {r['prefill_tok_s']:7.1f} tok/s, decode {r['decode_tok_s']:6.2f} tok/s"
                f"{phase}")
        order = order[1:] + order[:1]
    return results, dropped


def result_label(args):
    given = pathlib.Path(args.model)
    label = args.label or ((given.stem if given.suffix == ".gguf" else given.name) + (f"-{args.quant}" if args.quant else ""))
    if args.avx2:
        label += "-avx2"
    if args.kv_dtype != "f32":
        label += f"-kv{args.kv_dtype}"
    if args.precision != "exact":
        label += f"-{args.precision}"
    return label


def header_lines(args, label, now, model, llama, loads, openvino_line):
    """The title and what the table was measured on: machine, engines, their settings."""
    target_cpu = "x86-64-v3" if args.avx2 else None
    isa = llama["isa"]
    return [
        f"# Kiln vs llama.cpp and OpenVINO — {label}",
        "",
        f"- date: {now.strftime('%Y-%m-%d %H:%M UTC')}",
        f"- CPU: {cpu_name()} ({os.cpu_count()} logical CPUs)",
        f"- threads: {args.threads} (every engine)",
        f"- load average (1 min) before / after: {loads[0]:.2f} / {loads[1]:.2f}",
        f"- model: `{model}`; llama.cpp reads `{llama['gguf'].name}` ({llama['outtype']}); llama-cpp-python {llama['version']}",
        f"- code: Kiln {'--target-cpu ' + target_cpu if target_cpu else 'for this CPU'}; llama.cpp "
        f"built here ({isa}: {' '.join(LLAMA_FLAGS[isa])}; {llama['lib_dir']}), reporting {llama['reports']}",
        f"- OpenVINO: {openvino_line}",
        f"- prompt: {args.prompt_tokens} tokens (same ids for every engine), {args.gen_tokens} generated greedily; "
        f"{args.reps} repetitions, one process per measurement, order rotated, {args.rest:g} s rest",
        f"- KV cache: {args.kv_dtype} in every engine; Kiln --precision {args.precision}",
        "",
    ]


def table_lines(results, med, openvino_reason):
    """One row per engine (OpenVINO's saying why it did not run, where it did not), then Kiln's
    ratio to each peer that ran."""
    lines = [
        "| engine | prefill tok/s (median) | decode tok/s (median) | runs (prefill / decode) |",
        "|---|---:|---:|---|",
    ]
    for name, runs in results.items():
        runs_p = ", ".join(f"{r['prefill_tok_s']:.1f}" for r in runs)
        runs_d = ", ".join(f"{r['decode_tok_s']:.2f}" for r in runs)
        lines.append(f"| {name} | {med[name]['prefill_tok_s']:.1f} | {med[name]['decode_tok_s']:.2f} | {runs_p} / {runs_d} |")
    if openvino_reason:
        lines.append(f"| OpenVINO | — | — | not run — {openvino_reason.replace('|', '/')} |")
    k = med["kiln"]
    for peer in ("llama.cpp", "OpenVINO"):
        if peer in med:
            p = med[peer]
            lines.append(f"| **Kiln / {peer}** | **{k['prefill_tok_s'] / p['prefill_tok_s']:.2f}×** | "
                         f"**{k['decode_tok_s'] / p['decode_tok_s']:.2f}×** | |")
    return lines + [""]


def ceiling_lines(args, results, med):
    """Kiln's read-bandwidth probe, and each engine's decode as a share of it."""
    reads = [r["probe_read_gb_s"] for r in results["kiln"] if r.get("probe_read_gb_s")]
    if not reads:
        return []
    last_kiln = results["kiln"][-1]
    bpt = last_kiln["weight_bytes_per_token"]
    read = statistics.median(reads)
    fma = last_kiln.get("probe_fma_gflop_s")
    shares = ", ".join(f"{'Kiln' if name == 'kiln' else name} {100 * m['decode_tok_s'] * bpt / 1e9 / read:.0f} %"
                       for name, m in med.items())
    return [
        f"Weights read per token: {bpt / 1e6:.1f} MB. Read ceiling: {read:.1f} GB/s at {args.threads} threads "
        f"(median over the Kiln runs of the read probe `kiln bench` runs right after each measurement: "
        f"{', '.join(f'{x:.1f}' for x in reads)})" + (f"; FMA peak (`kiln probe`): {fma:.0f} GFLOP/s." if fma else "."),
        f"Decode as a share of the read ceiling: {shares}.",
        "",
    ]


def phase_lines(results):
    """Decode compared within each memory phase. A run is fast-phase when the read probes just
    before and just after it both reached at least 80 % of the session's highest, slow-phase
    when both stayed below, and left out where the phase changed around it; each phase's ratio
    is of Kiln's median to each peer's over the runs of that phase, where both engines have
    some. Engines whose decode is bandwidth-bound follow the phase and others do not, so a
    ratio of medians over mixed phases says more about when the runs happened than about the
    engines."""
    def probes_of(r):
        return [r.get("probe_before_gb_s"), r.get("probe_after_gb_s")]

    probes = [p for rs in results.values() for r in rs for p in probes_of(r) if p]
    if not probes or "kiln" not in results:
        return []
    cut = 0.8 * max(probes)

    def phase(r):
        ps = probes_of(r)
        if not all(ps):
            return None
        return "fast" if min(ps) >= cut else "slow" if max(ps) < cut else None

    def cell(r):
        ps = probes_of(r)
        around = " / ".join(f"{p:.0f}" if p else "—" for p in ps)
        return f"{r['decode_tok_s']:.2f} ({around}{'' if phase(r) else ', mixed'})"

    lines = ["Decode by memory phase (read probe before and after each run, GB/s; fast where both reach "
             f"{cut:.1f}, 80 % of the session's highest {max(probes):.1f}, slow where both stay below):", ""]
    lines += ["| engine | runs: decode tok/s (read before / after) |", "|---|---|"]
    lines += [f"| {name} | {', '.join(cell(r) for r in rs)} |" for name, rs in results.items()]
    lines.append("")
    for which in ("fast", "slow"):
        kiln = [r["decode_tok_s"] for r in results["kiln"] if phase(r) == which]
        for peer, rs in results.items():
            other = [r["decode_tok_s"] for r in rs if phase(r) == which]
            if peer == "kiln" or not kiln or not other:
                continue
            k, o = statistics.median(kiln), statistics.median(other)
            lines.append(f"- {which} phase: Kiln / {peer} decode **{k / o:.2f}×** "
                         f"({k:.2f} vs {o:.2f} tok/s, medians of {len(kiln)} and {len(other)} runs)")
    return lines + [""]


def llama_reports(results):
    """The instruction sets llama.cpp reports using (`llama_print_system_info`)."""
    info = results["llama.cpp"][-1].get("system_info", "")
    used = [f for f in info.split(" | ") if f.startswith(("AVX", "FMA", "F16C", "AMX")) and f.endswith("= 1")]
    return " | ".join(used) or "n/a"


def main():
    args = parse_args()
    model = pathlib.Path(args.model).resolve()
    source = model
    version = ensure_llama_cpp()
    isa = "avx2" if args.avx2 else "native"
    lib_dir = llama_libs(version, isa)
    if model.suffix == ".gguf":
        gguf_path, outtype = model, "gguf"
    else:
        gguf_path, outtype = to_gguf(model, version)
    if args.quant:
        gguf_path, outtype = quantise(gguf_path, args.quant, lib_dir), args.quant
        model = gguf_path
    prompt = kiln_prompt_ids(args.kiln, model, args.prompt_tokens)
    assert len(prompt) == args.prompt_tokens
    openvino, openvino_reason = openvino_engine(args, source)

    target_cpu = "x86-64-v3" if args.avx2 else None
    engines = {
        "kiln": lambda: run_kiln(args.kiln, model, args.threads, args.prompt_tokens, args.gen_tokens, args.kv_dtype,
                                 args.precision, target_cpu),
        "llama.cpp": lambda: run_llama(gguf_path, args.threads, prompt, args.gen_tokens, args.kv_dtype, lib_dir),
    }
    if openvino:
        engines["OpenVINO"] = lambda: openvino.run(args.threads, prompt, args.gen_tokens, args.precision, args.kv_dtype)
    loads = [loadavg()]
    probe = None if args.no_phase_probe else (lambda: read_probe(args.kiln, args.threads))
    results, dropped = measure(engines, args.reps, args.rest, probe)
    loads.append(loadavg())
    openvino_reason = openvino_reason or dropped.get("OpenVINO")

    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("prefill_tok_s", "decode_tok_s")} for n, rs in results.items()}
    now = datetime.datetime.now(datetime.timezone.utc)
    label = result_label(args)
    llama = {"gguf": gguf_path, "outtype": outtype, "version": version, "isa": isa, "lib_dir": lib_dir,
             "reports": llama_reports(results)}
    openvino_line = (f"not run — {openvino_reason}" if openvino_reason
                     else openvino.describe(args.precision, args.kv_dtype))
    lines = header_lines(args, label, now, model, llama, loads, openvino_line)
    lines += table_lines(results, med, openvino_reason)
    lines += ceiling_lines(args, results, med)
    lines += phase_lines(results)
    text = "\n".join(lines)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = unused_path(out_dir, f"{now.strftime('%Y%m%d-%H%M')}-{label}-t{args.threads}")
    out.write_text(text)
    print(text)
    log(f"written to {out}")


def unused_path(folder, stem):
    """`folder/stem.md`, or `stem-2.md`, `stem-3.md` ... when taken: two runs with one label in
    the same minute (a loop over formats) wrote the same name, and the second silently
    replaced the first's table."""
    out, n = folder / f"{stem}.md", 1
    while out.exists():
        n += 1
        out = folder / f"{stem}-{n}.md"
    return out


if __name__ == "__main__":
    main()
