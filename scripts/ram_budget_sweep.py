#!/usr/bin/env python3
"""Decode speed and memory of `kiln bench --ram-budget` over a sweep of budgets.

    python3 scripts/ram_budget_sweep.py MODEL [MODEL...] [--kiln target/release/kiln]
                                        [--fractions 0.1,0.25,0.5,1.0] [--ctx 512] [--reps 3]
                                        [--gen-tokens 32] [--prompt-tokens 32] [--threads N]
                                        [--out bench/results] [--label NAME]

For each model (a Hugging Face folder or a .gguf file) it first runs `kiln bench --json` without a
budget: that run is the "no budget" reference row and gives the model's weight bytes. Then, for
each fraction f, it runs `kiln bench --ram-budget B` with

    B = int(f * weight bytes) + KV cache for --ctx positions

since a budget covers the weights AND the KV cache (not the process's other memory: code, compiled
kernels, activations, tokenizer). The KV size comes from `kiln info --json --ram-budget` (its plan's
`kv_bytes`), else from the model's dimensions (config.json, or the GGUF header read with the `gguf`
package): layers x 2 x kv heads x ctx x head_dim x 4 bytes.

Before every run the model's weight files are dropped from the page cache (`sync; echo 1 >
/proc/sys/vm/drop_caches` where permitted, and always `posix_fadvise(DONTNEED)` on each file), and
the share of the files still cached afterwards is measured with mincore(2). The disk's sequential
read rate is measured on the model's biggest weight file with 64 MiB reads (about a layer, as kiln
reads them), twice: O_DIRECT where the filesystem allows, and buffered after DONTNEED; the faster
is the disk's rate (on a virtio disk here, buffered reads with readahead were the faster). The
page-cache (warm) rate of the same file is given for contrast; each budgeted run's streaming rate (bytes read per token x decode tok/s) is
reported as a share of that disk rate.

Writes <out>/<UTC timestamp>-ram-budget-<label>.md (a table per model, the machine, the disk rate,
the load average before and after), .json (settings and raw rows, each with kiln's own JSON) and
.png (decode tok/s and peak RSS against the budget, one line per model), and prints the Markdown.
A run that fails is recorded with the last line of its stderr; the sweep goes on.

Needs matplotlib for the plot (or --no-plot); the `gguf` package only for a GGUF whose KV size
`kiln info` cannot give.
"""

import os as _os
import sys as _sys

# scripts/profile.py would shadow the standard library's `profile`: keep this folder off the
# module path before anything else is imported (as scripts/bench_peers.py does).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or '.') != _here]

import argparse
import ctypes
import ctypes.util
import datetime
import errno
import json
import mmap
import os
import pathlib
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import importlib.util

ROOT = pathlib.Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30
CHUNK = 64 * MiB  # one read of the disk measurement: about a layer's tensor, as kiln reads them
KV_ELEM_BYTES = 4  # Kiln's KV cache is f32

_machine_spec = importlib.util.spec_from_file_location("bench_machine", pathlib.Path(_here) / "bench_machine.py")
_machine = importlib.util.module_from_spec(_machine_spec)
_machine_spec.loader.exec_module(_machine)
cpu_name, loadavg = _machine.cpu_name, _machine.loadavg


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def fail(msg):
    """One clear error line on stderr, exit status 1."""
    print(f"ram_budget_sweep: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def parse_size(text):
    """Bytes from `512M`, `2G`, `1.5G`, `4096` (binary units, as `kiln --ram-budget` reads them)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:I?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: expected bytes or a number with K, M, G or T")
    shift = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2).upper()]
    return int(float(m.group(1)) * (1 << shift))


def parse_fractions(text):
    try:
        fs = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas, e.g. 0.1,0.25,0.5,1.0")
    if not fs or any(f <= 0 for f in fs):
        raise argparse.ArgumentTypeError(f"{text!r}: fractions must be positive")
    return fs


def human(n):
    if n is None:
        return "—"
    for name, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {name}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------------------------------
# The machine

def mem_total():
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


# ---------------------------------------------------------------------------------------------
# Page cache: dropping, measuring what is cached

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _libc


def cached_fraction(path):
    """The share of `path`'s pages in the page cache (mincore(2) on a fresh read-only mapping,
    which itself reads nothing), or None where that cannot be asked."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return 0.0
        lc = libc()
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = lc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
                vec = (ctypes.c_ubyte * pages)()
                if lc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return None
                return sum(b & 1 for b in bytes(vec)) / pages
            finally:
                lc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return None


