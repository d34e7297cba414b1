import json, subprocess, sys
F = json.load(open('docs/planner/u39/factors.json'))
D, P = 1.213144512889773, 1.887222533200897
for s in "678":
    f = F[s]["pd-goodput"]
    for name, c in (("both", f), ("prefill_only", {k: {"prefill": v["prefill"], "decode": D} for k, v in f.items()}),
                    ("decode_only", {k: {"prefill": P, "decode": v["decode"]} for k, v in f.items()})):
        print(f"== seed {s} {name}", flush=True)
        subprocess.run([".venv/bin/python", "docs/planner/u39/diag.py", "docs/planner/tiny_profile_s10b.json",
                        f"docs/planner/goodput_tiny_s10_high_seed{s}.json", "pd-goodput", json.dumps(c)])
