import json, subprocess
F = json.load(open('docs/planner/u39/factors.json'))
for s in "678":
    f = F[s]["colocated-2"]
    print(f"== seed {s} colocated per-run factors (one factor)", flush=True)
    subprocess.run([".venv/bin/python", "docs/planner/u39/diag.py", "docs/planner/tiny_profile_s10b.json",
                    f"docs/planner/goodput_tiny_s10_high_seed{s}.json", "colocated-2", json.dumps(f)])