def try_drop_caches():
    """`sync; echo 1 > /proc/sys/vm/drop_caches`: None when done, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return None
    except OSError as e:
        return e.strerror or str(e)


def fadvise_dontneed(path):
    """posix_fadvise(DONTNEED) on the whole file: None when done, else why not."""
    if not hasattr(os, "posix_fadvise"):
        return "os.posix_fadvise is not available"
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return None
    except OSError as e:
        return e.strerror or str(e)


def drop_from_cache(files, use_drop_caches=True):
    """Drops `files` from the page cache by every means allowed; says what worked and how much of
    the files is still cached afterwards (mincore)."""
    drop_err = try_drop_caches() if use_drop_caches else "not tried (--no-drop-caches)"
    fadv_errs = {str(f): e for f in files if (e := fadvise_dontneed(f))}
    total = sum(os.path.getsize(f) for f in files) or 1
    fracs = [(cached_fraction(f), os.path.getsize(f)) for f in files]
    cached = None if any(c is None for c, _ in fracs) else sum(c * s for c, s in fracs) / total
    return {
        "drop_caches": drop_err is None,
        "drop_caches_error": drop_err,
        "fadvise_dontneed": not fadv_errs,
        "fadvise_errors": fadv_errs or None,
        "cached_after": cached,
    }


def describe_drop(d):
    parts = ["`drop_caches` " + ("done" if d["drop_caches"] else f"not permitted ({d['drop_caches_error']})"),
             "`posix_fadvise(DONTNEED)` " + ("done" if d["fadvise_dontneed"] else f"failed ({d['fadvise_errors']})")]
    if d["cached_after"] is not None:
        parts.append(f"{100 * d['cached_after']:.1f} % of the weight files still cached afterwards (mincore)")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Disk and page-cache read rates

def _read_rate(fd, limit, buf):
    """Reads `limit` bytes (or to EOF) sequentially from offset 0 into `buf`: (bytes, seconds)."""
    done = 0
    t = time.perf_counter()
    while done < limit:
        n = os.preadv(fd, [buf], done)
        if n <= 0:
            break
        done += n
        if n < len(buf):
            break
    return done, time.perf_counter() - t


def read_rates(path, limit, use_drop_caches=True):
    """The cold (disk) and warm (page cache) sequential read rates of `path`, in GB/s, with the
    method each used. Reads at most `limit` bytes of the file each time."""
    path = str(path)
    size = os.path.getsize(path)
    limit = min(size, limit)
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    out = {"file": path, "file_bytes": size, "bytes": limit}
    try:
        # Cold, two ways: O_DIRECT (the device alone, one 64 MiB request at a time; refused by
        # tmpfs and some overlays) and buffered reads after dropping the file from the cache
        # (the kernel's readahead keeps several requests in flight: what kiln's pread sees). The
        # disk's rate is the faster of the two.
        cold = []
        if hasattr(os, "O_DIRECT"):
            drop_from_cache([path], use_drop_caches)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                try:
                    n, s = _read_rate(fd, limit, buf)
                    cold.append((n / s / 1e9, "O_DIRECT, 64 MiB reads", s))
                finally:
                    os.close(fd)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
                out["o_direct_error"] = e.strerror
        drop = drop_from_cache([path], use_drop_caches)
        out["drop"] = drop
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            n, s = _read_rate(fd, limit, buf)
        finally:
            os.close(fd)
        how = "drop_caches" if drop["drop_caches"] else "posix_fadvise(DONTNEED)"
        cached = drop["cached_after"]
        cold.append((n / s / 1e9, f"buffered 64 MiB reads after {how}" + (
            f", {100 * cached:.1f} % still cached" if cached is not None else ""), s))
        best = max(cold)
        out.update(disk_gb_s=best[0], disk_seconds=best[2],
                   disk_method=best[1] + "; the faster of " + ", ".join(f"{m.split(',')[0]} {r:.2f} GB/s"
                                                                       for r, m, _ in cold),
                   disk_rates={m: r for r, m, _ in cold})

        # Warm: one buffered pass to fill the cache, then the timed pass.
        fd = os.open(path, os.O_RDONLY)
        try:
            _read_rate(fd, limit, buf)
            cached = cached_fraction(path)
            n, s = _read_rate(fd, limit, buf)
        finally:
            os.close(fd)
        out.update(cache_gb_s=n / s / 1e9, cache_cached_fraction=cached,
                   cache_method="buffered 64 MiB reads, second pass" + (
                       f", {min(100.0, 100 * cached * size / max(limit, 1)):.0f} % of the bytes read cached"
                       if cached is not None else ""))
    finally:
        buf.close()
        drop_from_cache([path], use_drop_caches)
    return out


# ---------------------------------------------------------------------------------------------
# Models

def weight_files(model):
    """The files a model's weights are read from: *.safetensors in a folder, or the .gguf."""
    if model.is_file():
        return [model]
    files = sorted(model.glob("*.safetensors")) or sorted(model.glob("*.gguf"))
    return files


def model_name(model):
    return model.stem if model.is_file() else model.name


