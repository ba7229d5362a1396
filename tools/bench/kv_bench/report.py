"""Summaries and the SVG chart of a kv_bench run.

Per (engine, case, transport), over the rounds that succeeded:
  latency p50 / p99   over all timed requests of all rounds (ms), from the
                      request's own issue call
  from start p50/p99  the same from the batch's first issue (all requests
                      ready at once; equals the latency at concurrency 1)
  issue p50           time inside the engine's issue call (ms): an engine
                      that moves the bytes there serializes its requests
  GB/s                median over rounds of the round's throughput (timed
                      bytes / summed iteration spans; 1 GB = 1e9 B)
  CPU s per GB        median over rounds of (prefill + decode CPU seconds in
                      the timed windows) / GB moved
  vs baseline         median over rounds of the per-round ratio to the
                      baseline engine (moelink by default) on the same case
                      and transport: GB/s ratio (> 1: faster than the
                      baseline), p50 and from-start p50 ratios (> 1:
                      slower), CPU ratio
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from html import escape
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

Key = Tuple[str, str, str]  # engine, case name, transport


def _round_stats(cell: Dict[str, Any]) -> Optional[Dict[str, float]]:
    if not cell.get("ok"):
        return None
    d, p = cell["decode"], cell["prefill"]
    spans = d["iteration_span_ns"]
    nbytes = d["case"]["concurrency"] * d["case"]["layers"] * d["case"]["tokens"] * d["case"]["bytes_per_token_layer"]
    total = nbytes * len(spans)
    lat = np.asarray(d["latency_ns"], dtype=np.float64) / 1e6
    start = np.asarray(d.get("latency_from_start_ns") or d["latency_ns"], dtype=np.float64) / 1e6
    return {"gbps": total / sum(spans), "p50_ms": float(np.median(lat)),
            "start_p50_ms": float(np.median(start)),
            "cpu_s_per_gb": (d["cpu_s"] + p["cpu_s"]) / (total / 1e9)}


def _median(xs: List[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def summarize(cells: List[Dict[str, Any]], baseline: str = "moelink") -> List[Dict[str, Any]]:
    """One row per (engine, case, transport), in first-seen order."""
    groups: Dict[Key, List[Dict[str, Any]]] = defaultdict(list)
    for c in cells:
        groups[(c["engine"], c["case"], c["transport"])].append(c)
    base_rounds: Dict[Tuple[str, str, int], Dict[str, float]] = {}
    for (eng, case, tr), cs in groups.items():
        if eng == baseline:
            for c in cs:
                s = _round_stats(c)
                if s:
                    base_rounds[(case, tr, c["round"])] = s
    rows = []
    for (eng, case, tr), cs in groups.items():
        first = cs[0]
        row: Dict[str, Any] = {"engine": eng, "case": case, "transport": tr, "model": first["model"],
                               "tokens": first["tokens"], "concurrency": first["concurrency"],
                               "rounds": len(cs), "rounds_ok": sum(1 for c in cs if c.get("ok"))}
        if all(c.get("skipped") for c in cs):
            row.update(skipped=True, reason=first.get("reason"), short=first.get("short"))
            rows.append(row)
            continue
        lat = [x / 1e6 for c in cs if c.get("ok") for x in c["decode"]["latency_ns"]]
        per = [(c["round"], _round_stats(c)) for c in cs]
        per = [(r, s) for r, s in per if s]
        row["latency_ms_p50"] = float(np.percentile(lat, 50)) if lat else None
        row["latency_ms_p99"] = float(np.percentile(lat, 99)) if lat else None
        row["requests"] = len(lat)
        start = [x / 1e6 for c in cs if c.get("ok") for x in c["decode"].get("latency_from_start_ns", [])]
        issue = [x / 1e6 for c in cs if c.get("ok") for x in c["decode"].get("issue_ns", [])]
        row["latency_from_start_ms_p50"] = float(np.percentile(start, 50)) if start else None
        row["latency_from_start_ms_p99"] = float(np.percentile(start, 99)) if start else None
        row["issue_ms_p50"] = float(np.percentile(issue, 50)) if issue else None
        row["gbps"] = _median([s["gbps"] for _, s in per])
        row["gbps_rounds"] = [s["gbps"] for _, s in per]
        row["cpu_s_per_gb"] = _median([s["cpu_s_per_gb"] for _, s in per])
        row["verified_pages"] = sum(c["decode"].get("verified_pages", 0) for c in cs if c.get("ok"))
        ok = [c for c in cs if c.get("ok")]
        if ok:
            row["transport_used"] = ok[0]["prefill"].get("engine", {}).get("transport_used")
        row["env"] = first.get("env")
        errs = sorted({c.get("error", "") for c in cs if not c.get("ok")} - {""})
        if errs:
            row["errors"] = errs
        if eng != baseline:
            ratios = defaultdict(list)
            for r, s in per:
                b = base_rounds.get((case, tr, r))
                if b:
                    ratios["gbps"].append(s["gbps"] / b["gbps"])
                    ratios["p50"].append(s["p50_ms"] / b["p50_ms"])
                    ratios["start_p50"].append(s["start_p50_ms"] / b["start_p50_ms"])
                    ratios["cpu"].append(s["cpu_s_per_gb"] / b["cpu_s_per_gb"] if b["cpu_s_per_gb"] else math.nan)
            row[f"gbps_vs_{baseline}"] = _median(ratios["gbps"])
            row[f"p50_vs_{baseline}"] = _median(ratios["p50"])
            row[f"start_p50_vs_{baseline}"] = _median(ratios["start_p50"])
            row[f"cpu_vs_{baseline}"] = _median(ratios["cpu"])
        rows.append(row)
    return rows


def format_table(rows: List[Dict[str, Any]], baseline: str) -> str:
    """A plain-text table for the terminal."""
    def f(x: Any, fmt: str) -> str:
        return format("-", ">" + fmt.split(".")[0]) if x is None else format(x, fmt)
    head = (f"{'case':26} {'tr':4} {'engine':9} {'p50 ms':>9} {'p99 ms':>9} {'start p50':>9} "
            f"{'issue p50':>9} {'GB/s':>7} {'CPU s/GB':>8} "
            f"{'GB/s x':>7} {'p50 x':>7}  rounds")
    out = [head, "-" * len(head)]
    for r in rows:
        if r.get("skipped"):
            out.append(f"{r['case']:26} {r['transport']:4} {r['engine']:9} skipped: {r['reason'][:80]}")
            continue
        out.append(f"{r['case']:26} {r['transport']:4} {r['engine']:9} {f(r['latency_ms_p50'], '9.3f')} "
                   f"{f(r['latency_ms_p99'], '9.3f')} {f(r.get('latency_from_start_ms_p50'), '9.3f')} "
                   f"{f(r.get('issue_ms_p50'), '9.3f')} {f(r['gbps'], '7.3f')} {f(r['cpu_s_per_gb'], '8.3f')} "
                   f"{f(r.get(f'gbps_vs_{baseline}'), '7.2f')} {f(r.get(f'p50_vs_{baseline}'), '7.2f')}  "
                   f"{r['rounds_ok']}/{r['rounds']}")
        for e in r.get("errors", []):
            out.append(f"{'':41}error: {e[:150]}")
    return "\n".join(out)


# ------------------------------------------------------------------ SVG

COLORS = {"moelink": "#1f77b4", "nixl": "#76b900", "mooncake": "#e377c2"}
FALLBACK = ["#ff7f0e", "#9467bd", "#8c564b"]


def _scale(values: List[float]) -> Tuple[bool, float, float]:
    """(log?, lo, hi) for a panel's axis."""
    vals = [v for v in values if v and v > 0]
    if not vals:
        return False, 0.0, 1.0
    lo, hi = min(vals), max(vals)
    if hi / lo > 30:
        return True, 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
    return False, 0.0, hi * 1.15


