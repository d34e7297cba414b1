import json, subprocess
d = json.load(open('docs/planner/plan_check_small_s10b.json'))
for s in "012":
    f = {str(r['rate']): r['contention'] for r in d['rows'] if r['config'] == 'pd-goodput' and r['measured_file'].endswith(f'seed{s}.json')}
    print(f"== small seed {s} pd-goodput per-run factors", flush=True)
    subprocess.run([".venv/bin/python", "docs/planner/u39/diag.py", "docs/planner/small_profile_s10b.json",
                    f"docs/planner/goodput_small_s10_pd-goodput_seed{s}.json", "pd-goodput", json.dumps(f)])
