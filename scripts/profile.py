#!/usr/bin/env python3
"""Summarise a Kiln profile (KILN_PROFILE=1) per kernel family.

    KILN_PROFILE=1 kiln bench MODEL            # writes kiln-profile.json
    python3 scripts/profile.py kiln-profile.json [--plan decode] [--by symbol]

For each plan (decode, prefill, and their output heads) prints, per kernel family (or per
symbol): time per token, share of the token, bytes moved per token, achieved GB/s and GFLOP/s,
and the share of the machine's probed read bandwidth / FMA peak at the same thread count.
Times are thread 0's view: a node's time includes the wait at the barrier that follows it, so
load imbalance is charged to the kernel that caused it.
"""

import argparse
import json
import sys
from collections import OrderedDict


def summarise(plan, head, key, read_peak, fma_peak):
    rows = plan["rows"] or 1
    groups = OrderedDict()
    for source in [plan] + ([head] if head else []):
        for n in source["nodes"]:
            k = n[key]
            if source is head:
                k = f"{k} (head)"
            g = groups.setdefault(k, {"nanos": 0, "bytes": 0, "flops": 0, "calls": 0})
            g["nanos"] += n["nanos"]
            g["bytes"] += n["bytes"]
            g["flops"] += n["flops"]
            g["calls"] += 1
    total_ns = sum(g["nanos"] for g in groups.values()) or 1
    out = []
    for k, g in sorted(groups.items(), key=lambda kv: -kv[1]["nanos"]):
        ns = g["nanos"]
        gbs = g["bytes"] / ns if ns else 0.0  # bytes per ns = GB/s
        gflops = g["flops"] / ns if ns else 0.0
        out.append({
            "name": k,
            "ms_per_token": ns / rows / 1e6,
            "share": 100.0 * ns / total_ns,
            "mb_per_token": g["bytes"] / rows / 1e6,
            "gb_s": gbs,
            "pct_read": 100.0 * gbs / read_peak if read_peak else None,
            "gflop_s": gflops,
            "pct_fma": 100.0 * gflops / fma_peak if fma_peak else None,
            "nodes": g["calls"],
        })
    return out, total_ns / rows / 1e6


def barrier_report(name, plan, head):
    """Barriers per token and the time each thread waited at them: the cost of the barriers
    themselves plus load imbalance (a thread that finishes its share early waits)."""
    parts = [p for p in (plan, head) if p and "barrier_wait_nanos" in p]
    if not parts:
        return
    rows = plan["rows"] or 1
    per_run = sum(p.get("barriers_per_run", 0) * (p["runs"] or 0) for p in parts) / (plan["runs"] or 1)
    waits = [sum(w) for w in zip(*(p["barrier_wait_nanos"] for p in parts))]
    unit = "token" if name == "decode" else "prompt token"
    per_tok = ", ".join(f"thread {i} {w / rows / 1e6:.3f} ms" for i, w in enumerate(waits))
    print(f"barriers: {per_run:.0f} per run; waited per {unit}: {per_tok}")


def fmt_pct(v):
    return "   -" if v is None else f"{v:4.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", nargs="?", default="kiln-profile.json")
    ap.add_argument("--plan", choices=["decode", "prefill", "all"], default="all")
    ap.add_argument("--by", choices=["family", "symbol"], default="family")
    ap.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = ap.parse_args()
    data = json.load(open(args.profile))
    plans = {p["name"]: p for p in data["plans"]}
    read_peak, fma_peak = data.get("probe_read_gb_s"), data.get("probe_fma_gflop_s")
    print(f"{data['model']}, {data['threads']} threads; probe: "
          f"{read_peak and f'{read_peak:.1f} GB/s' or 'n/a'} read, {fma_peak and f'{fma_peak:.0f} GFLOP/s' or 'n/a'} FMA")
    for name in ["decode", "prefill"]:
        if args.plan not in ("all", name) or name not in plans:
            continue
        plan, head = plans[name], plans.get(f"{name}_head")
        if name == "prefill" and head:
            # The head runs once per prefill, not per row: spread it over the prompt's rows.
            head = dict(head, rows=plan["rows"])
        rows, total = summarise(plan, head, args.by, read_peak, fma_peak)
        unit = "token" if name == "decode" else "prompt token"
        print(f"\n{name}: {total:.3f} ms per {unit} over {plan['rows']} {unit}s ({plan['runs']} runs)")
        header = ["kernel", "ms/tok", "share %", "MB/tok", "GB/s", "% read", "GFLOP/s", "% FMA", "nodes"]
        if args.markdown:
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
        else:
            print(f"{'kernel':<44} {'ms/tok':>8} {'share%':>7} {'MB/tok':>8} {'GB/s':>7} {'%read':>6} {'GFLOP/s':>8} {'%FMA':>5} {'nodes':>5}")
        for r in rows:
            cells = [r["name"], f"{r['ms_per_token']:.4f}", f"{r['share']:.1f}", f"{r['mb_per_token']:.2f}", f"{r['gb_s']:.1f}",
                     fmt_pct(r["pct_read"]).strip(), f"{r['gflop_s']:.1f}", fmt_pct(r["pct_fma"]).strip(), str(r["nodes"])]
            if args.markdown:
                print("| " + " | ".join(cells) + " |")
            else:
                print(f"{cells[0][:44]:<44} {cells[1]:>8} {cells[2]:>7} {cells[3]:>8} {cells[4]:>7} {cells[5]:>6} {cells[6]:>8} {cells[7]:>5} {cells[8]:>5}")
        barrier_report(name, plan, head)
    return 0


if __name__ == "__main__":
    sys.exit(main())
