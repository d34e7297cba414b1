"""The one table `bench/gpu_check.sh` prints: every section's figures beside the issue's "before".

The script runs each section into its own log (and JSON where the benchmark writes one) in a work
folder and lists them in `sections.tsv` (id, name, status, seconds, log, artifact). This reads
them back; a section that failed, timed out or was skipped keeps its row, with the reason.

    python bench/gpu_check_table.py /tmp/gpu_check.XXXX > gpu_check.md
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# The figures, measured before this check existed (docs/benchmarks.md, "GPU check").
BEFORE = {
    ("decode", "1b", 1): "4.45–11.6 ms",
    ("decode", "1b", 64): "6.0–15.4 ms",
    ("decode", "8b", 1): "20.4–21.4 ms",
    ("throughput", "1b"): "cbserve 6,923–8,120 tok/s, transformers 1,682",
    ("throughput", "8b"): "cbserve 2,535–4,051 tok/s, transformers 491",
    ("attention", "mixed"): "0.78 TB/s",
    ("attention", "decode"): "3.44 TB/s",
    ("kv_cache",): "256 MB",
}
KERNEL_LINE = re.compile(
    r"^(?P<name>\S.*?)\s+triton\s+(?:(?P<ms>[\d.]+) ms\s+(?P<gbs>[\d.]+) GB/s)?\s*\|\s*ref\s+(?P<ref_ms>[\d.]+) ms"
    r"\s+(?P<ref_gbs>[\d.]+) GB/s(?:\s+max_err\s+(?P<err>\S+))?")
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def pytest_counts(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line ("3 passed, 1 failed in 2.1s")."""
    for line in reversed(text.splitlines()):
        found = PYTEST_COUNT.findall(line)
        if found and (" in " in line or line.startswith("=")):
            counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in found}
            return counts
    return {}


def kernel_rows(text: str) -> list[dict]:
    """bench/kernel_bandwidth.py's report lines, as dicts (its other lines are ignored)."""
    rows = []
    for line in text.splitlines():
        m = KERNEL_LINE.match(line.strip())
        if m:
            d = m.groupdict()
            rows.append({"name": d["name"].strip(), "ms": _float(d["ms"]), "gbs": _float(d["gbs"]),
                         "ref_ms": float(d["ref_ms"]), "ref_gbs": float(d["ref_gbs"]), "max_err": d["err"]})
    return rows


def _float(value: str | None) -> float | None:
    return float(value) if value is not None else None


