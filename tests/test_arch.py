"""ds4lab_kernels/_arch: which config table a launcher reads (by shared-memory capacity and
instruction set, not ``major >= 9``; the interpreter; TRITON_OVERRIDE_ARCH for the sm_89 build on
an H200), the FP8 gate that sm_80/86 hit, and the one SM count."""
import pytest
import torch

from ds4lab_kernels import _arch
from ds4lab_kernels._arch import SMEM_LIMIT, arch_of, num_sms, table_for

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of the given capability on this GPU-less machine (no driver to ask for its
    shared memory, so _arch falls back to the documented capacity of that target)."""
    monkeypatch.delenv("TRITON_OVERRIDE_ARCH", raising=False)
    monkeypatch.setattr(_arch, "_SMEM", {})

    def make(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        return CUDA0
    return make


# (capability, table, FP8 launchers allowed): 12.x (RTX 5090, RTX PRO 6000 Blackwell, GB10) has
# Ada's 99 KiB per block, so the sm_90 defaults (122,880-131,200 B) would fail to launch there
@pytest.mark.parametrize("cap,want,fp8", [
    ((8, 0), "sm_89", False), ((8, 6), "sm_89", False), ((8, 9), "sm_89", True), ((9, 0), "sm_90", True),
    ((10, 0), "sm_90", True), ((12, 0), "sm_89", True), ((12, 1), "sm_89", True),
])
def test_tables_by_capacity_and_isa(fake_gpu, cap, want, fp8):
    dev = fake_gpu(cap)
    assert arch_of(dev) == want
    cc = 10 * cap[0] + cap[1]
    assert table_for(cc) == want
    # the table's configs fit the device: its budget is at most the device's capacity
    assert _arch.TABLES[want][1] <= SMEM_LIMIT[f"sm_{cc}"]
    if fp8:
        _arch.require_fp8("a", dev, "fp8_gemm_nt")
    else:
        with pytest.raises(ValueError, match=r"a: on cuda:0, compute capability 8\.\d; fp8_gemm_nt needs FP8"):
            _arch.require_fp8("a", dev, "fp8_gemm_nt")


def test_capacity_not_major_decides(monkeypatch):
    # a Hopper-ISA device with only Ada's capacity reads the Ada table, and vice versa no Ada-ISA
    # device reads the Hopper table however much shared memory it has
    assert table_for(90, 101_376) == "sm_89"
    assert table_for(89, 232_448) == "sm_89"
    assert table_for(100, 232_448) == "sm_90"
    with pytest.raises(ValueError, match="compute capability 7.5"):
        table_for(75)
    with pytest.raises(ValueError, match="65,536 B shared memory"):
        table_for(86, 65_536)


def test_driver_capacity_wins_over_the_table(fake_gpu, monkeypatch):
    dev = fake_gpu((9, 0))
    monkeypatch.setattr(_arch, "_SMEM", {(0, 90): 101_376})   # e.g. a cut-down Hopper part
    assert arch_of(dev) == "sm_89"


@pytest.mark.parametrize("cap,override,want", [
    ((9, 0), "sm89", "sm_89"),      # bench --arch sm89 on the H200: every launcher reads the Ada table
    ((8, 9), "sm90", "sm_90"), ((9, 0), "sm90a", "sm_90"), ((9, 0), "sm_120", "sm_89"),
])
def test_override_arch_wins(fake_gpu, monkeypatch, cap, override, want):
    dev = fake_gpu(cap)
    monkeypatch.setenv("TRITON_OVERRIDE_ARCH", override)
    assert arch_of(dev) == want


def test_override_to_sm86_refuses_fp8(fake_gpu, monkeypatch):
    dev = fake_gpu((9, 0))
    monkeypatch.setenv("TRITON_OVERRIDE_ARCH", "sm86")
    with pytest.raises(ValueError, match="needs FP8"):
        _arch.require_fp8("q", dev, "fp8_mqa_logits")


def test_cpu_is_the_ada_table_and_bad_override_is_named(monkeypatch):
    monkeypatch.setenv("TRITON_OVERRIDE_ARCH", "sm90")
    assert arch_of(torch.device("cpu")) == "sm_89"   # the interpreter runs on CPU tensors
    _arch.require_fp8("x", torch.device("cpu"), "anything")  # no-op on the interpreter
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TRITON_OVERRIDE_ARCH", "hopper")
    with pytest.raises(ValueError, match="TRITON_OVERRIDE_ARCH"):
        arch_of(CUDA0)


def test_one_sm_count_on_cpu():
    """Interpreter and compile report size splits like an RTX 4090 (128 SMs), in every family."""
    import importlib
    assert num_sms(torch.device("cpu")) == 128 == _arch.CPU_NUM_SMS
    for fam in ("fp8_gemm", "mhc", "o_proj", "sparse_mla", "topk", "indexer"):
        mod = importlib.import_module(f"ds4lab_kernels.{fam}")
        assert not hasattr(mod, "_num_sms"), fam
        assert mod.num_sms is num_sms, fam


def test_smem_limit_has_one_home():
    from ds4lab import doctor
    from ds4lab.harness import aot
    assert aot.SMEM_LIMIT is SMEM_LIMIT
    assert doctor.SMEM_LIMIT[89] == SMEM_LIMIT["sm_89"] == 101_376 and doctor.SMEM_LIMIT[90] == 232_448
    assert doctor.SMEM_LIMIT[120] == 101_376


# ---- the sm_80/86 decision, end to end through the real launchers ---------------------------------
# FP8 launchers refuse with a ValueError naming an input; the others run with the sm_89 tables and
# still match their reference. _arch.target is patched so the CPU tensors of the interpreter look
# like an sm_86 GPU to require_fp8 (the interpreter itself is unaffected).
FP8_LAUNCHERS = {"fp8_gemm_nt", "per_token_group_quant_fp8", "indexer_k_cache_insert", "fp8_mqa_logits",
                 "fp8_paged_mqa_logits", "fp8_paged_mqa_topk", "fp8_ds_mla_insert", "inv_rope_fp8_quant",
                 "fp8_einsum_bhr_hdr_bhd", "o_proj", "sparse_mla_decode", "indexer_q_rope_quant", "w8a8_block_fp8_linear",
                 "q_kv_rmsnorm_rope_insert", "compress_decode_insert", "q_norm_rope_indexer_q"}


def _specs():
    from ds4lab.harness.registry import all_specs
    return [s for s in all_specs() if not s.gpu_only]


@pytest.mark.interp
@pytest.mark.parametrize("spec", _specs(), ids=lambda s: s.name)
def test_sm86_fp8_refused_others_fall_back(monkeypatch, spec):
    from conftest import DEVICE
    monkeypatch.setattr(_arch, "target", lambda device: (86, 101_376))
    shape = spec.test_shapes[0]
    inputs = spec.make_inputs(shape, spec.cases[0], 0, DEVICE)
    if spec.name in FP8_LAUNCHERS:
        with pytest.raises(ValueError, match=r"compute capability 8\.6; .*needs FP8 \(e4m3\) tensor cores"):
            spec.launcher_fn()(**inputs)
        return
    out = spec.launcher_fn()(**inputs)
    reports = spec.check(out, spec.reference_fn()(**inputs), inputs)
    assert reports and all(reports), [r.summary() for r in reports if not r]


@pytest.mark.parametrize("target,cap", [("sm_89", (8, 9)), ("sm_90", (9, 0)), ("sm_120", (12, 0))])
def test_gpu_defaults_are_what_pick_config_returns(monkeypatch, target, cap):
    """GPU_DEFAULTS (the rows the compile report builds for sm_120) == the rows each pick function
    returns on a GPU over sizes that cross every threshold (no drift between the two); a family's entry for a
    compile target (sm_120) where it has one, else its table's."""
    arch = table_for(10 * cap[0] + cap[1])
    from ds4lab_kernels import fp8_quant, mhc, moe_gate, moe_routing, moe_w4a16, sparse_mla, topk
    monkeypatch.setattr(_arch, "target", lambda device: None if device.type != "cuda" else (10 * cap[0] + cap[1],
                                                                                           SMEM_LIMIT[target]))
    monkeypatch.setitem(_arch._SMS, 0, 128)
    dev = CUDA0
    sweeps = {
        fp8_quant: [fp8_quant.pick_config(n, dev) for n in (1, 1024, 1025, 16384, 16385, 10**6)],
        mhc: [mhc.pick_config(t, dev, f) for t in (1, 2, 4, 5, 16, 17, 64, 65, 4096) for f in (False, True)],
        moe_routing: [moe_routing.pick_config(t, dev) for t in (1, 512, 513, 10**5)],
        moe_gate: [moe_gate.pick_config(t, dev) for t in (1, 2, 3, 4, 16, 17, 64, 65, 4096)],
        moe_w4a16: [moe_w4a16.pick_config(p, dev) for p in (1, 12, 13, 95, 96, 256, 257, 10**5)],
        sparse_mla: [sparse_mla.pick_config(h, dev, num_tokens=t) for h in (8, 16, 32, 64) for t in (1, 64)],
        topk: [topk.pick_config(n, dev) for n in (100, 16383, 16384, 10**6)],
    }
    for mod, cfgs in sweeps.items():
        table = mod.CONFIGS[arch]
        got = {next(lb for lb, c in table.items() if c is cfg) for cfg in cfgs}
        assert got == set(mod.GPU_DEFAULTS.get(target, mod.GPU_DEFAULTS[arch])), (mod.__name__, target, got)
    # the indexer: one family, five tables (q / insert / mqa / paged / paged top-k)
    from ds4lab_kernels import indexer as ix
    picks = {"q": [ix.pick_q_config(n, dev) for n in (64, 8192, 8193)], "insert": [ix.CONFIGS["insert"][arch]["default"]],
             "mqa": [ix.pick_mqa_config(m, n, dev) for m, n in ((1, 1), (1 << 12, 1 << 12))],
             "paged": [ix.pick_paged_config(b, c, dev) for b, c in ((1, 64), (64, 1 << 17))],
             "paged_topk": [ix.pick_paged_topk_config(b, c, dev) for b, c in ((1, 64), (16, 1 << 15))]}
    got = {next(lb for lb, c in ix.CONFIGS[t][arch].items() if c is cfg) for t, cfgs in picks.items() for cfg in cfgs}
    assert got == set(ix.GPU_DEFAULTS[target]), ("indexer", target, got)
