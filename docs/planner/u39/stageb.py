"""Stage B runs of a profile: per role, the simulated profiled cost per step vs measured engine CPU per step."""
import sys, collections, importlib.util
spec = importlib.util.spec_from_file_location("diag", "docs/planner/u39/diag.py"); diag = importlib.util.module_from_spec(spec); spec.loader.exec_module(diag)
from cbserve.planner.profile import load_profile
from cbserve.planner import in_situ
from cbserve.goodput.workloads import MIXES

p = load_profile(sys.argv[1]); raw = p.data["in_situ_raw"]; info = p.serving.in_situ
sec, mix = info["load_seconds"], MIXES[info["calibration_mix"]]
runs = [("1P1D", raw, in_situ.PD), ("colocated", raw.get("colocated"), in_situ.COLOCATED),
        ("colocated_high", raw.get("colocated_high"), in_situ.COLOCATED), ("alone", raw.get("alone"), in_situ.ALONE)]
for name, run, fields in runs:
    if not run: continue
    diag.REC.clear(); diag.CUR["rate"] = name
    reqs = mix.requests(run["load_rate"], sec, 0)
    results, steps = in_situ._simulate(p, reqs, fields)
    el = run["cpu_seconds"]["wall"]; tot = sum(v for k, v in run["cpu_seconds"].items() if k != "wall")
    print(f"{name} rate {run['load_rate']:.2f} cores used {tot/el:.2f}")
    for role, (wall, n) in run["step_seconds"].items():
        pods = [k for k in run["cpu_threads"] if k.startswith(role)]
        eng = sum(run["cpu_threads"][k]["engine"] for k in pods)
        other = sum(run["cpu_threads"][k]["core_other"] for k in pods)
        print(f"  measured {role}: n {n:.0f} wall {wall/n*1e3:.2f}ms cpu/step {eng/n*1e3:.2f}ms wall/cpu {wall/eng:.2f} core_other {other:.2f}s")
    for role, r in diag.REC.items():
        n = r["n"]
        print(f"  sim {role[1]}: n {n:.0f} wall {r['wall']/n*1e3:.2f}ms profiled {r['profiled']/n*1e3:.2f}ms scale {r['scale']/n:.2f} decodes {r['decodes']/n:.1f} prefill_tok {r['prefill_tokens']/n:.0f}")
