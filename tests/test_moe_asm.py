"""The W4A16 MoE decode candidates ``mmaq_*`` (issue 20, moe5) beyond the interpreter: the packed PTX
int4 dequant (``moe_w4a16.DEQ_ASM_BF16`` / ``DEQ_ASM_FP16``) executed instruction by instruction by a
small PTX emulator on every nibble value in every position, and the sm_89 build of an ``x`` row
(packed dequant present, the A operand no longer gathered, no spills, shared memory within Ada's
limit). The interpreter runs none of the PTX (tests/test_moe.py checks the same rows there through the
fp32 fallback); the GPU check is scripts/gpu/moe.sh's numerics pass."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from ds4lab_kernels import moe_w4a16 as K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _half_to_f64(h: np.ndarray, ty: str) -> np.ndarray:
    h = h.astype(np.uint32)
    if ty == "bf16":
        return (h << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    return h.astype(np.uint16).view(np.float16).astype(np.float64)


def _f64_to_half(x: np.ndarray, ty: str) -> np.ndarray:
    if ty == "bf16":  # round to nearest even, as fma.rn
        return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
    return x.astype(np.float16).view(np.uint16).astype(np.uint32)


def run_ptx(asm: str, args: dict) -> dict:
    """Execute the straight-line PTX of an inline-asm block on uint32 numpy vectors. ``args`` maps
    ``"$8"``... to inputs; returns every register written. Knows exactly the instructions the dequant
    uses (an unknown one raises, so a changed asm cannot pass silently)."""
    regs = {k: np.asarray(v, dtype=np.uint32) for k, v in args.items()}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", tok):
            return np.uint32(int(tok, 0))
        raise KeyError(f"unknown operand {tok!r}")

    body = asm.strip()
    assert body.startswith("{") and body.endswith("}")
    for line in body[1:-1].split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        ops = [o.strip() for o in rest.split(",")]
        d = ops[0]
        if op == "mov.b32":
            regs[d] = np.broadcast_to(val(ops[1]), next(iter(args.values())).shape).astype(np.uint32)
        elif op == "prmt.b32":
            a, b, sel = val(ops[1]), val(ops[2]), int(ops[3], 0)
            src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
            out = np.zeros_like(a)
            for i in range(4):
                out |= (src[(sel >> (4 * i)) & 0x7] << np.uint32(8 * i)).astype(np.uint32)
            regs[d] = out
        elif op == "shr.u32":
            regs[d] = (val(ops[1]) >> np.uint32(int(ops[2], 0))).astype(np.uint32)
        elif op == "lop3.b32":
            a, b, c, lut = val(ops[1]), val(ops[2]), val(ops[3]), int(ops[4], 0)
            out = np.zeros(np.broadcast(a, b, c).shape, dtype=np.uint32)
            for bit in range(32):
                ia, ib, ic = ((a >> bit) & 1), ((b >> bit) & 1), ((c >> bit) & 1)
                idx = (ia << 2) | (ib << 1) | ic   # lop3's truth-table index: a = 0xF0, b = 0xCC, c = 0xAA
                out |= (((np.uint32(lut) >> idx.astype(np.uint32)) & 1) << np.uint32(bit)).astype(np.uint32)
            regs[d] = out
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            ty = "bf16" if "bf16" in op else "f16"
            a, b, c = val(ops[1]), val(ops[2]), val(ops[3])
            halves = []
            for sh in (0, 16):
                x, y, z = (_half_to_f64((v >> np.uint32(sh)) & 0xFFFF, ty) for v in (a, b, c))
                halves.append(_f64_to_half(x * y + z, ty))
            regs[d] = (halves[0] | (halves[1] << np.uint32(16))).astype(np.uint32)
        else:
            raise NotImplementedError(f"PTX emulator: {op}")
    return regs


def _words():
    g = np.random.default_rng(0)
    fixed = [0x00000000, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98, 0x89ABCDEF, 0x88888888, 0x01234567, 0x80000008]
    return np.concatenate([np.array(fixed, dtype=np.uint32), g.integers(0, 2**32, 4096, dtype=np.uint32)])


@pytest.mark.parametrize("ty", ["bf16", "f16"])
def test_dequant_asm_gives_every_nibble_minus_8_exactly(ty):
    """Output j of a word pair (a, b) holds nibble j of a minus 8 in its low half and nibble j of b
    minus 8 in its high half (Triton's pack=2 order: element 0 low), for all 16 values at all 8
    positions, as exact bf16 / fp16."""
    asm = str(K.DEQ_ASM_BF16.value if ty == "bf16" else K.DEQ_ASM_FP16.value)
    a = _words()
    b = np.roll(a, 1) ^ np.uint32(0x5A5A5A5A)
    regs = run_ptx(asm, {"$8": a, "$9": b})
    for j in range(8):
        out = regs[f"${j}"]
        for half, w in ((0, a), (16, b)):
            got = _half_to_f64((out >> np.uint32(half)) & 0xFFFF, ty)
            want = ((w >> np.uint32(4 * j)) & 0xF).astype(np.float64) - 8.0
            assert np.array_equal(got, want), (ty, j, half)
    for j in range(8):  # every value 0..15 occurred at every position, in both halves
        for w in (a, b):
            assert set(((w >> np.uint32(4 * j)) & 0xF).tolist()) == set(range(16))


def test_ptx_emulator_catches_a_wrong_constant():
    """The emulator is not a rubber stamp: -135 instead of -136 moves every value by one."""
    asm = str(K.DEQ_ASM_BF16.value).replace("0xC308C308", "0xC307C307")
    regs = run_ptx(asm, {"$8": _words(), "$9": _words()})
    got = _half_to_f64(regs["$0"] & 0xFFFF, "bf16")
    assert not np.array_equal(got, ((_words() & 0xF).astype(np.float64) - 8.0))
    with pytest.raises(NotImplementedError):
        run_ptx("{ add.u32 $0, $8, $9; }", {"$8": _words(), "$9": _words()})


_AOT = r"""
import json, re, subprocess
from ds4lab.harness import aot
from ds4lab.harness.registry import get
from ds4lab_kernels import moe_w4a16 as K
spec = get("fused_moe_w4a16")
out = {}
for label in ("mma_n32s4", "mmaq_n32s4x"):
    inputs = spec.make_inputs({"T": 1, "E": 8, "D": 4096, "I": 512, "topk": 6}, "random", 0, "cpu")
    with aot.capture_compiles("sm_89") as cap:
        K.fused_moe_w4a16(**inputs, config=K.CONFIGS["sm_89"][label])
    for fn, c in cap:
        info = aot._inspect(c, "sm_89")
        import tempfile, os
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "k.cubin"), "wb").write(c.asm["cubin"])
            sass = subprocess.run([aot._tool("cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                                  capture_output=True, text=True).stdout
        info["ldg_u16"] = len(re.findall(r"LDG\.E\.U16", sass))
        info["hfma2"] = len(re.findall(r"\bHFMA2\b", sass))
        info["ptx_fma_x2"] = len(re.findall(r"fma\.rn\.(?:bf16|f16)x2", c.asm["ptx"]))
        out[f"{label}:{fn.__name__}"] = info
print("JSON" + json.dumps(out))
"""


@pytest.mark.aot
def test_sm89_build_of_an_x_row_dequantizes_packed_and_stops_gathering_a():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _AOT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    got = json.loads(p.stdout.split("JSON", 1)[1])
    from ds4lab_kernels._arch import SMEM_LIMIT
    for key, info in got.items():
        assert info["spill_stores"] == 0 and info["spill_loads"] == 0 and info["local"] == 0, (key, info)
        assert info["shared"] <= SMEM_LIMIT["sm_89"], (key, info)
        assert info["mma"].get("HMMA", 0) > 0, (key, info)
    for k in ("w13", "w2"):
        old, new = got[f"mma_n32s4:_dec_mma_{k}_kernel"], got[f"mmaq_n32s4x:_dec_mma_{k}_kernel"]
        assert old["hfma2"] == 0 and new["hfma2"] >= 32 and new["ptx_fma_x2"] >= 8, (k, old, new)
        # the 8 stride-8 A gathers per group (2-byte loads) are gone: A comes through cp.async
        assert old["ldg_u16"] >= 16 and new["ldg_u16"] <= old["ldg_u16"] // 2, (k, old, new)
