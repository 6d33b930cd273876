"""Nsight Compute exports -> one summary row per profiled kernel, and their Markdown table.

`scripts/profile_decode.py` profiles each decode variant's kernels under `ncu` and exports every report three
ways; this module reads those CSV texts (no ncu needed, so it is tested on a CPU with fixtures):

    --page details --csv --print-units base   one row per (kernel, section, metric) as ncu's sections show them
    --page raw --csv --print-units base       one row per kernel, a column per collected metric (row 2: units);
                                              the warp-state breakdown comes from here
    --page source --csv --print-source sass   per kernel a block of SASS lines with their stall samples (best
                                              effort: the column names moved between ncu versions)

Numbers may carry thousands separators ("1,024"); units are normalised here (durations to us, rates to GB/s,
sizes to bytes) so that a report written with other display units still parses the same.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# the identity columns every ncu CSV page starts with (a raw page's metric columns follow them)
ID_COLUMNS = ("ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
              "Grid Size", "Device", "CC")

# (section, metric) of the details page -> summary column. Section names are matched case-insensitively
# on their start, since ncu's display names changed ("GPU Speed Of Light Throughput" vs "SpeedOfLight").
DETAILS: dict[str, tuple[tuple[str, str], ...]] = {
    "duration_us": (("gpu speed of light", "Duration"),),
    "dram_pct": (("gpu speed of light", "DRAM Throughput"),),
    "mem_pct": (("gpu speed of light", "Memory Throughput"),),
    "sm_pct": (("gpu speed of light", "Compute (SM) Throughput"),),
    "sm_freq_ghz": (("gpu speed of light", "SM Frequency"),),
    "mem_gbps": (("memory workload analysis", "Memory Throughput"),),
    "l2_hit_pct": (("memory workload analysis", "L2 Hit Rate"),),
    "mem_busy_pct": (("memory workload analysis", "Mem Busy"),),
    "max_bw_pct": (("memory workload analysis", "Max Bandwidth"),),
    "regs": (("launch statistics", "Registers Per Thread"),),
    "dyn_smem_bytes": (("launch statistics", "Dynamic Shared Memory Per Block"),),
    "static_smem_bytes": (("launch statistics", "Static Shared Memory Per Block"),),
    "block": (("launch statistics", "Block Size"),),
    "grid": (("launch statistics", "Grid Size"),),
    "waves": (("launch statistics", "Waves Per SM"),),
    "occ_theory_pct": (("occupancy", "Theoretical Occupancy"),),
    "occ_achieved_pct": (("occupancy", "Achieved Occupancy"),),
    "active_warps_sched": (("scheduler statistics", "Active Warps Per Scheduler"),),
    "eligible_warps_sched": (("scheduler statistics", "Eligible Warps Per Scheduler"),),
    "issue_active_pct": (("scheduler statistics", "One or More Eligible"),),
    "issue_slots_busy_pct": (("compute workload analysis", "Issue Slots Busy"),),
    "ipc_active": (("compute workload analysis", "Executed Ipc Active"),),
    "warp_cycles_per_issue": (("warp state statistics", "Warp Cycles Per Issued Instruction"),),
}
# raw-page metrics that give the DRAM bytes (achieved GB/s = bytes / duration, not a sampled rate)
RAW_DRAM = ("dram__bytes_read.sum", "dram__bytes_write.sum")
RAW_DURATION = "gpu__time_duration.sum"
# warp-state breakdown, best source first: cycles per issued instruction per reason (what the WarpStateStats
# section charts), else the PC-sampling counts. "selected" is the issuing warp, not a stall.
STALL_PATTERNS = (
    ("cycles/issue", re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")),
    ("pc samples", re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+)$")),
)
NOT_A_STALL = ("selected",)

SUMMARY_COLUMNS = (
    "shape", "variant", "kernel_role", "kernel", "id", "duration_us", "dram_pct", "dram_gbps", "mem_gbps",
    "sm_pct", "mem_pct", "l2_hit_pct", "occ_achieved_pct", "occ_theory_pct", "regs", "smem_bytes", "block", "grid",
    "waves", "active_warps_sched", "eligible_warps_sched", "issue_active_pct", "issue_slots_busy_pct", "ipc_active",
    "warp_cycles_per_issue", "stall_source", "stalls", "hot_sass",
)

_TIME_ABBREV = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_PREFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def number(text: Any) -> float | None:
    """ncu's printed number ("1,024", "87.5", "n/a", "") as a float, or None."""
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text or "").strip().replace(",", "")
    if not s:
        return None
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def to_base(value: float, unit: str) -> tuple[float, str]:
    """(value, unit) in base units: seconds, bytes, bytes/second, hertz; other units (%, register/thread,
    'cycle', 'warp', 'inst') unchanged. 'Kbyte/block' -> bytes/block."""
    u = (unit or "").strip()
    if u in _TIME_ABBREV:  # the raw page prints durations as "ns" / "us" / "ms" whatever --print-units says
        return value * _TIME_ABBREV[u], "second"
    u = re.sub(r"/s$", "/second", u)  # "byte/s" (ncu 2025) = "byte/second"
    m = re.fullmatch(r"([numkKMGT]?)(second|byte|hz|cycle/second)(/second)?(/block)?", u, flags=re.IGNORECASE)
    if not m:
        return value, u
    prefix, base, per_s, per_block = m.groups()
    if base.lower() == "hz" and prefix == "m":  # "mhz" never means milli-hertz
        prefix = "M"
    scale = _PREFIX.get(prefix, _PREFIX.get(prefix.upper(), 1.0))
    return value * scale, base.lower() + (per_s or "") + (per_block or "")


