#!/usr/bin/env python3
"""`kiln serve` against llama.cpp's `llama-server` at 1, 2, 4 and 8 concurrent streams.

    python3 scripts/bench_serve.py MODEL [--streams 1,2,4,8] [--gen-tokens 64] [--reps 2]
                                   [--threads 2] [--kiln target/release/kiln] [--no-llama]

MODEL is a GGUF file (both servers read it) or a Hugging Face folder (Kiln reads the folder,
llama-server a GGUF made of it by llama.cpp's converter at the same storage type). llama-server
is built here with cmake from the llama.cpp sources llama-cpp-python vendors (native CPU flags,
cached under $KILN_SCRIPTS_CACHE; about 10 minutes on 2 cores, once).

Both servers run at once with 8 slots (`--parallel 8` / `-np 8`), the same threads, each slot
the same context. For each concurrency level and repetition (engine order alternating), N
clients each send one streamed /v1/completions request (distinct prompts, temperature 0,
`ignore_eos`, the same number of tokens for every request) through the same HTTP client.
Reported per engine and level: aggregate generated tok/s (all tokens / wall time of the level),
per-stream tok/s after the first token, and the median time to first token; the best
repetition is kept. Writes a Markdown table to bench/results/ and prints it.
"""

import os as _os
import sys as _sys

_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import argparse
import concurrent.futures
import datetime
import http.client
import importlib.util
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
HERE = pathlib.Path(__file__).resolve().parent