def _num(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def read_sections(work: Path) -> list[dict]:
    sections = []
    path = work / "sections.tsv"
    if not path.is_file():
        return sections
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 6:
            continue
        sid, name, status, seconds, log, artifact = parts[:6]
        sections.append({"id": sid, "name": name, "status": status, "seconds": seconds,
                         "log": work / log if log else None, "artifact": work / artifact if artifact else None})
    return sections


def _read(path: Path | None) -> str:
    try:
        return path.read_text(errors="replace") if path else ""
    except OSError:
        return ""


def _json(path: Path | None) -> dict | None:
    """The last line of `path` that parses as a JSON object (benchmarks print logs before it)."""
    text = _read(path).strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _tail(text: str, n: int = 1) -> str:
    """The last meaningful line (an error message), trimmed for a table cell."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    tail = " / ".join(lines[-n:]) if lines else "no output"
    return tail.replace("|", "/")[:160]


def section_rows(section: dict) -> list[tuple[str, str, str, str]]:
    """(case, result, bound or before, status) rows for one section."""
    kind = section["id"].split("-")[0]
    status = section["status"]
    log = _read(section["log"])
    data = _json(section["artifact"])
    if status == "skipped":
        return [("", "not run", "", f"skipped ({_tail(log)})")]
    rows: list[tuple[str, str, str, str]] = []
    if kind == "preflight":
        summary = [ln for ln in log.splitlines() if ln.startswith(("preflight:", "FAILED "))]
        rows.append(("imports", " / ".join(summary[-3:]).replace("|", "/")[:300] or _tail(log), "", status))
    elif kind == "tests":
        counts = pytest_counts(log)
        if counts:
            result = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped")
                               if counts.get(k) or k in ("passed", "failed"))
            rows.append(("pytest", result, "", status))
    elif kind == "kernels":
        copy = _copy_gbs(section)
        for r in kernel_rows(log):
            before = ""
            if r["name"].startswith("attention decode") and "[auto]" in r["name"]:
                before = BEFORE[("attention", "decode")]
            elif r["name"].startswith("attention mixed") and "[auto]" in r["name"]:
                before = BEFORE[("attention", "mixed")]
            if r["gbs"] is not None:
                result = f"{r['ms']:.3f} ms, {_num(r['gbs'])} GB/s (torch ref {_num(r['ref_gbs'])})"
            else:
                result = f"ref only: {r['ref_ms']:.3f} ms, {_num(r['ref_gbs'])} GB/s"
            bound = f"{r['gbs'] / copy:.0%} of copy" if copy and r["gbs"] else ""
            err = f"err {r['max_err']}" if r["max_err"] else ""
            rows.append((r["name"], result, "; ".join(x for x in (bound, f"before {before}" if before else "", err) if x),
                         status))
    elif kind == "decode" and data:
        shape = data["shape"] + (" eager" if data.get("enforce_eager") else "") + _fp8_label(data)
        for r in data["rows"]:
            before = BEFORE.get(("decode", shape, r["batch"]))
            extra = f", {r['steps_not_pure_decode']} steps not pure decode" if r.get("steps_not_pure_decode") else ""
            rows.append((f"{shape} batch {r['batch']} ctx {r['context']}",
                         f"{r['median_ms']:.2f} ms (p10 {r['p10_ms']:.2f}, p90 {r['p90_ms']:.2f}; "
                         f"window {r['window_mean_ms']:.2f}){extra}",
                         f"bound {r['bound_ms']:.2f} ms, x{r['ratio']:.1f}" + (f"; before {before}" if before else ""),
                         status))
        memory = (f" ({data['weight_memory_bytes'] / 2**30:.2f} GiB in memory)"
                  if data.get("weight_memory_bytes") else "")
        rows.append((f"{shape} setup", f"copy {_num(data['copy_bandwidth_gb_s'])} GB/s, weights "
                     f"{data['weight_bytes'] / 1e9:.2f} GB read per step{memory}, checkpoint {data['checkpoint_s']} s, load "
                     f"{data['engine_load_s']} s" + (f", unsupported: {','.join(data['unsupported_options'])}"
                                                     if data.get("unsupported_options") else ""), "", status))
    elif kind == "throughput" and data:
        shape = data["model"] + _fp8_label(data)
        hf = (f", transformers {_num(data['hf_output_tok_s'])} tok/s ({data['hf_num_prompts']} prompts, batch "
              f"{data['hf_batch_size']}) = x{data['speedup']:.2f}") if "hf_output_tok_s" in data else ", transformers not run"
        before = BEFORE.get(("throughput", shape))
        rows.append((f"{shape} {data['num_prompts']} prompts",
                     f"cbserve {_num(data['cbserve_output_tok_s'])} output tok/s{hf}",
                     f"before {before}" if before else "", status))
        sized = "engine default size" if not data.get("kv_cache_mb") else "--kv-cache-mb"
        rows.append((f"{shape} KV cache", f"{data['kv_cache_bytes'] / 2**20:,.0f} MB ({sized})",
                     f"before {BEFORE[('kv_cache',)]}", status))
    elif kind == "goodput" and data:
        for r in data.get("rows", []):
            ttft = r.get("p95_ttft_s")
            tpot = r.get("p95_tpot_s")
            rows.append((f"{r['mix']} {r['config']} @ {r['rate']:g} req/s",
                         f"goodput {r['goodput_rps']:.2f} req/s, attainment {r['slo_attainment']:.0%}, "
                         f"p95 TTFT {_ms(ttft)}, p95 TPOT {_ms(tpot)}, errors {r['error_rate']:.0%}",
                         f"offered {r['offered_rps']:.2f} req/s", status))
    if (not rows or status != "ok") and kind != "preflight":
        failed = [ln.strip() for ln in log.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
        rows.append(("", " / ".join(failed[:4]).replace("|", "/")[:300] if failed else _tail(log), "", status))
    return rows


def _fp8_label(data: dict) -> str:
    """" fp8" / " kv-fp8" for a decode or throughput run with fp8 weights / KV cache."""
    label = " fp8" if data.get("quantization") == "fp8" else ""
    return label + (" kv-fp8" if str(data.get("kv_cache_dtype", "")).startswith(("fp8", "float8")) else "")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.0f} ms"


def _copy_gbs(section: dict) -> float | None:
    """The copy bandwidth the decode sections measured (same folder), for the kernels' column."""
    for path in sorted(Path(section["log"]).parent.glob("decode-*.log")) if section["log"] else []:
        data = _json(path)
        if data and data.get("copy_bandwidth_gb_s"):
            return float(data["copy_bandwidth_gb_s"])
    return None


def build_table(work: Path) -> str:
    lines = ["| # | section | case | result | bound / before | status | s |", "|---|---|---|---|---|---|---|"]
    for section in sorted(read_sections(work), key=lambda s: _number(s["id"])):   # stable: run order within
        for case, result, bound, status in section_rows(section):
            lines.append(f"| {_number(section['id'])} | {section['name']} | {case} | {result} | {bound} | "
                         f"{status} | {section['seconds']} |")
    return "\n".join(lines)


def _number(sid: str) -> str:
    return {"preflight": "0", "tests": "1", "kernels": "2", "decode": "3", "throughput": "4",
            "goodput": "5"}.get(sid.split("-")[0], "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(build_table(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
