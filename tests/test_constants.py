"""The format constants: the values the reference computes with are the ones every kernel compiles.

Triton and Gluon read a kernel's globals (constexprs) at compile time from the kernel's own module, so the
test reads them there, in every kernel module, and compares them with what the quantizers and the reference
decode use. Outside the kernels, the quantizers, the reference decode, the config default and the benchmark
harness take them from `snapquant.constants` by name. A last test keeps any module from growing a private
copy: no source in snapquant/ but constants.py may spell one of these numbers as a literal."""

from __future__ import annotations

import ast
import importlib
import math
import pkgutil
import struct
from pathlib import Path

import pytest
import torch

import snapquant.kernels
from snapquant import PRESETS, constants
from snapquant.config import KVQuantConfig
from snapquant.kernels import PagedMLACache
from snapquant.kernels.gluon import HAVE_GLUON
from snapquant.quant.dtypes import SIXTEEN_BIT_MAX, get_element_format
from snapquant.quant.scales import SCALE_FLOOR
from snapquant.reference import decode as reference_decode

KERNELS_DIR = Path(snapquant.kernels.__file__).parent
PKG = KERNELS_DIR.parent
# what the reference pipeline computes with, looked up where it computes
REFERENCE = {
    "E4M3_MAX": get_element_format("fp8_e4m3").qmax,  # the quantizers' and the query's scale rule
    "BF16_MAX": SIXTEEN_BIT_MAX[torch.bfloat16],  # the pre-scaled RoPE and RoPE-query clamp
    "SCALE_FLOOR": SCALE_FLOOR,
    "FLASHMLA_SCALE_MIN": float(torch.tensor(1e-4, dtype=torch.float32)),  # the flashmla rule's clamp, fl32(1e-4)
    "FLT_MIN": torch.finfo(torch.float32).tiny,  # the vllm rule's clamp
    "PI_REL_FLOOR": reference_decode.PI_REL_FLOOR,
    "PI_ABS_FLOOR": reference_decode.PI_ABS_FLOOR,
    "PAGE_SIZE": KVQuantConfig().pv_block,  # the reference's online-softmax block = P's quantization block
}


def _kernel_modules():
    for info in pkgutil.walk_packages([str(KERNELS_DIR)], "snapquant.kernels."):
        yield importlib.import_module(info.name)


def test_the_constants_module_holds_the_reference_values():
    for name, value in REFERENCE.items():
        assert getattr(constants, name) == value, name
    assert constants.E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max
    assert constants.E4M3_RCP == struct.unpack("f", struct.pack("f", 1 / 448))[0]  # RN_fp32(1 / 448)


def test_every_kernel_module_compiles_the_reference_constants():
    seen = set()
    for module in _kernel_modules():
        for name, value in vars(module).items():
            if name not in REFERENCE and name != "E4M3_RCP":
                continue
            value = getattr(value, "value", value)  # tl.constexpr / gl.constexpr hold .value
            want = constants.E4M3_RCP if name == "E4M3_RCP" else REFERENCE[name]
            assert value == want, f"{module.__name__}.{name} = {value!r}, the reference uses {want!r}"
            seen.add((module.__name__.rsplit(".", 1)[-1], name))
    assert {("common", "E4M3_MAX"), ("common", "PI_REL_FLOOR"), ("decode", "PI_ABS_FLOOR"),
            ("layouts", "PAGE_SIZE"), ("common", "FLASHMLA_SCALE_MIN"), ("common", "FLT_MIN")} <= seen
    if HAVE_GLUON:  # the Gluon kernels' own constexprs too
        from snapquant.kernels.gluon import common

        for name in ("E4M3_MAX", "E4M3_RCP", "BF16_MAX", "SCALE_FLOOR", "PI_REL_FLOOR", "PI_ABS_FLOOR"):
            assert getattr(common, name).value == getattr(constants, name), name


def test_the_decode_launch_passes_the_reference_page_size():
    from snapquant.kernels.decode import plan_decode
    from snapquant.kernels.operands import KernelOperands

    cache = PagedMLACache.empty(2, 128, 64, 16, PRESETS["snapmla"])
    q = torch.zeros(2, 4, 80)
    plan = plan_decode(q, KernelOperands.from_paged(cache), 0.1, PRESETS["snapmla"], 2)
    assert plan.launches[0].kwargs["PAGE"] == REFERENCE["PAGE_SIZE"] and cache.latent.shape[1] == REFERENCE["PAGE_SIZE"]


def test_the_modules_outside_the_kernels_take_them_from_the_constants_module():
    from snapquant.bench import harness

    assert SCALE_FLOOR is constants.SCALE_FLOOR
    assert reference_decode.PI_REL_FLOOR is constants.PI_REL_FLOOR
    assert reference_decode.PI_ABS_FLOOR is constants.PI_ABS_FLOOR
    assert KVQuantConfig().pv_block == harness.PAGE == constants.PAGE_SIZE == 64


def _literals(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            yield node.value, node.lineno
        elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow) and isinstance(node.left, ast.Constant)
              and isinstance(node.right, ast.UnaryOp) and isinstance(node.right.operand, ast.Constant)):
            yield float(node.left.value) ** -node.right.operand.value, node.lineno  # 2.0**-40 and the like


@pytest.mark.parametrize("path", sorted(p for p in PKG.rglob("*.py") if p.name != "constants.py"),
                         ids=lambda p: str(p.relative_to(PKG)))
def test_no_source_spells_a_format_constant(path):
    """448, 2^-86, 2^-40, 2^-100, 1/448 and the bf16 maximum come from snapquant.constants only (64 is too
    common a number to ban: the page size is checked through the launches and the users above)."""
    banned = {constants.E4M3_MAX, constants.E4M3_RCP, constants.BF16_MAX, constants.SCALE_FLOOR,
              constants.PI_REL_FLOOR, constants.PI_ABS_FLOOR}
    for value, line in _literals(ast.parse(path.read_text())):
        assert not any(math.isclose(value, b, rel_tol=1e-9) for b in banned), f"{path.name}:{line} spells {value!r}"


def _module_level_page_literals(tree: ast.Module):
    """(name, line) of module-level assignments of an int literal to a name that mentions PAGE."""
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        value = getattr(node, "value", None)
        if isinstance(value, ast.Constant) and isinstance(value.value, int):
            for t in targets:
                if isinstance(t, ast.Name) and "PAGE" in t.id.upper():
                    yield t.id, node.lineno


def test_no_module_keeps_its_own_page_size():
    """The dense store's row rounding, the Gluon box views and the benchmark all mean the kernels' page: a
    module-level `..._PAGE... = 64` outside constants.py is a second definition that can drift."""
    assert list(_module_level_page_literals(ast.parse("PAGE_ROWS = 64\nx = 64\n"))) == [("PAGE_ROWS", 1)]
    copies = [f"{p.relative_to(PKG)}:{line} {name}" for p in sorted(PKG.rglob("*.py")) if p.name != "constants.py"
              for name, line in _module_level_page_literals(ast.parse(p.read_text()))]
    assert not copies, copies
    from snapquant.attention.store_policies import grow_rows

    assert grow_rows(torch.zeros(2, 3), 65).shape[1] % constants.PAGE_SIZE == 0