def peers():
    """scripts/bench_peers.py as a module (its llama.cpp source, cmake and conversion helpers)."""
    spec = importlib.util.spec_from_file_location("bench_peers", HERE / "bench_peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def llama_server_binary(bp, version):
    """llama-server built for this CPU from the vendored sources (cached)."""
    build = bp.WORK / f"llama-cpp-{version}-server-build"
    exe = build / "bin" / "llama-server"
    if exe.exists():
        return exe
    src = bp.llama_cpp_dir(version)
    cmake = bp.cmake_program()
    log(f"building llama-server {version} in {build} (about 10 minutes on 2 cores)")
    subprocess.run([cmake, "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([cmake, "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL)
    if not exe.exists():
        sys.exit(f"the llama.cpp build made no {exe}")
    return exe


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port, proc, name, timeout=900):
    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            sys.exit(f"{name} exited with status {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"{name} did not become healthy in {timeout} s")


def stream_completion(port, prompt, tokens):
    """One streamed request: (seconds to the first token, seconds to the end, tokens)."""
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit(f"port {port}: HTTP {r.status}: {r.read()[:300]!r}")
    first, n = None, None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        # The first chunk of generated text (a random-weight model's bytes may not make whole
        # characters for a while: its first chunk comes when they do).
        if first is None and any(ch.get("text") or ch.get("finish_reason") for ch in ev.get("choices", [])):
            first = time.perf_counter() - t0
        if ev.get("usage"):
            n = ev["usage"]["completion_tokens"]
    end = time.perf_counter() - t0
    if n is None:
        sys.exit(f"port {port}: no usage in the stream")
    return first if first is not None else end, end, n


PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a compiler turns source code into machine code, step by step.",
    "List the planets of the solar system and one fact about each of them.",
    "Describe the water cycle to a ten year old child in simple words.",
    "What are the main differences between tea and coffee, in taste and history?",
    "Give advice to someone learning to cook their first dinner for friends.",
    "Summarise the causes of the industrial revolution in a few paragraphs.",
    "Compose a letter from a cat to its owner about the quality of dinner.",
]


def level(port, streams, tokens):
    """`streams` concurrent requests: aggregate tok/s, per-stream decode tok/s, median TTFT."""
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as ex:
        results = list(ex.map(lambda i: stream_completion(port, PROMPTS[i % len(PROMPTS)], tokens), range(streams)))
    wall = time.perf_counter() - t0
    total = sum(n for _, _, n in results)
    rates = [(n - 1) / (end - first) for first, end, n in results if end > first and n > 1]
    per_stream = statistics.median(rates) if rates else float("nan")
    ttft = statistics.median(first for first, _, _ in results)
    return {"agg": total / wall, "stream": per_stream, "ttft": ttft, "tokens": total}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot")
    ap.add_argument("--kiln", default=str(ROOT / "target" / "release" / "kiln"))
    ap.add_argument("--no-llama", action="store_true", help="measure Kiln only")
    ap.add_argument("--llama-cpp-version", default="0.3.36",
                    help="the llama-cpp-python sdist whose vendored llama.cpp is built")
    ap.add_argument("--build-only", action="store_true", help="build llama-server and exit")
    ap.add_argument("--llama-flags", default="",
                    help="extra llama-server flags, e.g. --no-repack (its AMX path crashed on a Q4_1 "
                         "model on a Sapphire Rapids Xeon; the flag keeps it on AVX-512 VNNI)")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    slots = max(streams)
    model = pathlib.Path(args.model).resolve()
    bp = peers()
    version = args.llama_cpp_version
    if args.build_only:
        print(llama_server_binary(bp, version))
        return

    servers = {}
    procs = []
    try:
        kport = free_port()
        kiln = subprocess.Popen([args.kiln, "serve", str(model), "--port", str(kport), "--parallel", str(slots),
                                 "--ctx", str(args.ctx), "--threads", str(args.threads)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(kiln)
        wait_healthy(kport, kiln, "kiln serve")
        servers["kiln"] = kport
        if not args.no_llama:
            gguf = model if model.suffix == ".gguf" else bp.to_gguf(model, version)[0]
            exe = llama_server_binary(bp, version)
            lport = free_port()
            llama = subprocess.Popen([str(exe), "-m", str(gguf), "--port", str(lport), "-np", str(slots),
                                      "-c", str(args.ctx * slots), "-t", str(args.threads), "-tb", str(args.threads),
                                      "--host", "127.0.0.1", "--no-warmup", *args.llama_flags.split()],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(llama)
            wait_healthy(lport, llama, "llama-server")
            servers["llama-server"] = lport
        for port in servers.values():
            level(port, 1, 8)  # warm-up
        best = {}
        for rep in range(args.reps):
            order = list(servers.items())
            if rep % 2:
                order.reverse()
            for n in streams:
                for name, port in order:
                    r = level(port, n, args.gen_tokens)
                    log(f"rep {rep} {name} {n} streams: {r['agg']:.1f} tok/s, ttft {r['ttft'] * 1000:.0f} ms")
                    key = (name, n)
                    if key not in best or r["agg"] > best[key]["agg"]:
                        best[key] = r
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    write_table(args, model, streams, servers, best)


def write_table(args, model, streams, servers, best):
    cpu = platform.processor() or "?"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0]
    lines = [
        f"# kiln serve vs llama-server: {model.name}",
        "",
        f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, {cpu}, {args.threads} threads, load {load:.2f} "
        f"at the end; {args.gen_tokens} tokens per request (temperature 0, ignore_eos), {max(streams)} slots "
        f"of {args.ctx} tokens, best of {args.reps}"
        + (f"; llama-server flags: `{args.llama_flags}`." if args.llama_flags else "."),
        "",
        "| streams | Kiln tok/s | Kiln per stream | Kiln TTFT ms | llama-server tok/s | per stream | TTFT ms | Kiln / llama |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in streams:
        k = best.get(("kiln", n))
        lcpp = best.get(("llama-server", n))
        row = [str(n), f"{k['agg']:.1f}", f"{k['stream']:.1f}", f"{k['ttft'] * 1000:.0f}"]
        if lcpp:
            row += [f"{lcpp['agg']:.1f}", f"{lcpp['stream']:.1f}", f"{lcpp['ttft'] * 1000:.0f}",
                    f"{k['agg'] / lcpp['agg']:.2f}x"]
        else:
            row += ["-"] * 4
        lines.append("| " + " | ".join(row) + " |")
    one = best.get(("kiln", streams[0]))
    top = best.get(("kiln", streams[-1]))
    if one and top:
        lines += ["", f"Kiln: {streams[-1]} streams give {top['agg'] / one['agg']:.2f}x the throughput of {streams[0]}."]
    text = "\n".join(lines) + "\n"
    out = ROOT / "bench" / "results" / f"{datetime.datetime.now().strftime('%Y%m%d-%H%M')}-serve-{model.stem}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