def _rows(text: str) -> list[list[str]]:
    """CSV rows after any ncu banner lines ('==PROF==', '==WARNING==') before the header."""
    lines = [ln for ln in text.splitlines() if not ln.startswith("==")]
    return [r for r in csv.reader(io.StringIO("\n".join(lines))) if r]


@dataclass
class KernelReport:
    """One profiled kernel: identity, details-page metrics (section, name) -> (value, unit), raw metrics."""

    id: str
    name: str
    block: str = ""
    grid: str = ""
    details: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    raw: dict[str, tuple[str, str]] = field(default_factory=dict)
    source: list[dict[str, Any]] = field(default_factory=list)

    def detail(self, section_prefix: str, metric: str) -> tuple[float, str] | None:
        for (sec, name), (val, unit) in self.details.items():
            if name == metric and sec.lower().startswith(section_prefix):
                v = number(val)
                return None if v is None else (v, unit)
        return None

    def raw_value(self, metric: str) -> float | None:
        hit = self.raw.get(metric)
        if hit is None:
            return None
        v = number(hit[0])
        return None if v is None else to_base(v, hit[1])[0]


def parse_details(text: str) -> dict[str, KernelReport]:
    """`--page details --csv`: kernels by ID, in the report's order."""
    rows = _rows(text)
    if not rows:
        return {}
    head = rows[0]
    col = {name: i for i, name in enumerate(head)}
    need = ("ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value")
    missing = [c for c in need if c not in col]
    if missing:
        raise ValueError(f"not an ncu details CSV: missing columns {missing} in header {head[:16]}")
    out: dict[str, KernelReport] = {}
    last = max(col[c] for c in need)
    for r in rows[1:]:
        # ncu 2025+ ends a metric row after its value (the rule columns are left off), so a row may be
        # shorter than the header: it needs only the columns up to the value
        if len(r) <= last or r[col["ID"]] == "ID":
            continue
        r = r + [""] * (len(head) - len(r))
        kid = r[col["ID"]]
        k = out.setdefault(kid, KernelReport(kid, r[col["Kernel Name"]], r[col["Block Size"]] if "Block Size" in col
                                             else "", r[col["Grid Size"]] if "Grid Size" in col else ""))
        name = r[col["Metric Name"]]
        if name:
            k.details[(r[col["Section Name"]], name)] = (r[col["Metric Value"]], r[col["Metric Unit"]])
    return out


