"""snapquant.bench.ncu: Nsight Compute CSV exports -> summary rows (CPU, fixtures shaped like ncu 2025's output)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from snapquant.bench import ncu

ROOT = Path(__file__).resolve().parents[1]

_HEAD = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
_K0 = '"0","1","python3","h","_mla_decode_gluon_wide","1","7","(256, 1, 1)","(1, 64, 1)","0","9.0"'
_K1 = '"1","1","python3","h","mla_decode_combine","1","7","(128, 1, 1)","(64, 64, 1)","0","9.0"'
DETAILS = "\n".join([
    "==PROF== Disconnected from process 1",
    _HEAD,
    f'{_K0},"GPU Speed Of Light Throughput","Duration","nsecond","508,300"',
    f'{_K0},"GPU Speed Of Light Throughput","DRAM Throughput","%","41.5"',
    f'{_K0},"GPU Speed Of Light Throughput","Compute (SM) Throughput","%","63.2"',
    f'{_K0},"Memory Workload Analysis","Memory Throughput","byte/second","1,795,000,000,000"',
    f'{_K0},"Launch Statistics","Registers Per Thread","register/thread","168"',
    f'{_K0},"Launch Statistics","Dynamic Shared Memory Per Block","byte/block","221,184"',
    f'{_K0},"Launch Statistics","Static Shared Memory Per Block","Kbyte/block","1.02"',
    f'{_K0},"Launch Statistics","Grid Size","","128"',
    f'{_K0},"Launch Statistics","Block Size","","256"',
    f'{_K0},"Occupancy","Achieved Occupancy","%","12.4"',
    f'{_K0},"Occupancy","Theoretical Occupancy","%","12.5"',
    f'{_K0},"Scheduler Statistics","Eligible Warps Per Scheduler","warp","0.31"',
    f'{_K0},"Scheduler Statistics","One or More Eligible","%","24.0"',
    f'{_K0},"Launch Statistics","","",""',  # a rule row: no metric
    f'{_K1},"GPU Speed Of Light Throughput","Duration","usecond","6.5"',
])
_RAW_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
             '"Device","CC","dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum",'
             '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
             '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
             '"smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",'
             '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",'
             '"smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio"')
RAW = "\n".join([
    _RAW_HEAD,
    '"","","","","","","","","","","","byte","byte","nsecond","inst","inst","inst","inst","inst"',
    '"0","1","python3","h","_mla_decode_gluon_wide","1","7","(256, 1, 1)","(1, 64, 1)","0","9.0",'
    '"337,641,472","2,000,000","508,300","1.0","3.0","1.0","4.0","1.0"',
    '"1","1","python3","h","mla_decode_combine","1","7","(128, 1, 1)","(64, 64, 1)","0","9.0",'
    '"1,000","0","6,500","","","","",""',
])
SOURCE = "\n".join([
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
    '"0x10","HGMMA.64x256x16.F32 R24, gdesc[UR4], R24","30","28"',
    '"0x20","SYNCS.ARRIVE.TRANS64 [UR8], RZ","50","49"',
    '"0x30","FMUL R1, R2, R3","20","5"',
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"',
    '"0x10","LDG.E R2, [R4]","9","9"',
])


def test_a_report_becomes_one_row_per_kernel_with_normalised_units():
    k0, k1 = ncu.merge(DETAILS, RAW, SOURCE)
    r = ncu.summarize(k0, "64x128x8192", "snapmla")
    assert (r["kernel_role"], r["kernel"]) == ("decode", "_mla_decode_gluon_wide")
    assert r["duration_us"] == pytest.approx(508.3)
    assert r["mem_gbps"] == pytest.approx(1795.0)
    assert r["dram_gbps"] == pytest.approx((337_641_472 + 2_000_000) / 508.3e-6 / 1e9)
    assert r["smem_bytes"] == pytest.approx(221_184 + 1020)
    assert (r["regs"], r["grid"], r["block"]) == (168, 128, 256)
    assert r["eligible_warps_sched"] == pytest.approx(0.31)
    # stalls ranked by cycles, shares over all warp states (selected counted in the total, not listed)
    assert r["stall_source"] == "cycles/issue"
    assert r["stalls"] == "wait 40%; barrier 30%; long_scoreboard 10%; math_pipe_throttle 10%"
    assert r["hot_sass"].startswith("SYNCS.ARRIVE.TRANS64 [UR8], RZ (50%) | HGMMA")
    c = ncu.summarize(k1)
    assert c["kernel_role"] == "combine" and c["duration_us"] == pytest.approx(6.5)
    assert c["stalls"] == "" and c["hot_sass"] == "LDG.E R2, [R4] (100%)"


def test_pc_samples_are_the_fallback_and_not_issued_counts_are_not_double_counted():
    raw = {"smsp__pcsamp_warps_issue_stalled_barrier": ("300", ""),
           "smsp__pcsamp_warps_issue_stalled_barrier_not_issued": ("290", ""),
           "smsp__pcsamp_warps_issue_stalled_selected": ("100", ""),
           "smsp__pcsamp_warps_issue_stalled_long_scoreboard": ("600", "")}
    source, ranked = ncu.stall_breakdown(raw)
    assert source == "pc samples"
    assert [(n, round(s, 2)) for n, _v, s in ranked] == [("long_scoreboard", 0.6), ("barrier", 0.3)]


def test_units_numbers_and_names():
    assert ncu.number("1,024") == 1024.0 and ncu.number("n/a") is None and ncu.number("") is None
    assert ncu.to_base(2.5, "Tbyte/second") == (2.5e12, "byte/second")
    assert ncu.to_base(3.0, "usecond") == pytest.approx((3e-6, "second"))
    assert ncu.to_base(1.5, "Kbyte/block") == (1500.0, "byte/block")
    assert ncu.to_base(12.0, "%") == (12.0, "%")
    name = "void flash::flash_fwd_splitkv_mla_kernel<Traits<64, 576>, true>(flash::Params)"
    assert ncu.short_name(name) == "void flash::flash_fwd_splitkv_mla_kernel"


def test_a_csv_that_is_not_an_ncu_page_is_an_error():
    with pytest.raises(ValueError, match="not an ncu details CSV"):
        ncu.parse_details('"a","b"\n"1","2"\n')
    with pytest.raises(ValueError, match="not an ncu raw CSV"):
        ncu.parse_raw('"a","b"\n"1","2"\n')
    assert ncu.parse_source("no header here\n") == []


def _script():
    spec = importlib.util.spec_from_file_location("profile_decode", ROOT / "scripts" / "profile_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profiles_are_named_by_the_gpu_they_ran_on(tmp_path):
    pd = _script()
    assert pd.gpu_tag("NVIDIA H100 80GB HBM3") == ("h100", "NVIDIA H100 80GB HBM3")
    assert pd.gpu_tag("NVIDIA H200")[0] == "h200" and pd.gpu_tag("NVIDIA A100-SXM4-80GB")[0] == "nvidia_a100_sxm4_80gb"
    d = tmp_path / "ncu"
    d.mkdir()
    for page, text in (("details", DETAILS), ("raw", RAW), ("source", SOURCE)):
        (d / f"64x128x8192_snapmla-gluon-fp8mma.{page}.csv").write_text(text)
    assert pd.main(["summarize", "--ncu-dir", str(d), "--out", str(tmp_path), "--gpu", "NVIDIA H100 80GB HBM3"]) == 0
    assert (tmp_path / "profile_h100.md").read_text().startswith("# Decode kernels under Nsight Compute (NVIDIA H100")
    assert (tmp_path / "profile_h100.csv").exists() and not (tmp_path / "profile_h200.md").exists()


def test_the_script_summarises_exported_reports_and_picks_knob_alternatives(tmp_path):
    pd = _script()
    d = tmp_path / "ncu"
    d.mkdir()
    for page, text in (("details", DETAILS), ("raw", RAW), ("source", SOURCE)):
        (d / f"64x128x8192_snapmla-gluon-fp8mma.{page}.csv").write_text(text)
    rows = pd.write_summary(d, tmp_path)
    assert [(r["shape"], r["variant"], r["kernel_role"]) for r in rows] == [
        ("64x128x8192", "snapmla+gluon+fp8mma", "decode"), ("64x128x8192", "snapmla+gluon+fp8mma", "combine")]
    md = (tmp_path / "profile_h200.md").read_text()
    assert "| 64x128x8192 | snapmla+gluon+fp8mma | decode: `_mla_decode_gluon_wide` | 508.3 | 41.5 |" in md
    assert "| 217.0 | 128 x 256 |" in md and "wait 40%; barrier 30%" in md
    assert (tmp_path / "profile_h200.csv").read_text().splitlines()[0].startswith("shape,variant,kernel_role")
    base = {"variant": "snapmla+gluon+fp8mma", "status": "ok", "resolved": "kernel=gluon.narrow8 num_splits=4"}
    assert pd.alternatives(base, 64) == [("splits2", {"num_splits": 2}), ("splits8", {"num_splits": 8}),
                                         ("s3", {"num_stages": 3}), ("s4", {"num_stages": 4})]
    assert pd.alternatives(dict(base, variant="snapmla", resolved="num_splits=1"), 128) == [
        ("splits2", {"num_splits": 2})]
    assert pd.alternatives(base, 16) == []
    assert pd.alternatives(dict(base, variant="snapmla", resolved="num_splits=1"), 128, fp8_p=True) == [
        ("splits2", {"num_splits": 2}), ("rcp", {"p_div": "rcp"})]
    cmd = pd.ncu_command("ncu", tmp_path / "x.ncu-rep", ["python", "w.py"])
    assert cmd[:7] == ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--cache-control", "all"]
    assert cmd[-2:] == ["python", "w.py"] and "SourceCounters" in cmd


def test_a_real_ncu_2025_export_parses_with_short_rows_and_ns_durations():
    """The H200's ncu writes a details row only up to its value (no rule columns) and raw durations in ns:
    the summary must read 529.856 us, 13.71 % DRAM, 12.5 % occupancy and the GB/s the bytes give."""
    data = Path(__file__).parent / "data"
    (k,) = ncu.merge((data / "ncu_wide_fp8.details.csv").read_text(), (data / "ncu_wide_fp8.raw.csv").read_text())
    row = ncu.summarize(k, "64x128x8192", "snapmla")
    assert row["duration_us"] == pytest.approx(529.856)
    assert (row["dram_pct"], row["sm_pct"], row["occ_theory_pct"], row["regs"]) == (13.71, 30.45, 12.5, 255)
    assert row["dram_gbps"] == pytest.approx((347_216_384 + 2_437_120) / 529.856e-6 / 1e9)
    assert row["mem_gbps"] == pytest.approx(659.902886822)
    assert row["eligible_warps_sched"] == 0.44 and row["smem_bytes"] == 225_296
    assert row["stalls"].startswith("short_scoreboard") and row["stall_source"] == "cycles/issue"
    assert ncu.to_base(529_856.0, "ns") == pytest.approx((529.856e-6, "second"))
