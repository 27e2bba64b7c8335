"""Probe of a Python environment, run BY FILE PATH in the interpreter being checked (``python
env_probe.py '{"dists": [...], "modules": [...], "torch": true, "hash_moe": true,
"vllm_env": true}'``), so it needs
only the standard library: the checked venv need not have ds4lab installed. Prints one line
``DS4LAB_PROBE{json}``. Called by :func:`ds4lab.doctor.probes.probe_python`, which documents the
facts it gathers."""
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import sys

out = {"python": platform.python_version(), "executable": sys.executable, "dists": {}, "modules": {}}
ARGS = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
DISTS = ARGS.get("dists", [])
for name in DISTS:
    try:
        d = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    p = getattr(d, "_path", None)
    info = {"version": d.version, "path": str(p) if p else None, "requested": d.read_text("REQUESTED") is not None,
            "installer": (d.read_text("INSTALLER") or "").strip() or None, "direct_url": d.read_text("direct_url.json")}
    if p is not None:
        for f in ("RECORD", "METADATA"):
            fp = os.path.join(str(p), f)
            if os.path.exists(fp):
                info["installed_at"] = os.path.getmtime(fp)
                info["installed_from"] = f
                break
    out["dists"][name] = info
for mod in ARGS.get("modules", []):
    try:
        spec = importlib.util.find_spec(mod)
    except Exception as e:
        out["modules"][mod] = {"error": repr(e)}
        continue
    if spec is not None:
        out["modules"][mod] = {"origin": spec.origin or (list(spec.submodule_search_locations or []) or [None])[0]}
# vLLM's vendored DeepGEMM copy (vllm/third_party/deep_gemm) without importing vllm
v = out["modules"].get("vllm")
if v and v.get("origin"):
    vend = os.path.join(os.path.dirname(v["origin"]), "third_party", "deep_gemm")
    if os.path.exists(vend):
        out["modules"]["vllm.third_party.deep_gemm"] = {"origin": vend}
out["torch"] = None
if "torch" in out["modules"] and ARGS.get("torch", True):
    t = {}
    try:
        import torch
        t = {"version": torch.__version__, "cuda": getattr(torch.version, "cuda", None), "devices": [], "p2p": []}
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            for i in range(n):
                pr = torch.cuda.get_device_properties(i)
                try:
                    free, total = torch.cuda.mem_get_info(i)
                except Exception:
                    free, total = None, pr.total_memory
                t["devices"].append({"index": i, "name": pr.name, "major": pr.major, "minor": pr.minor,
                                     "total": int(total), "free": None if free is None else int(free),
                                     "sms": getattr(pr, "multi_processor_count", None)})
            t["p2p"] = [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]
    except Exception as e:
        t["error"] = repr(e)
    out["torch"] = t
out["driver_cuda"] = None
try:
    import ctypes
    lib = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
        out["driver_cuda"] = "%d.%d" % (v.value // 1000, (v.value % 1000) // 10)
except Exception:
    pass
out["hash_moe"] = None
if "transformers" in out["modules"] and ARGS.get("hash_moe", True):
    try:
        from transformers import DeepseekV4Config
    except Exception as e:
        out["hash_moe"] = {"status": "unavailable", "detail": repr(e)[:300]}
    else:
        try:
            DeepseekV4Config(num_hidden_layers=4, mlp_layer_types=["hash_moe"] * 3 + ["moe"])
            out["hash_moe"] = {"status": "accepted"}
        except Exception as e:
            out["hash_moe"] = {"status": "rejected", "detail": (type(e).__name__ + ": " + str(e))[:400]}
# The VLLM_* variables of this environment against the installed vLLM's own registry
# (vllm.envs.environment_variables: what Platform.validate_environ checks before warning "Unknown vLLM
# environment variable detected"), and whether any vLLM module outside envs.py names them (a
# registry entry nothing reads at run time, e.g. a build-time-only one, is ignored by a server).
out["vllm_env"] = None
names = sorted(k for k in os.environ if k.startswith("VLLM_"))
if names and "vllm" in out["modules"] and ARGS.get("vllm_env", True):
    try:
        from vllm import envs as vllm_envs
        registry = set(vllm_envs.environment_variables)
        known = [n for n in names if n in registry]
        read = set()
        root = os.path.dirname(os.path.abspath(vllm_envs.__file__))
        for dp, _, files in os.walk(root):
            for fn in files:
                if fn.endswith(".py") and not (dp == root and fn == "envs.py"):
                    with open(os.path.join(dp, fn), errors="replace") as fh:
                        text = fh.read()
                    read.update(n for n in known if n in text)
        out["vllm_env"] = {"registry_size": len(registry), "set": names,
                           "unknown": [n for n in names if n not in registry],
                           "unread": [n for n in known if n not in read]}
    except Exception as e:
        out["vllm_env"] = {"error": (type(e).__name__ + ": " + str(e))[:300]}
print("DS4LAB_PROBE" + json.dumps(out))