def parse_raw(text: str) -> dict[str, tuple[str, dict[str, tuple[str, str]]]]:
    """`--page raw --csv`: kernel ID -> (kernel name, metric -> (value, unit)). Row 2 holds the units."""
    rows = _rows(text)
    if len(rows) < 2:
        return {}
    head = rows[0]
    if "ID" not in head or "Kernel Name" not in head:
        raise ValueError(f"not an ncu raw CSV: header {head[:12]}")
    units = rows[1] if rows[1] and rows[1][head.index("ID")] in ("", "ID") else [""] * len(head)
    body = rows[2:] if units is rows[1] else rows[1:]
    i_id, i_name = head.index("ID"), head.index("Kernel Name")
    out = {}
    for r in body:
        if len(r) < len(head):
            continue
        metrics = {m: (r[j], units[j] if j < len(units) else "") for j, m in enumerate(head) if m not in ID_COLUMNS}
        out[r[i_id]] = (r[i_name], metrics)
    return out


def stall_breakdown(raw: dict[str, tuple[str, str]]) -> tuple[str, list[tuple[str, float, float]]]:
    """(source, [(reason, value, share of all warp states)] sorted by value, stalls only). Shares count the
    'selected' state in the total, so they read as "fraction of a warp's cycles spent in this state"."""
    for source, pat in STALL_PATTERNS:
        vals: dict[str, float] = {}
        for metric, (val, _unit) in raw.items():
            m = pat.match(metric)
            v = number(val)
            if m and v is not None and not m.group(1).endswith("_not_issued"):
                vals[m.group(1)] = v
        total = sum(vals.values())
        if vals and total > 0:
            ranked = sorted(((k, v, v / total) for k, v in vals.items() if k not in NOT_A_STALL),
                            key=lambda t: -t[1])
            return source, ranked
    return "", []


def parse_source(text: str, top: int = 8) -> list[list[dict[str, Any]]]:
    """`--page source --csv --print-source sass`: per kernel block (in report order) its `top` SASS lines by
    warp-stall samples. A block starts at each header row (one with an 'Address' or 'Source' column and a
    'Warp Stall Sampling' column); a text without one gives []."""
    blocks: list[list[dict[str, Any]]] = []
    head: list[str] | None = None
    i_samp = i_src = i_addr = -1
    cur: list[dict[str, Any]] = []
    for r in _rows(text):
        samp = [i for i, c in enumerate(r) if c.startswith("Warp Stall Sampling (All")]
        if samp and ("Source" in r or "Address" in r):
            if head is not None:
                blocks.append(_top(cur, top))
            head, cur, i_samp = r, [], samp[0]
            i_src = r.index("Source") if "Source" in r else -1
            i_addr = r.index("Address") if "Address" in r else -1
            continue
        if head is None or len(r) <= i_samp:
            continue
        n = number(r[i_samp])
        if n is None:
            continue
        cur.append({"address": r[i_addr] if i_addr >= 0 else "", "source": r[i_src].strip() if i_src >= 0 else "",
                    "samples": n})
    if head is not None:
        blocks.append(_top(cur, top))
    return blocks