def kv_from_config(model, ctx):
    """KV bytes for `ctx` positions from a Hugging Face config.json (None if it cannot tell)."""
    cfg_path = (model if model.is_dir() else model.parent) / "config.json"
    if model.is_file() or not cfg_path.exists():
        return None
    cfg = json.loads(cfg_path.read_text())
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    layers = cfg.get("num_hidden_layers")
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") // heads if heads and cfg.get("hidden_size") else None)
    if not (layers and kv_heads and head_dim):
        return None
    return layers * 2 * kv_heads * ctx * head_dim * KV_ELEM_BYTES


def kv_from_gguf(path, ctx):
    """KV bytes for `ctx` positions from a GGUF header, read with the `gguf` package."""
    try:
        import gguf
    except ImportError:
        return None
    reader = gguf.GGUFReader(str(path))

    def values(key):
        field = reader.fields.get(key)
        if field is None:
            return None
        vals = [field.parts[i] for i in field.data]
        if field.types and field.types[0] == gguf.GGUFValueType.STRING:
            return [bytes(v).decode() for v in vals]
        return [int(v[0]) for v in vals]

    arch = (values("general.architecture") or [None])[0]
    if not arch:
        return None
    layers = (values(f"{arch}.block_count") or [None])[0]
    hidden = (values(f"{arch}.embedding_length") or [None])[0]
    heads = values(f"{arch}.attention.head_count")
    kv_heads = values(f"{arch}.attention.head_count_kv") or heads
    key_len = (values(f"{arch}.attention.key_length") or [None])[0]
    if not (layers and kv_heads):
        return None
    head_dim = key_len or (hidden // max(heads) if hidden and heads else None)
    if not head_dim:
        return None
    # head_count_kv may be one value or one per layer.
    per_layer = kv_heads if len(kv_heads) == layers else kv_heads[:1] * layers
    return sum(2 * h * ctx * head_dim * KV_ELEM_BYTES for h in per_layer)


def activation_bytes(kiln, model, ctx):
    """The activation buffers of one prefill block, from `kiln info --json --ram-budget` (None
    from a kiln that does not report them): memory a budget does not cover."""
    cmd = [kiln, "info", str(model), "--json", "--ctx", str(ctx), "--ram-budget", "1T"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    try:
        return (json.loads(r.stdout).get("budget_plan") or {}).get("activation_bytes") if r.returncode == 0 else None
    except json.JSONDecodeError:
        return None


def kv_bytes(kiln, model, ctx, weight_bytes, threads):
    """(KV bytes for `ctx` positions, where the number came from, decoder layers or None)."""
    # kiln's own plan: ask for a budget every weight fits in, read its kv_bytes.
    cmd = [kiln, "info", str(model), "--json", "--ctx", str(ctx), "--ram-budget", str(2 * weight_bytes + GiB)]
    r = subprocess.run(cmd + (["--threads", str(threads)] if threads else []), capture_output=True, text=True)
    info = None
    if r.returncode == 0:
        try:
            info = json.loads(r.stdout)
        except json.JSONDecodeError:
            info = None
    layers = None
    if info:
        plan = info.get("budget_plan") or {}
        dims = (info.get("spec") or {}).get("dims") or {}
        layers = plan.get("layers") or dims.get("num_layers")
        if plan.get("kv_bytes"):
            return int(plan["kv_bytes"]), "`kiln info --json --ram-budget` (plan's kv_bytes)", layers
        if all(dims.get(k) for k in ("num_layers", "num_kv_heads", "head_dim")):
            return (dims["num_layers"] * 2 * dims["num_kv_heads"] * ctx * dims["head_dim"] * KV_ELEM_BYTES,
                    "`kiln info --json` dimensions (layers x 2 x kv heads x ctx x head_dim x 4 B)", layers)
    if model.is_file() and model.suffix == ".gguf":
        kv = kv_from_gguf(model, ctx)
        if kv:
            return kv, "GGUF header via the gguf package (layers x 2 x kv heads x ctx x head_dim x 4 B)", layers
        return (0, "unknown (no kv in `kiln info`, and the gguf package is missing or the header incomplete): "
                   "KV not added", layers)
    kv = kv_from_config(model, ctx)
    if kv:
        return kv, "config.json (layers x 2 x kv heads x ctx x head_dim x 4 B)", layers
    return 0, "unknown (no kv in `kiln info`, no usable config.json): KV not added", layers


# ---------------------------------------------------------------------------------------------
# Running kiln

def kiln_supports_budget(kiln):
    r = subprocess.run([kiln, "bench", "--help"], capture_output=True, text=True)
    return "--ram-budget" in (r.stdout + r.stderr)


def run_bench(kiln, model, args, budget=None):
    """One `kiln bench --json` process: (report dict or None, error line or None, command, seconds,
    bytes the process read from block devices (getrusage's ru_inblock, 512-byte units))."""
    cmd = [kiln, "bench", str(model), "--json", "--no-probe", "--reps", str(args.reps),
           "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens), "--ctx", str(args.ctx)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if budget is not None:
        cmd += ["--ram-budget", str(budget)]
    inblock = resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {args.timeout:g} s", cmd, time.perf_counter() - t, None
    wall = time.perf_counter() - t
    read = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_inblock - inblock) * 512
    if r.returncode != 0:
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        return None, (lines[-1].strip() if lines else f"exit status {r.returncode}"), cmd, wall, read
    for line in reversed(r.stdout.splitlines()):
        if line.lstrip().startswith("{"):
            try:
                return json.loads(line), None, cmd, wall, read
            except json.JSONDecodeError:
                break
    return None, "no JSON object on stdout", cmd, wall, read


def make_row(name, model, fraction, budget, kv, weight_bytes, report, error, cmd, wall, drop, disk_gb_s,
             disk_read=None, layers=None):
    row = {
        "model": name, "model_path": str(model), "fraction": fraction, "budget_bytes": budget,
        "kv_bytes": kv, "weight_bytes": weight_bytes, "error": error, "wall_s": round(wall, 2),
        "command": " ".join(cmd), "cache_drop": drop,
        "prefill_tok_s": None, "decode_tok_s": None, "decode_tok_s_all": None, "peak_rss_bytes": None,
        "streamed_bytes_per_token": None, "streamed_gb_s": None, "pct_of_disk": None,
        "resident_layers": None, "layers": layers, "planned_peak_bytes": None,
        "disk_read_bytes": disk_read, "raw": report,
    }
    if report is None:
        return row
    all_d = report.get("decode_tok_s_all") or []
    decode = statistics.median(all_d) if all_d else report.get("decode_tok_s")
    all_p = report.get("prefill_tok_s_all") or []
    prefill = statistics.median(all_p) if all_p else report.get("prefill_tok_s")
    streamed = report.get("streamed_bytes_per_token")
    plan = report.get("budget_plan") or {}
    row.update(
        prefill_tok_s=prefill, decode_tok_s=decode, decode_tok_s_all=all_d or None,
        peak_rss_bytes=report.get("peak_rss_bytes"), streamed_bytes_per_token=streamed,
        resident_layers=plan.get("resident_layers"), planned_peak_bytes=plan.get("planned_peak_bytes"),
        layers=plan.get("layers") or layers,
    )
    if row["weight_bytes"] is None:
        row["weight_bytes"] = report.get("weight_bytes")
    if streamed is not None and decode:
        row["streamed_gb_s"] = streamed * decode / 1e9
        if disk_gb_s:
            row["pct_of_disk"] = 100 * row["streamed_gb_s"] / disk_gb_s
    return row


# ---------------------------------------------------------------------------------------------
# Results

def fmt(v, spec, none="—"):
    return none if v is None else format(v, spec)


def markdown(meta, rows):
    disk = meta.get("disk") or {}
    lb, la = meta["load_before"], meta["load_after"]
    lines = [
        f"# Kiln --ram-budget sweep — {meta['label']}",
        "",
        f"- date: {meta['date']}",
        f"- CPU: {meta['cpu']} ({meta['cpus']} logical CPUs); memory {human(meta['mem_total'])}",
        f"- kiln: `{meta['kiln']}`" + (" (a debug build: speeds are not representative)" if meta["debug_build"] else ""),
        f"- threads: {meta['threads'] or 'kiln default'}; prompt {meta['prompt_tokens']} tokens, "
        f"{meta['gen_tokens']} generated, {meta['reps']} repetitions (+1 warm-up, medians), --ctx {meta['ctx']}, --no-probe",
        f"- load average (1/5/15 min) before: {lb[0]:.2f} / {lb[1]:.2f} / {lb[2]:.2f}; "
        f"after: {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f}",
        f"- budget = fraction x weight bytes + the KV cache for {meta['ctx']} positions: it covers the weights and "
        f"the KV cache, not the process's other memory (code, compiled kernels, activations, tokenizer), "
        f"which peak RSS also counts",
        f"- page cache before each run: {meta['drop_summary']}",
    ]
    if disk.get("disk_gb_s"):
        lines.append(f"- disk: {disk['disk_gb_s']:.2f} GB/s sequential read ({disk['disk_method']}; "
                     f"{human(disk['bytes'])} of `{disk['file']}`); page cache (warm): "
                     f"{disk['cache_gb_s']:.2f} GB/s ({disk['cache_method']})")
    elif disk.get("error"):
        lines.append(f"- disk: not measured ({disk['error']})")
    lines.append("")
    for model in meta["models"]:
        mrows = [r for r in rows if r["model_path"] == model["path"]]
        lines += [f"## {model['name']}", ""]
        if model.get("weight_bytes"):
            acts = model.get("activation_bytes")
            lines.append(f"Weights {human(model['weight_bytes'])} ({model['weight_bytes']} B); KV cache at --ctx "
                         f"{meta['ctx']}: {human(model['kv_bytes'])} (from {model['kv_source']})"
                         + (f"; activations of one prefill block (outside the budget): {human(acts)}." if acts else "."))
            lines.append("")
        lines += [
            "| budget (weights %) | budget | resident | prefill tok/s | decode tok/s | decode vs none | peak RSS "
            "| RSS / budget | RSS − budget | read / token | streamed GB/s | % of disk | disk read (whole run) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        ref = next((r for r in mrows if r["fraction"] is None and r["error"] is None), None)
        for r in mrows:
            what = "no budget" if r["fraction"] is None else f"{100 * r['fraction']:g} %"
            if r["error"]:
                budget = human(r["budget_bytes"]) if r["budget_bytes"] else "—"
                err = re.sub(r"^error:\s*", "", r["error"]).replace("|", "/")
                lines.append(f"| {what} | {budget} | error: {err} | | | | | | | | | | |")
                continue
            plan = (r.get("raw") or {}).get("budget_plan") or {}
            layers = (f"{r['resident_layers']} / {r['layers'] or '?'}" if r["resident_layers"] is not None else "—")
            if plan.get("head_streamed") is False and plan.get("resident_layers") != r["layers"]:
                layers += " + head"
            vs = (f"{r['decode_tok_s'] / ref['decode_tok_s']:.2f}x"
                  if ref and r["fraction"] is not None and r["decode_tok_s"] and ref["decode_tok_s"] else "—")
            rss_share = (f"{100 * r['peak_rss_bytes'] / r['budget_bytes']:.0f} %"
                         if r["budget_bytes"] and r["peak_rss_bytes"] else "—")
            over = (human(r["peak_rss_bytes"] - r["budget_bytes"])
                    if r["budget_bytes"] and r["peak_rss_bytes"] else "—")
            lines.append(
                f"| {what} | {human(r['budget_bytes'])} | {layers} | {fmt(r['prefill_tok_s'], '.1f')} "
                f"| {fmt(r['decode_tok_s'], '.2f')} | {vs} | {human(r['peak_rss_bytes'])} | {rss_share} | {over} "
                f"| {human(r['streamed_bytes_per_token'])} | {fmt(r['streamed_gb_s'], '.2f')} "
                f"| {fmt(r['pct_of_disk'], '.0f')} | {human(r['disk_read_bytes'])} |")
        lines.append("")
    if meta.get("png"):
        lines += [f"![decode tok/s and peak RSS against the budget]({pathlib.Path(meta['png']).name})", ""]
    lines.append("Read / token is kiln's `streamed_bytes_per_token`; streamed GB/s = read / token x decode tok/s; "
                 "% of disk is against the sequential read rate above. Disk read (whole run) is what the kiln process "
                 "read from block devices over all of its run (getrusage ru_inblock: loading, warm-up and measured "
                 "repetitions, prefill and decode, and the kiln binary's own pages if they were not cached); a streamed GB/s far above the disk rate, or a whole-run disk read "
                 "far below read / token x the tokens decoded, means the streamed reads were served from the page cache.")
    return "\n".join(lines) + "\n"


def plot(meta, rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_d, ax_m) = plt.subplots(1, 2, figsize=(13, 5))
    fracs = sorted({r["fraction"] for r in rows if r["fraction"] is not None})
    top = 100 * max(fracs) if fracs else 100
    x_none = top * 1.2 if top > 0 else 120
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, model in enumerate(meta["models"]):
        c = colors[i % len(colors)]
        mrows = [r for r in rows if r["model_path"] == model["path"]]
        ok = sorted((r for r in mrows if r["fraction"] is not None and r["error"] is None), key=lambda r: r["fraction"])
        bad = [r for r in mrows if r["fraction"] is not None and r["error"] is not None]
        ref = next((r for r in mrows if r["fraction"] is None and r["error"] is None), None)
        xs = [100 * r["fraction"] for r in ok]
        ax_d.plot(xs, [r["decode_tok_s"] for r in ok], "o-", color=c, label=model["name"])
        ax_m.plot(xs, [(r["peak_rss_bytes"] or 0) / MiB for r in ok], "o-", color=c, label=f"{model['name']} peak RSS")
        if bad:
            ax_d.plot([100 * r["fraction"] for r in bad], [0] * len(bad), "x", color=c, ms=9, clip_on=False,
                      label=f"{model['name']}: failed")
        if ref:
            ax_d.axhline(ref["decode_tok_s"], color=c, ls=":", lw=1)
            ax_d.plot([x_none], [ref["decode_tok_s"]], "*", color=c, ms=13)
            if ref["peak_rss_bytes"]:
                ax_m.plot([x_none], [ref["peak_rss_bytes"] / MiB], "*", color=c, ms=13)
        wb, kv = model.get("weight_bytes"), model.get("kv_bytes") or 0
        if wb:
            bx = [0, top * 1.05]
            ax_m.plot(bx, [(x / 100 * wb + kv) / MiB for x in bx], "--", color=c, lw=1,
                      label=f"{model['name']} budget (y = budget)")
    ticks = [100 * f for f in fracs] + [x_none]
    for ax in (ax_d, ax_m):
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks[:-1]] + ["no\nbudget"])
        ax.set_xlim(0, x_none * 1.08)
        ax.set_xlabel("budget: weights share, % of weight bytes (+ KV cache)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_d.set_ylabel("decode tok/s (median)")
    ax_d.set_title("decode speed (dotted / star: no budget)")
    ax_m.set_ylabel("MiB")
    ax_m.set_title("peak RSS (VmHWM) against the budget")
    ax_d.legend(fontsize=8)
    ax_m.legend(fontsize=8)
    disk = meta.get("disk") or {}
    sub = f"{meta['cpu']}, {meta['threads'] or 'default'} threads, ctx {meta['ctx']}"
    if disk.get("disk_gb_s"):
        sub += f", disk {disk['disk_gb_s']:.2f} GB/s"
    fig.suptitle(f"Kiln --ram-budget sweep — {meta['label']}\n{sub}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(meta, rows, out_dir, stamp, with_plot):
    out_dir.mkdir(parents=True, exist_ok=True)
    # Not with_suffix: a label may hold dots (qwen2.5-0.5b).
    base = out_dir / f"{stamp}-ram-budget-{meta['label']}"
    png = pathlib.Path(f"{base}.png")
    if with_plot:
        plot(meta, rows, png)
        meta["png"] = str(png)
    text = markdown(meta, rows)
    pathlib.Path(f"{base}.md").write_text(text)
    pathlib.Path(f"{base}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return base, text


# ---------------------------------------------------------------------------------------------

def rerender(path, kiln, with_plot):
    """Writes `path`'s .md (and .png) again from its .json; models without an activation figure
    get it from `kiln` (it depends only on the model and the prefill block)."""
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]
    for m in meta["models"]:
        if m.get("activation_bytes") is None and os.access(kiln, os.X_OK):
            m["activation_bytes"] = activation_bytes(kiln, m["path"], meta["ctx"])
    meta.pop("png", None)
    stem = path.name[: -len(".json")]
    stamp = stem.split("-ram-budget-")[0]
    base, text = write_results(meta, rows, path.parent, stamp, with_plot)
    print(text)
    log(f"written to {base}.md, .json" + (", .png" if with_plot else ""))


def self_test():
    """Synthetic rows through the table, JSON and plot, and the cache and read-rate code on a
    temporary file, all in a temporary folder. No kiln needed."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ram-budget-selftest-"))
    assert parse_size("512M") == 512 * MiB and parse_size("1.5G") == int(1.5 * GiB) and parse_size("4096") == 4096
    f = tmp / "weights.safetensors"
    with open(f, "wb") as out:
        block = os.urandom(MiB)
        for _ in range(64):
            out.write(block)
    drop = drop_from_cache([f])
    log(f"self-test: drop: {describe_drop(drop)}")
    rates = read_rates(f, 64 * MiB)
    log(f"self-test: disk {rates['disk_gb_s']:.2f} GB/s ({rates['disk_method']}), "
        f"cache {rates['cache_gb_s']:.2f} GB/s ({rates['cache_method']})")
    cfg = tmp / "m"
    cfg.mkdir()
    (cfg / "config.json").write_text(json.dumps({"num_hidden_layers": 24, "num_attention_heads": 14,
                                                 "num_key_value_heads": 2, "hidden_size": 896}))
    assert kv_from_config(cfg, 512) == 24 * 2 * 2 * 512 * 64 * 4

    models = []
    rows = []
    for name, wb, kv, base in (("small-model", 988 * MiB, 12 * MiB, 40.0), ("bigger-model", 2100 * MiB, 44 * MiB, 18.0)):
        path = f"/models/{name}"
        models.append({"name": name, "path": path, "weight_bytes": wb, "kv_bytes": kv, "kv_source": "synthetic"})
        ref = {"prefill_tok_s": 300.0, "decode_tok_s": base, "decode_tok_s_all": [base] * 3,
               "peak_rss_bytes": wb + kv + 150 * MiB, "weight_bytes": wb}
        rows.append(make_row(name, path, None, None, kv, wb, ref, None, ["kiln", "bench"], 1.0, drop, 2.0, wb))
        for frac in (0.1, 0.25, 0.5, 1.0):
            budget = int(frac * wb) + kv
            if frac == 0.1 and name == "bigger-model":
                rows.append(make_row(name, path, frac, budget, kv, wb, None,
                                     "error: no plan fits in a budget of 254.0 MiB | minimum 300 MiB",
                                     ["kiln"], 0.5, drop, 2.0))
                continue
            d = base * (0.3 + 0.7 * frac)
            rep = {"prefill_tok_s": 250.0 * (0.5 + frac / 2), "decode_tok_s": d, "decode_tok_s_all": [d * 0.98, d, d * 1.02],
                   "peak_rss_bytes": int(budget * 0.9 + 120 * MiB), "streamed_bytes_per_token": int((1 - frac) * wb),
                   "weight_bytes": wb, "budget_plan": {"resident_layers": int(24 * frac), "planned_peak_bytes": budget}}
            rows.append(make_row(name, path, frac, budget, kv, wb, rep, None, ["kiln"], 2.0, drop, 2.0,
                                 int(wb * (1 - frac) * 4 * 35), 24))
    meta = {"label": "self-test", "date": "2026-01-01 00:00 UTC", "cpu": cpu_name(), "cpus": os.cpu_count(),
            "mem_total": mem_total(), "kiln": "target/debug/kiln", "debug_build": True, "threads": 2, "prompt_tokens": 32,
            "gen_tokens": 32, "reps": 3, "ctx": 512, "load_before": loadavg(), "load_after": loadavg(),
            "drop_summary": describe_drop(drop), "disk": rates, "models": models}
    base, text = write_results(meta, rows, tmp, "20260101-0000", with_plot=True)
    print(text)
    for ext in (".md", ".json", ".png"):
        p = pathlib.Path(f"{base}{ext}")
        assert p.exists() and p.stat().st_size > 0, p
    assert json.loads(pathlib.Path(f"{base}.json").read_text())["rows"][1]["streamed_gb_s"] is not None
    f.unlink()
    log(f"self-test passed: {base}.{{md,json,png}}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", metavar="MODEL", help="Hugging Face model folder or .gguf file")
    default_kiln = ROOT / "target" / "release" / "kiln"
    if not default_kiln.exists() and (ROOT / "target" / "debug" / "kiln").exists():
        default_kiln = ROOT / "target" / "debug" / "kiln"
    ap.add_argument("--kiln", default=str(default_kiln), help="kiln binary (default: %(default)s)")
    ap.add_argument("--fractions", type=parse_fractions, default=[0.1, 0.25, 0.5, 1.0],
                    help="budgets as fractions of the weight bytes, comma-separated (default: 0.1,0.25,0.5,1.0); "
                         "the KV cache for --ctx is added to each")
    ap.add_argument("--ctx", type=int, default=512, help="KV-cache positions (kiln --ctx; default: %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="kiln bench repetitions per run (default: %(default)s)")
    ap.add_argument("--gen-tokens", type=int, default=32, help="default: %(default)s")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="default: %(default)s")
    ap.add_argument("--threads", type=int, default=None, help="kiln --threads (default: kiln's own)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder (default: %(default)s)")
    ap.add_argument("--label", default=None, help="name in the results files (default: the model names)")
    ap.add_argument("--rest", type=float, default=1.0, help="seconds of rest between runs (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one kiln run may take (default: %(default)s)")
    ap.add_argument("--disk-sample", type=parse_size, default=4 * GiB,
                    help="bytes of the biggest weight file read to measure the disk (default: 4G)")
    ap.add_argument("--no-drop-caches", action="store_true",
                    help="do not write /proc/sys/vm/drop_caches (posix_fadvise DONTNEED is still used)")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    ap.add_argument("--rerender", metavar="JSON", default=None,
                    help="write the .md and .png again from a results .json of this script (runs nothing)")
    ap.add_argument("--self-test", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.self_test:
        self_test()
        return
    if args.rerender:
        rerender(pathlib.Path(args.rerender), args.kiln, not args.no_plot)
        return
    if not args.models:
        ap.error("at least one MODEL is needed")
    for name, v in (("--ctx", args.ctx), ("--reps", args.reps), ("--gen-tokens", args.gen_tokens),
                    ("--prompt-tokens", args.prompt_tokens)):
        if v < 1:
            ap.error(f"{name} must be at least 1")

    kiln = args.kiln if os.sep in args.kiln else (shutil.which(args.kiln) or args.kiln)
    if not (os.path.isfile(kiln) and os.access(kiln, os.X_OK)):
        fail(f"kiln binary not found or not executable: {kiln} (build it: cargo build --release)")
    kiln = os.path.abspath(kiln)
    models = [pathlib.Path(m).resolve() for m in args.models]
    for given, m in zip(args.models, models):
        if not m.exists():
            fail(f"model not found: {given}")
        if not weight_files(m):
            fail(f"no weight files (*.safetensors or .gguf) in {given}")
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("the plot needs matplotlib (python3 -m pip install matplotlib), or pass --no-plot")
    if not kiln_supports_budget(kiln):
        fail(f"{kiln} has no --ram-budget option (an older build?)")

    names = [model_name(m) for m in models]
    label = re.sub(r"[^A-Za-z0-9._+-]+", "_", args.label or "+".join(names))
    now = datetime.datetime.now(datetime.timezone.utc)
    load_before = loadavg()

    # The disk: the biggest weight file of all the models.
    biggest = max((f for m in models for f in weight_files(m)), key=lambda f: f.stat().st_size)
    log(f"measuring the disk's sequential read rate on {biggest}")
    try:
        disk = read_rates(biggest, args.disk_sample, not args.no_drop_caches)
        log(f"disk {disk['disk_gb_s']:.2f} GB/s ({disk['disk_method']}); page cache {disk['cache_gb_s']:.2f} GB/s")
    except OSError as e:
        disk = {"error": f"{e.strerror or e} reading {biggest}"}
        log(f"disk rate not measured: {disk['error']}")
    disk_gb_s = disk.get("disk_gb_s")

    rows, model_meta, drops = [], [], []
    for model, name in zip(models, names):
        files = weight_files(model)
        info = {"name": name, "path": str(model), "weight_files": [str(f) for f in files],
                "weight_bytes": None, "kv_bytes": None, "kv_source": None}
        model_meta.append(info)

        drop = drop_from_cache(files, not args.no_drop_caches)
        drops.append(drop)
        log(f"{name}: no budget (reference); page cache: {describe_drop(drop)}")
        report, error, cmd, wall, read = run_bench(kiln, model, args)
        wb = (report or {}).get("weight_bytes")
        rows.append(make_row(name, model, None, None, None, wb, report, error, cmd, wall, drop, disk_gb_s, read))
        if error or not wb:
            log(f"{name}: reference run failed ({error or 'no weight_bytes in its JSON'}): skipping its budgets")
            continue
        log(f"{name}: decode {rows[-1]['decode_tok_s']:.2f} tok/s, peak RSS {human(rows[-1]['peak_rss_bytes'])}")
        kv, kv_source, layers = kv_bytes(kiln, model, args.ctx, wb, args.threads)
        info.update(weight_bytes=wb, kv_bytes=kv, kv_source=kv_source, layers=layers,
                    activation_bytes=activation_bytes(kiln, model, args.ctx))
        rows[-1]["kv_bytes"] = kv
        log(f"{name}: weights {human(wb)}, KV cache {human(kv)} at ctx {args.ctx} ({kv_source})")

        for frac in args.fractions:
            budget = int(frac * wb) + kv
            time.sleep(args.rest)
            drop = drop_from_cache(files, not args.no_drop_caches)
            drops.append(drop)
            report, error, cmd, wall, read = run_bench(kiln, model, args, budget)
            row = make_row(name, model, frac, budget, kv, wb, report, error, cmd, wall, drop, disk_gb_s, read, layers)
            rows.append(row)
            if error:
                log(f"{name}: {100 * frac:g} % ({human(budget)}): failed: {error}")
            else:
                log(f"{name}: {100 * frac:g} % ({human(budget)}): decode {row['decode_tok_s']:.2f} tok/s, "
                    f"peak RSS {human(row['peak_rss_bytes'])}, {human(row['streamed_bytes_per_token'])} read per token"
                    + (f", {row['streamed_gb_s']:.2f} GB/s" if row["streamed_gb_s"] is not None else ""))
        time.sleep(args.rest)

    # What worked for dropping the cache, over all runs.
    if drops:
        dc = sum(d["drop_caches"] for d in drops)
        fa = sum(d["fadvise_dontneed"] for d in drops)
        cached = [d["cached_after"] for d in drops if d["cached_after"] is not None]
        errs = {d["drop_caches_error"] for d in drops if d["drop_caches_error"]}
        drop_summary = (f"`sync; echo 1 > /proc/sys/vm/drop_caches` worked in {dc} of {len(drops)} runs"
                        + (f" ({'; '.join(sorted(errs))})" if errs else "")
                        + f"; `posix_fadvise(DONTNEED)` on every weight file worked in {fa} of {len(drops)}"
                        + (f"; at most {100 * max(cached):.1f} % of the weight files still cached afterwards (mincore)"
                           if cached else ""))
    else:
        drop_summary = "no runs"

    meta = {
        "label": label, "date": now.strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_name(), "cpus": os.cpu_count(),
        "mem_total": mem_total(), "kiln": kiln, "debug_build": f"{os.sep}debug{os.sep}" in kiln,
        "threads": args.threads, "prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens,
        "reps": args.reps, "ctx": args.ctx, "fractions": args.fractions,
        "budget_includes": "fraction x weight bytes + KV cache for --ctx positions",
        "load_before": load_before, "load_after": loadavg(), "drop_summary": drop_summary, "disk": disk,
        "models": model_meta,
    }
    base, text = write_results(meta, rows, pathlib.Path(args.out), now.strftime("%Y%m%d-%H%M"), not args.no_plot)
    print(text)
    log(f"written to {base}.md, .json" + ("" if args.no_plot else ", .png"))


if __name__ == "__main__":
    main()
