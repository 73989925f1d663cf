"""How `ampaudit.check` scales to a 70B-parameter Llama built on the meta device, against a bare fx trace.

    python bench/check_scale.py                 # the 80-layer Llama-3-70B shape (seq 2048)
    python bench/check_scale.py --smoke         # a 4-layer, 1024-wide config: a few seconds
    python bench/check_scale.py --layers 8 --hidden 2048 --ffn 7168 --vocab 32000 --json out.json
    python bench/check_scale.py --repeat 3      # median of three children per row (shared machines are noisy)

Each measurement runs in a fresh child process, so the peak RSS it reports (``ru_maxrss`` of the child) belongs
to that measurement alone; every child pays for ``import torch`` and for building the model on meta, and the
``build`` row shows that floor on its own. Wall time excludes the build (reported separately). The first
build in a process pays about a second of one-time torch start-up (meta-tensor initialisers import
torch._dynamo), so build times mostly measure that.

  build  build the model on meta (the floor every row includes)
  trace  torch.fx.symbolic_trace(model)                                   (the baseline)
  check  ampaudit.check(model, input_ids, device="cuda", dtype="float16")

Targets for ``check``: wall under 10 s, peak RSS under 2 GB, wall under 3x the bare trace. Exit status 0 when
every target passes, 1 when one fails or ``ampaudit.check`` cannot run (its row then says why).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# (what, limit, unit); the ratio is check wall time over bare-trace wall time.
TARGETS = (("check wall", 10.0, "s"), ("check peak RSS", 2048.0, "MiB"), ("check/trace wall", 3.0, "x"))
SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "batch", "seq")
FULL = dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, batch=1, seq=2048)
SMOKE = dict(layers=4, hidden=1024, heads=16, kv_heads=4, ffn=3584, vocab=32000, batch=1, seq=512)
MODES = ("build", "trace", "check")


def peak_rss_mib() -> float:
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    scale = 1.0 if sys.platform == "darwin" else 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def child(mode: str, shape: dict) -> dict:
    """Runs one measurement in this process and returns its numbers (called in the child)."""
    import torch
    import torch.fx

    from llama_meta import build_llama, example_input_ids, parameter_count

    check = None
    if mode == "check":
        try:
            import ampaudit
            check = ampaudit.check
        except (ImportError, AttributeError) as exc:
            return {"mode": mode, "error": f"ampaudit.check is not available yet ({type(exc).__name__}: {exc})"}

    start = time.perf_counter()
    model = build_llama(**{k: shape[k] for k in SHAPE_FLAGS if k not in ("batch", "seq")})
    ids = example_input_ids(batch=shape["batch"], seq=shape["seq"], vocab=shape["vocab"])
    build_s = time.perf_counter() - start
    result = {"mode": mode, "build_s": build_s, "params": parameter_count(model)}

    start = time.perf_counter()
    if mode == "trace":
        graph_module = torch.fx.symbolic_trace(model)
        result["nodes"] = len(graph_module.graph.nodes)
    elif mode == "check":
        try:
            report = check(model, ids, device="cuda", dtype="float16")
        except Exception as exc:   # the bench reports any failure of the audit as a row, not a traceback
            return {**result, "error": f"ampaudit.check raised {type(exc).__name__}: {str(exc)[:300]}"}
        findings = getattr(report, "findings", None)
        result["findings"] = len(findings) if findings is not None else None
    result["wall_s"] = time.perf_counter() - start
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def measure(mode: str, shape: dict, timeout: float) -> dict:
    """Runs ``mode`` in a fresh interpreter and parses the JSON line it prints last."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", mode]
    for key in SHAPE_FLAGS:
        argv += [f"--{key.replace('_', '-')}", str(shape[key])]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"mode": mode, "error": f"child exited {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def measure_repeated(mode: str, shape: dict, timeout: float, repeat: int) -> dict:
    """``repeat`` fresh children: the median wall and build times, the largest peak RSS (noise on a shared
    machine mostly lengthens single runs)."""
    runs = [measure(mode, shape, timeout) for _ in range(max(1, repeat))]
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    merged = dict(runs[0], runs=len(runs), wall_all_s=[r["wall_s"] for r in runs])
    for key in ("wall_s", "build_s"):
        if all(key in r for r in runs):
            merged[key] = statistics.median(r[key] for r in runs)
    merged["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    return merged


def verdicts(rows: dict) -> list[tuple[str, float | None, float, str, str]]:
    """(target, measured, limit, unit, PASS|FAIL) for each target; measured is None when check did not run."""
    check, trace = rows.get("check", {}), rows.get("trace", {})
    ok = "error" not in check and "wall_s" in check
    measured = {
        "check wall": check.get("wall_s") if ok else None,
        "check peak RSS": check.get("peak_rss_mib") if ok else None,
        "check/trace wall": (check["wall_s"] / trace["wall_s"]) if ok and trace.get("wall_s") else None,
    }
    out = []
    for name, limit, unit in TARGETS:
        value = measured[name]
        out.append((name, value, limit, unit, "PASS" if value is not None and value < limit else "FAIL"))
    return out


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def human_count(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def render(shape: dict, rows: dict) -> str:
    trace, check = rows.get("trace", {}), rows.get("check", {})
    params = next((r["params"] for r in rows.values() if "params" in r), None)
    lines = [f"model: Llama layers={shape['layers']} hidden={shape['hidden']} heads={shape['heads']}/"
             f"{shape['kv_heads']} ffn={shape['ffn']} vocab={shape['vocab']} "
             f"params={human_count(params)} on meta; input ({shape['batch']}, {shape['seq']})",
             "",
             f"{'':16}{'bare trace':>14}{'check':>14}{'check/trace':>14}",
             ]

    def row(label: str, key: str, spec: str) -> str:
        a, b = trace.get(key), check.get(key)
        ratio = b / a if a and b is not None else None
        return f"{label:16}{fmt(a, spec):>14}{fmt(b, spec):>14}{fmt(ratio, '.2f'):>14}"

    lines += [row("wall (s)", "wall_s", ".3f"), row("peak RSS (MiB)", "peak_rss_mib", ".0f"),
              row("build (s)", "build_s", ".3f")]
    if "build" in rows:
        lines.append(f"{'floor (build)':16}{fmt(rows['build'].get('peak_rss_mib'), '.0f'):>14} MiB peak RSS of a "
                     f"child that only imports torch and builds the model")
    if "nodes" in trace:
        lines.append(f"fx graph: {trace['nodes']} nodes")
    for mode in ("trace", "check"):
        if rows.get(mode, {}).get("runs", 1) > 1:
            walls = ", ".join(f"{w:.3f}" for w in rows[mode]["wall_all_s"])
            lines.append(f"{mode} wall over {rows[mode]['runs']} runs (median shown): {walls}")
    for mode in MODES:
        if "error" in rows.get(mode, {}):
            lines.append(f"{mode}: {rows[mode]['error']}")
    if "check" not in rows:
        return "\n".join(lines + ["", "targets: not judged (the check row was not run)"])
    lines += ["", "targets:"]
    for name, value, limit, unit, verdict in verdicts(rows):
        lines.append(f"  {name:18} {fmt(value, '.2f'):>10} {unit:4} < {limit:g} {unit:4} {verdict}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="small config (%s)" % SMOKE)
    for key in SHAPE_FLAGS:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, dest=key,
                            help=f"default {FULL[key]} (smoke {SMOKE[key]})")
    parser.add_argument("--only", choices=MODES, action="append", help="run only these measurements")
    parser.add_argument("--repeat", type=int, default=1, help="children per measurement; median wall (default 1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per child (default 300)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and verdicts here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = dict(SMOKE if args.smoke else FULL)
    shape.update({k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None})
    if args.child:
        print(json.dumps(child(args.child, shape)), flush=True)
        return 0
    rows = {mode: measure_repeated(mode, shape, args.timeout, args.repeat) for mode in (args.only or MODES)}
    print(render(shape, rows))
    results = verdicts(rows) if "check" in rows else []
    if args.json:
        payload = {"shape": shape, "rows": rows,
                   "targets": [dict(zip(("target", "value", "limit", "unit", "verdict"), r)) for r in results]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    failed = any(v == "FAIL" for *_, v in results) if "check" in rows else any("error" in r for r in rows.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
