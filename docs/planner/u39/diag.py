"""Diagnose tiny 1P1D: per role, the simulated run's profiled cost per step, cpu-share factor, batch."""
import json, sys, collections
from cbserve.goodput.stats import Slo
from cbserve.goodput.workloads import MIXES
from cbserve.planner.profile import load_profile
from cbserve.planner.simulate import sim_model, sweep
from cbserve.planner import sim_pod, cpu_share

REC = collections.defaultdict(lambda: collections.defaultdict(float))
CUR = {"rate": None}
_orig_seconds = sim_pod.PodCosts.seconds
def seconds(self, shape, scale=1.0):
    role = "prefill" if shape.prefill_chunks and not shape.num_decodes else ("decode" if not shape.prefill_chunks else "mixed")
    r = REC[(CUR["rate"], role)]
    r["n"] += 1; r["profiled"] += self.model.seconds(shape); r["scale"] += scale
    r["decodes"] += shape.num_decodes; r["prefill_tokens"] += sum(c[0] for c in shape.prefill_chunks)
    s = _orig_seconds(self, shape, scale); r["wall"] += s
    return s
sim_pod.PodCosts.seconds = seconds

def main(profile_path, measured_path, config, factors_json=None):
    measured = json.load(open(measured_path)); meta = measured["meta"]
    profile = load_profile(profile_path)
    model = sim_model(profile)
    slo = Slo(meta["slo_ttft_ms"] / 1000, meta["slo_tpot_ms"] / 1000)
    rows = [r for r in measured["rows"] if r["config"] == config]
    rates = [r["rate"] for r in rows]
    contention = json.loads(factors_json) if factors_json else None
    if contention: contention = {float(k): v for k, v in contention.items()}
    # one rate at a time is not the benchmark's procedure; record by rate via the sweep's order
    import cbserve.planner.simulate as simm
    orig_reset = simm.SimCluster.reset_load
    it = iter(sorted(rates))
    def reset(self):
        CUR["rate"] = next(it, None); return orig_reset(self)
    simm.SimCluster.reset_load = reset
    pred = sweep(model, config, MIXES[meta["mixes"][0]], rates, meta["duration_s"], meta["seed"], slo,
                 warmup=4, stop_below_attainment=0.0, contention=contention)
    for m, p in zip(rows, pred):
        el = p["elapsed_s"]
        print(f"rate {m['rate']:g} goodput m {m['goodput_rps']:.2f} p {p['goodput_rps']:.2f} rej m {m['num_rejected']} p {p['num_rejected']} ok m {m['num_ok']} p {p['num_ok']}")
        for role in ("prefill", "decode", "mixed"):
            r = REC.get((m["rate"], role))
            if not r: continue
            n = r["n"]
            print(f"   {role:8} n {n:5.0f} busy {r['wall']/el:.2f} wall {r['wall']/n*1e3:5.1f}ms profiled {r['profiled']/n*1e3:5.2f}ms scale {r['scale']/n:.2f} "
                  f"decodes {r['decodes']/n:5.1f} prefill_tok {r['prefill_tokens']/n:6.1f}")

if __name__ == "__main__":
    main(*sys.argv[1:])