def _top(lines: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    total = sum(ln["samples"] for ln in lines) or 1.0
    ranked = sorted(lines, key=lambda ln: -ln["samples"])[:top]
    return [dict(ln, share=ln["samples"] / total) for ln in ranked]


def merge(details_text: str, raw_text: str = "", source_text: str = "") -> list[KernelReport]:
    """The kernels of one report with all three pages joined (by ID; source blocks by order)."""
    kernels = parse_details(details_text)
    for kid, (name, metrics) in (parse_raw(raw_text) if raw_text.strip() else {}).items():
        k = kernels.setdefault(kid, KernelReport(kid, name))
        k.raw = metrics
    blocks = parse_source(source_text) if source_text.strip() else []
    for k, block in zip(kernels.values(), blocks, strict=False):
        k.source = block
    return list(kernels.values())


def kernel_role(name: str) -> str:
    return "combine" if "combine" in name.lower() else "decode"


def short_name(name: str, width: int = 48) -> str:
    """A readable kernel name: template arguments and parameter lists dropped (FlashMLA's are long)."""
    base = re.sub(r"\(.*\)$", "", name)
    depth, out = 0, []
    for ch in base:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">" and depth > 0
    s = "".join(out).strip() or name
    return s if len(s) <= width else s[: width - 3] + "..."


def summarize(k: KernelReport, shape: str = "", variant: str = "", n_stalls: int = 5) -> dict[str, Any]:
    """The summary row of one kernel (SUMMARY_COLUMNS); a metric the report lacks is None."""
    row: dict[str, Any] = {"shape": shape, "variant": variant, "kernel_role": kernel_role(k.name),
                           "kernel": short_name(k.name), "id": k.id}
    for key, candidates in DETAILS.items():
        row[key] = None
        for sec, metric in candidates:
            hit = k.detail(sec, metric)
            if hit is not None:
                row[key] = _normalise(key, *hit)
                break
    row["block"] = row["block"] if row["block"] is not None else k.block
    row["grid"] = row["grid"] if row["grid"] is not None else k.grid
    dyn, static = row.pop("dyn_smem_bytes"), row.pop("static_smem_bytes")
    row["smem_bytes"] = None if dyn is None and static is None else (dyn or 0) + (static or 0)
    dur_s = k.raw_value(RAW_DURATION)
    if dur_s is None and row["duration_us"] is not None:
        dur_s = row["duration_us"] * 1e-6
    dram = [k.raw_value(m) for m in RAW_DRAM]
    row["dram_gbps"] = (sum(v for v in dram if v is not None) / dur_s / 1e9
                        if dur_s and any(v is not None for v in dram) else None)
    if row["duration_us"] is None and dur_s:
        row["duration_us"] = dur_s * 1e6
    source, stalls = stall_breakdown(k.raw)
    row["stall_source"] = source
    row["stalls"] = "; ".join(f"{r} {share:.0%}" for r, _v, share in stalls[:n_stalls])
    row["hot_sass"] = " | ".join(f"{ln['source'][:60]} ({ln['share']:.0%})" for ln in k.source[:5])
    return {c: row.get(c) for c in SUMMARY_COLUMNS}


def _normalise(key: str, value: float, unit: str) -> float:
    v, base = to_base(value, unit)
    if key == "duration_us" and base == "second":
        return v * 1e6
    if key == "mem_gbps" and base == "byte/second":
        return v / 1e9
    if key == "sm_freq_ghz" and base in ("hz", "cycle/second"):
        return v / 1e9
    return v


def summary_csv(rows: Iterable[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(SUMMARY_COLUMNS), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: "" if r.get(c) is None else (f"{r[c]:.4g}" if isinstance(r[c], float) else r[c])
                    for c in SUMMARY_COLUMNS})
    return buf.getvalue()


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None or v == "" else (fmt.format(v) if isinstance(v, (int, float)) else str(v))


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    """Two tables: throughput / launch / occupancy per kernel, then where its warps wait."""
    out = ["| shape | variant | kernel | us | DRAM % | DRAM GB/s | SM % | occ. % (theory) | regs | smem KB | "
           "grid x block | waves |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        smem = None if r["smem_bytes"] is None else r["smem_bytes"] / 1024
        out.append(f"| {r['shape']} | {r['variant']} | {r['kernel_role']}: `{r['kernel']}` | {_f(r['duration_us'])} | "
                   f"{_f(r['dram_pct'])} | {_f(r['dram_gbps'], '{:.0f}')} | {_f(r['sm_pct'])} | "
                   f"{_f(r['occ_achieved_pct'])} ({_f(r['occ_theory_pct'], '{:.0f}')}) | {_f(r['regs'], '{:.0f}')} | "
                   f"{_f(smem)} | {_f(r['grid'], '{:.0f}')} x {_f(r['block'], '{:.0f}')} | {_f(r['waves'], '{:.2f}')} |")
    out += ["", "| shape | variant | kernel | eligible warps / sched. (active) | issue active % | warp cycles / issue | "
            "top stalls (share of warp states) | hottest SASS (share of stall samples) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['variant']} | {r['kernel_role']} | {_f(r['eligible_warps_sched'], '{:.2f}')} "
                   f"({_f(r['active_warps_sched'], '{:.2f}')}) | {_f(r['issue_active_pct'])} | "
                   f"{_f(r['warp_cycles_per_issue'])} | {r['stalls'] or '-'} | {r['hot_sass'] or '-'} |")
    return "\n".join(out) + "\n"
