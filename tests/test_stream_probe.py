"""The page-ring stream probe (`snapquant.kernels.gluon.experimental.stream`, `scripts/probe_stream.py`).

The probe is an instrument: its kernel must stream exactly the pages asked for (compiled for sm_90 here: one
TMA copy per box, the busy-wait loop, the shared memory its host side counts), and its table must name each
row's ring and carry the interval of every ratio. On a GPU (`-m gpu`) the kernel runs: every program's
sink is the sum of the codes it read, checked against torch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from snapquant.errors import ShapeError
from snapquant.kernels.gluon import HAVE_GLUON

needs_gluon = pytest.mark.skipif(not HAVE_GLUON, reason="this triton has no Gluon")
ROOT = Path(__file__).resolve().parents[1]


def _probe_module():
    spec = importlib.util.spec_from_file_location("probe_stream", ROOT / "scripts" / "probe_stream.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["probe_stream"] = mod
    spec.loader.exec_module(mod)
    return mod


def _cache(pages: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    lat = torch.randint(0, 120, (pages, 64, 512), dtype=torch.uint8, device=device, generator=g)  # finite codes
    rope = torch.randint(-1000, 1000, (pages, 64, 64), dtype=torch.int16, device=device, generator=g)
    return lat, rope


@needs_gluon
@pytest.mark.parametrize("stages,group", [(2, 1), (5, 1), (2, 2), (1, 1)])
def test_stream_kernel_compiles_to_one_tma_copy_per_box(stages, group):
    from snapquant.kernels.compile_stats import compile_launch
    from snapquant.kernels.gluon.experimental.stream import stream_launch, stream_smem_bytes

    lat, rope = _cache(8)
    bt = torch.randperm(8, dtype=torch.int32).view(2, 4)
    k = compile_launch(stream_launch(lat, rope, bt, 4, stages, group, spin=100), 90)
    ptx = k.asm["ptx"]
    # the prologue's STAGES - 1 groups and the loop's one, each GROUP pages of 4 latent boxes + 1 RoPE box
    # (whole groups only; the compiler may emit the loop's copy twice, e.g. peeling its first iteration)
    copies = ptx.count("cp.async.bulk.tensor")
    assert copies % (group * 5) == 0 and copies >= stages * group * 5, copies
    assert "%clock64" in ptx and "SPIN_TOP" in ptx
    assert k.metadata.shared == stream_smem_bytes(stages, group)


def test_stream_launch_refuses_other_page_shapes():
    from snapquant.kernels.gluon.experimental.stream import stream_launch

    lat, rope = _cache(2)
    with pytest.raises(ShapeError, match=r"latent \(2, 64, 256\)"):
        stream_launch(lat[..., :256], rope, torch.zeros(1, 2, dtype=torch.int32), 1, 2, 1)


def test_resident_programs_follow_shared_memory():
    probe = _probe_module()
    assert probe.resident(2, 1) == 2  # the narrow kernel's ring: two programs per SM
    assert probe.resident(1, 1) == 5
    assert probe.resident(5, 1) == 1 and probe.resident(2, 2) == 1
    assert probe.resident(3, 1) == 1  # three 40 KB slots: one program (the ring the narrow kernel avoids)


def test_stream_table_names_the_ring_and_the_interval():
    probe = _probe_module()
    rows = [
        {"shape": "128x16x4096", "what": "flashmla", "status": "ok", "us": 147.6, "gbps": 4090.0, "samples": [1.0] * 25},
        {"shape": "128x16x4096", "what": "stream", "stages": 5, "group": 1, "per_sm": 1, "spin_per_page": 2000,
         "status": "ok", "us": 90.2, "gbps": 3720.0, "read_frac": 0.85, "vs_flashmla": 0.611,
         "vs_flashmla_ci": [0.605, 0.617], "samples": [1.0] * 25},
        {"shape": "128x16x4096", "what": "stream", "stages": 3, "group": 1, "per_sm": 2, "spin_per_page": 0,
         "status": "skipped", "error": "2 programs of 122904 B do not fit an SM"},
    ]
    md = probe.markdown(rows, {"gpu": "NVIDIA H200", "git_commit": "abc", "read_gbps": 4389.0})
    assert "| 128x16x4096 | stream | 5 x 1 | 1 | 2000 | 90.2 | 3720 | 0.85 | 0.611 [0.605, 0.617] | 25 |" in md
    assert "| flashmla | - |" in md and "skipped: 2 programs of 122904 B do not fit an SM" in md
    assert "4389 GB/s" in md and "NVIDIA H200" in md


@pytest.mark.gpu
@pytest.mark.parametrize("stages,group,programs", [(2, 1, 7), (5, 1, 3), (2, 2, 5), (1, 1, 2)])
def test_stream_kernel_reads_every_page_it_is_asked_for(stages, group, programs):
    """Each program's sink = the sum over its pages of the first 8 token rows' codes of box 0 (as int8),
    plus nothing from the spin (it returns its input): the pages arrive whole and in block-table order."""
    from snapquant.kernels.gluon.experimental.stream import stream_launch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    lat, rope = _cache(23, "cuda", seed=3)
    bt = torch.randperm(23, device="cuda").to(torch.int32)[:21].view(3, 7)
    ln = stream_launch(lat, rope, bt, programs, stages, group, spin=50)
    ln.kernel[ln.grid](*ln.args, **ln.kwargs)
    sink = ln.args[3].cpu()
    flat = bt.reshape(-1).cpu()
    per = -(-flat.numel() // programs)
    for p in range(programs):
        run = flat[p * per:(p + 1) * per]
        if run.numel() == 0:
            assert int(sink[p]) == 0
            continue
        n_groups = -(-run.numel() // group)
        idx = [min(g * group, run.numel() - 1) for g in range(n_groups)]  # a slot's first page is what it reads
        want = sum(int(lat[int(run[i]), :8, :128].cpu().view(torch.int8).to(torch.int64).sum()) for i in idx)
        assert int(sink[p]) == want, (p, int(sink[p]), want)
