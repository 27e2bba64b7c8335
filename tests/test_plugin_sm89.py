"""The sm_89 routing against the installed vLLM 0.32 source, on CPU (no Ada GPU here).

One subprocess (the patches are process-global; ~30 s, mostly importing vLLM's CUDA-path modules):
every module the routing patches imports on CPU except ``vllm.platforms.cuda`` (needs
``vllm._C_stable_libtorch``; its symbol is read with ``ast``); every patched symbol exists; every
call site vLLM makes into the compat APIs (parsed from vLLM's source) binds to the compat
signature; ``_lazy_init``'s ``getattr(_dg, name)`` names cover the compat DeepGEMM functions; the
BF16 drafter's o-projection branch is in the source; then the real routing runs behind a platform
reporting (8, 9) at the gate and the bound symbols are ds4lab's; an unknown vLLM is refused."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(r'''
import ast, importlib, inspect, os, sys
import vllm
from ds4lab.vllm_plugin import sm89, version_gate
from ds4lab_kernels.compat import deep_gemm as DG, flash_mla as FM
VLLM = os.path.dirname(vllm.__file__)
src = lambda rel: ast.parse(open(os.path.join(VLLM, rel)).read())

# 1. every patched symbol exists (import on CPU; vllm.platforms.cuda from its source)
for mod, attr in sm89.SYMBOLS:
    if mod == "vllm.platforms.cuda":
        tree = src("platforms/cuda.py")
        cls = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == attr.split(".")[0]]
        assert cls and any(isinstance(f, ast.FunctionDef) and f.name == attr.split(".")[1] for f in cls[0].body), attr
        continue
    owner = importlib.import_module(mod)
    for p in attr.split("."):
        assert hasattr(owner, p), f"{mod}.{attr} missing"
        owner = getattr(owner, p)

# 2. call sites -> compat signatures
def calls(rel, name):
    out = []
    for n in ast.walk(src(rel)):
        if isinstance(n, ast.Call):
            f = n.func
            fn = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if fn == name:
                out.append(n)
    assert out, f"no call to {name} in {rel}: vLLM moved it"
    return out

def bind(fn, call, extra=None):
    if any(isinstance(a, ast.Starred) for a in call.args):
        return 0
    kw = {k.arg: None for k in call.keywords if k.arg is not None}   # a **kwargs spread: see ``extra``
    kw.update(extra or {})
    inspect.signature(fn).bind(*[None] * len(call.args), **kw)
    return 1

n = 0
for rel, name, fn, extra in [
    ("models/deepseek_v4/nvidia/flashmla.py", "flash_mla_with_kvcache", FM.flash_mla_with_kvcache, None),
    ("models/deepseek_v4/nvidia/flashmla.py", "flash_mla_sparse_fwd", FM.flash_mla_sparse_fwd, None),
    ("v1/attention/backends/mla/sparse_swa.py", "get_mla_metadata", FM.get_mla_metadata, None),
    ("utils/deep_gemm.py", "_fp8_fp4_mqa_logits_impl", DG.fp8_fp4_mqa_logits, None),
    ("utils/deep_gemm.py", "_fp8_fp4_paged_mqa_logits_impl", DG.fp8_fp4_paged_mqa_logits, {"indices": None}),
    ("utils/deep_gemm.py", "_get_paged_mqa_logits_metadata_impl", DG.get_paged_mqa_logits_metadata, {"indices": None}),
    ("utils/deep_gemm.py", "_tf32_hc_prenorm_gemm_impl", DG.tf32_hc_prenorm_gemm, None),
    ("utils/deep_gemm.py", "_get_mn_major_tma_aligned_tensor_impl", DG.get_mn_major_tma_aligned_tensor, None),
    ("utils/deep_gemm.py", "_get_mn_major_tma_aligned_packed_ue8m0_tensor_impl",
     DG.get_mn_major_tma_aligned_packed_ue8m0_tensor, None),
    # *args wrappers: the outer call sites, plus the keyword the wrapper adds
    ("model_executor/kernels/linear/scaled_mm/deep_gemm.py", "fp8_gemm_nt", DG.fp8_gemm_nt,
     "fp8_gemm_nt"),
    ("models/deepseek_v4/nvidia/ops/o_proj.py", "fp8_einsum", DG.fp8_einsum, None),
    ("model_executor/layers/quantization/utils/fp8_utils.py", "transform_sf_into_required_layout",
     DG.transform_sf_into_required_layout, {"disable_ue8m0_cast": False}),
]:
    k = 0
    for c in calls(rel, name):
        if extra == "fp8_gemm_nt":   # vllm.utils.deep_gemm.fp8_gemm_nt pops is_deep_gemm_e8m0_used, adds disable_ue8m0_cast
            c.keywords = [k for k in c.keywords if k.arg != "is_deep_gemm_e8m0_used"]
            k += bind(fn, c, {"disable_ue8m0_cast": False})
        else:
            k += bind(fn, c, extra)
    assert k, f"{rel}: no call to {name} with explicit arguments to bind"
    n += k
print("CALL_SITES_BOUND", n)

# 3. vLLM binds the compat DeepGEMM functions by these names
names = {n.args[1].value for n in ast.walk(src("utils/deep_gemm.py")) if isinstance(n, ast.Call)
         and isinstance(n.func, ast.Name) and n.func.id == "getattr" and len(n.args) >= 2
         and isinstance(n.args[1], ast.Constant)}
missing = {f for f in DG.__all__ if f not in names and f not in ("get_tma_aligned_size", "get_num_sms", "set_num_sms")}
assert not missing, f"compat DeepGEMM names vLLM no longer binds: {missing}"
dg_src = open(os.path.join(VLLM, "utils/deep_gemm.py")).read()
assert "dg.get_num_sms()" in dg_src and "dg.set_num_sms(num_sms)" in dg_src

# 4. the BF16 MTP drafter's o-projection takes torch.bmm in vLLM 0.32 as shipped (no patch needed)
o_src = open(os.path.join(VLLM, "models/deepseek_v4/nvidia/ops/o_proj.py")).read()
assert "use_fp8 = wo_a.weight.dtype == torch.float8_e4m3fn" in o_src and "torch.bmm(" in o_src

# 5. the gate, with a platform reporting (8, 9); the patches are real
class Ada:
    def is_cuda(self): return True
    def get_device_capability(self): return (8, 9)
class Hopper(Ada):
    def get_device_capability(self): return (9, 0)
assert sm89.wanted(Ada()) and not sm89.wanted(Hopper())
import vllm.utils.deep_gemm as d
d._fp8_gemm_nt_impl = object()          # a binding from a real deep_gemm made before the plugin ran
done = sm89.install(skip_modules=("vllm.platforms.cuda",))
assert len(done) == len(sm89.SYMBOLS) - 1
assert d._import_deep_gemm() is DG and d.has_deep_gemm()
assert d._fp8_gemm_nt_impl is None       # reset, then rebound to ds4lab's on first use
d._lazy_init()
for impl, f in [("_fp8_gemm_nt_impl", DG.fp8_gemm_nt), ("_fp8_einsum_impl", DG.fp8_einsum),
                ("_fp8_fp4_mqa_logits_impl", DG.fp8_fp4_mqa_logits),
                ("_fp8_fp4_paged_mqa_logits_impl", DG.fp8_fp4_paged_mqa_logits),
                ("_get_paged_mqa_logits_metadata_impl", DG.get_paged_mqa_logits_metadata),
                ("_tf32_hc_prenorm_gemm_impl", DG.tf32_hc_prenorm_gemm),
                ("_transform_sf_into_required_layout_impl", DG.transform_sf_into_required_layout)]:
    assert getattr(d, impl) is f, impl
assert getattr(d, "_grouped_impl") is None   # no grouped DeepGEMM MoE: Marlin keeps the W4A16 experts
import vllm.v1.attention.ops.flashmla as ops, vllm.models.deepseek_v4.nvidia.flashmla as nvf
import vllm.v1.attention.backends.mla.sparse_swa as swa, vllm.models.deepseek_v4.sparse_mla as sm
import vllm.models.deepseek_v4.nvidia.model as nvm
assert ops._is_flashmla_available() == (True, None) and ops.is_flashmla_sparse_supported()[0]
assert nvf.flash_mla_with_kvcache is FM.flash_mla_with_kvcache and nvf.flash_mla_sparse_fwd is FM.flash_mla_sparse_fwd
assert isinstance(swa.get_mla_metadata()[0], FM.FlashMLASchedMeta)
from vllm.platforms.interface import DeviceCapability
assert sm.DeepseekV4SparseMLABackend.supports_compute_capability(DeviceCapability(8, 9))
assert sm.DeepseekV4SparseMLABackend.supports_compute_capability(DeviceCapability(9, 0))
assert not sm.DeepseekV4SparseMLABackend.supports_compute_capability(DeviceCapability(8, 6))
class Cfg:
    class attention_config: backend = None
assert nvm._select_dsv4_attn_cls(Cfg) is nvm.DeepseekV4FlashMLAAttention
assert "VLLM_TRITON_MLA_SPARSE" not in os.environ

# 6. an unknown vLLM is refused on the sm_89 path too
import ds4lab.vllm_plugin as plugin
plugin._INSTALLED.clear()
sm89.wanted = lambda platform=None: True
vllm.__version__ = "0.99.0"
try:
    plugin.register()
    raise SystemExit("register() accepted vLLM 0.99.0")
except version_gate.UnsupportedVllmError as e:
    assert "0.99.0" in str(e)
print("SM89_OK")
''')


def test_sm89_routing_against_installed_vllm_source():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("VLLM_TRITON_MLA_SPARSE", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and "SM89_OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
    bound = int(r.stdout.split("CALL_SITES_BOUND", 1)[1].split()[0])
    assert bound >= 12, f"only {bound} vLLM call sites bound to the compat signatures"  # 12 call targets, each >= 1 site
