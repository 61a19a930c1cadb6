#!/usr/bin/env python3
"""Time to first token from process start: Kiln against llama.cpp, interleaved in one run.

Each run is a fresh process asked for one token after a short prompt (16 tokens by default):
`kiln run MODEL -p PROMPT --max-tokens 1 --temperature 0` and llama.cpp's own minimal
program (`examples/simple/simple.cpp` of the sources llama-cpp-python vendors, compiled here
against the libllama `bench_peers.py` builds, with its thread counts set to `--threads`). For
each it records the seconds from `exec` to the first byte on stdout (the token: simple.cpp
buffers its prompt echo and flushes it with the first token) and to the process's exit. Both
read a cached model (Kiln's library compiled, the files in the page cache): one untimed run of
each comes first. Kiln may also run a safetensors folder of the same model (`--folder`).

    python3 scripts/bench_start.py --gguf M.gguf [--folder DIR] [--kiln target/release/kiln]
"""
import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import importlib.util

HERE = Path(__file__).resolve().parent
# This folder must not shadow installed modules (it has a `profile.py`); neighbours are
# imported by path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
_spec = importlib.util.spec_from_file_location("bench_peers", HERE / "bench_peers.py")
bench_peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_peers)

PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm"


def llama_simple(threads):
    """llama.cpp's simple example, built once per thread count against the native libllama."""
    version = bench_peers.ensure_llama_cpp()
    libs = bench_peers.llama_libs(version, "native")
    src = bench_peers.llama_cpp_dir(version)
    exe = libs / f"llama-simple-t{threads}"
    if exe.exists():
        return exe
    code = (src / "examples/simple/simple.cpp").read_text()
    anchor = "ctx_params.n_batch = n_prompt;"
    if anchor not in code:
        sys.exit(f"{src}/examples/simple/simple.cpp: no line {anchor!r} to set the thread count after")
    code = code.replace(anchor, f"{anchor}\n    ctx_params.n_threads = {threads};\n"
                                f"    ctx_params.n_threads_batch = {threads};")
    patched = libs / f"simple-t{threads}.cpp"
    patched.write_text(code)
    subprocess.run(["g++", "-O2", "-std=c++17", str(patched), f"-I{src / 'include'}", f"-I{src / 'ggml/include'}",
                    f"-L{libs}", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{libs}", "-o", str(exe)],
                   check=True)
    return exe


def timed(cmd, env=None):
    """(seconds to the first stdout byte, seconds to exit) of one run of `cmd`."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    first = proc.stdout.read(1)
    ttft = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        sys.exit(f"{' '.join(map(str, cmd))}: exit {proc.returncode}, {'no' if not first else 'some'} output")
    return ttft, time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, type=Path, help="the model as GGUF (both engines)")
    ap.add_argument("--folder", type=Path, help="the same model as a safetensors folder (Kiln only)")
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()

    simple = llama_simple(args.threads)
    kiln = [args.kiln, "run", "-p", args.prompt, "--max-tokens", "1", "--temperature", "0",
            "--threads", str(args.threads)]
    cases = [("Kiln, GGUF", kiln[:2] + [str(args.gguf)] + kiln[2:]),
             ("llama.cpp, GGUF", [str(simple), "-m", str(args.gguf), "-n", "1", args.prompt])]
    if args.folder:
        cases.insert(0, ("Kiln, folder", kiln[:2] + [str(args.folder)] + kiln[2:]))
    for _, cmd in cases:
        timed(cmd)  # compile / page cache
    times = {name: [] for name, _ in cases}
    for _ in range(args.reps):
        for name, cmd in cases:
            times[name].append(timed(cmd))

    load = bench_peers.loadavg()
    print(f"machine: {bench_peers.cpu_name()}, {os.cpu_count()} CPUs, {args.threads} threads, "
          f"load {load}, {platform.node()}")
    print(f"prompt: {args.prompt!r}, one token, {args.reps} runs each, median (min-max)\n")
    print("| case | first token (s) | exit (s) |")
    print("|---|---:|---:|")
    for name, runs in times.items():
        first = [t for t, _ in runs]
        end = [e for _, e in runs]
        print(f"| {name} | {statistics.median(first):.3f} ({min(first):.3f}-{max(first):.3f}) "
              f"| {statistics.median(end):.3f} ({min(end):.3f}-{max(end):.3f}) |")


if __name__ == "__main__":
    main()