def _pos(v: float, log: bool, lo: float, hi: float, width: float) -> float:
    if log:
        return width * (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    return width * v / hi


def _fmt(v: float) -> str:
    return f"{v:.3g}" if v < 1000 else f"{v:.0f}"


def render_svg(rows: List[Dict[str, Any]], engines: List[str], title: str, subtitle: str,
               cannot_run: Optional[Dict[str, str]] = None) -> str:
    """Grid of bar panels: rows = (model, tokens); columns = per transport
    class, p50 latency at concurrency 1 (p99 as a whisker; lower is better)
    and GB/s at concurrency 16 (higher is better). The best bar of a panel
    has its value in bold."""
    by = {(r["model"], r["tokens"], r["concurrency"], r["transport"], r["engine"]): r for r in rows}
    cases = sorted({(r["model"], r["tokens"]) for r in rows}, key=lambda x: (x[0], x[1]))
    transports = [t for t in ("shm", "tcp") if any(r["transport"] == t for r in rows)]
    cols = [(t, m) for t in transports for m in ("lat", "gbps")]
    colors = {e: COLORS.get(e, FALLBACK[i % len(FALLBACK)]) for i, e in enumerate(engines)}
    label_w, panel_w, bar_h, gap = 150, 250, 18, 6
    panel_h = 34 + len(engines) * (bar_h + gap) + 18
    top = 92
    width = label_w + len(cols) * (panel_w + 20) + 20
    height = top + len(cases) * panel_h + 60
    s = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'font-family="Helvetica, Arial, sans-serif" font-size="11">',
         f'<rect width="{width}" height="{height}" fill="white"/>',
         f'<text x="{width / 2}" y="22" font-size="16" font-weight="bold" text-anchor="middle">{escape(title)}</text>',
         f'<text x="{width / 2}" y="40" font-size="11" text-anchor="middle" fill="#444">{escape(subtitle)}</text>']
    lx = label_w
    for e in engines:  # legend
        s.append(f'<rect x="{lx}" y="50" width="12" height="12" fill="{colors[e]}"/>')
        s.append(f'<text x="{lx + 16}" y="60">{escape(e)}</text>')
        lx += 24 + 7 * len(e) + 20
    s.append(f'<text x="{lx + 10}" y="60" fill="#444">bars: p50 latency (whisker: p99) at concurrency 1, '
             f'lower is better; GB/s at concurrency 16, higher is better; bold = best</text>')
    for ci, (t, m) in enumerate(cols):
        x0 = label_w + ci * (panel_w + 20)
        what = "p50 latency, c=1 (ms)" if m == "lat" else "throughput, c=16 (GB/s)"
        s.append(f'<text x="{x0 + panel_w / 2}" y="{top - 8}" font-weight="bold" text-anchor="middle">'
                 f'{escape(t)} class: {what}</text>')
    for ri, (model, tokens) in enumerate(cases):
        y0 = top + ri * panel_h
        s.append(f'<text x="10" y="{y0 + panel_h / 2}" font-weight="bold">{escape(model)}</text>')
        s.append(f'<text x="10" y="{y0 + panel_h / 2 + 14}">{tokens} tokens</text>')
        for ci, (t, m) in enumerate(cols):
            x0 = label_w + ci * (panel_w + 20)
            conc = 1 if m == "lat" else 16
            vals: Dict[str, Optional[float]] = {}
            notes: Dict[str, str] = {}
            for e in engines:
                r = by.get((model, tokens, conc, t, e))
                v = None if r is None else (r.get("latency_ms_p50") if m == "lat" else r.get("gbps"))
                vals[e] = v
                if v is None:
                    notes[e] = ("cannot run here" if cannot_run and e in cannot_run else "not run" if r is None
                                else "skipped: " + r.get("short", "see JSON") if r.get("skipped")
                                else "failed (see JSON)")
            extra = [by[(model, tokens, conc, t, e)].get("latency_ms_p99") for e in engines
                     if m == "lat" and (model, tokens, conc, t, e) in by]
            log, lo, hi = _scale([v for v in vals.values() if v] + [v for v in extra if v])
            inner = panel_w - 60
            s.append(f'<rect x="{x0}" y="{y0 + 4}" width="{panel_w}" height="{panel_h - 12}" fill="#fafafa" '
                     f'stroke="#ddd"/>')
            present = [v for v in vals.values() if v]
            best = (min(present) if m == "lat" else max(present)) if present else None
            for k, e in enumerate(engines):
                by_ = y0 + 14 + k * (bar_h + gap)
                v = vals[e]
                if v is None:
                    s.append(f'<text x="{x0 + 6}" y="{by_ + 13}" fill="#999">{escape(e)}: {notes[e]}</text>')
                    continue
                w = max(1.0, _pos(max(v, lo) if log else v, log, lo, hi, inner))
                s.append(f'<rect x="{x0 + 4}" y="{by_}" width="{w:.1f}" height="{bar_h}" fill="{colors[e]}"/>')
                label_x = x0 + 8 + w
                if m == "lat":
                    p99 = by[(model, tokens, conc, t, e)].get("latency_ms_p99")
                    if p99:
                        px = x0 + 4 + _pos(p99, log, lo, hi, inner)
                        s.append(f'<line x1="{x0 + 4 + w:.1f}" y1="{by_ + bar_h / 2}" x2="{px:.1f}" '
                                 f'y2="{by_ + bar_h / 2}" stroke="#333"/>')
                        s.append(f'<line x1="{px:.1f}" y1="{by_ + 4}" x2="{px:.1f}" y2="{by_ + bar_h - 4}" '
                                 f'stroke="#333"/>')
                        label_x = max(label_x, px + 4)
                weight = ' font-weight="bold"' if v == best else ""
                s.append(f'<text x="{label_x:.1f}" y="{by_ + 13}"{weight}>{_fmt(v)}</text>')
            axis_y = y0 + panel_h - 14
            unit = "ms" if m == "lat" else "GB/s"
            s.append(f'<text x="{x0 + panel_w - 4}" y="{axis_y}" text-anchor="end" fill="#666" font-size="9">'
                     f'{"log" if log else "linear"} axis, {unit}, 0..{_fmt(hi) if not log else f"{_fmt(lo)}..{_fmt(hi)}"}'
                     f'</text>')
    s.append(f'<text x="10" y="{height - 20}" fill="#666" font-size="10">Each bar: all rounds of that engine; '
             'engines interleaved and rotated per round; every page of every request verified (xxh3-64).</text>')
    s.append("</svg>")
    return "\n".join(s)
