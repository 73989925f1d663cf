"""Run the coverage stages of each model in worker processes, with a time limit per stage.

    rows = run_all(specs, workers=2, timeout=90.0, on_row=print)

A worker is a spawned child process that imports torch, ampaudit and the model libraries once and then takes
models one at a time; for each it builds the model (meta first, CPU when meta fails), then runs the stages
in order and sends each result as it finishes:

  eager     the model's own forward, under no_grad (the denominator: only models whose forward runs count)
  fx        plain ``torch.fx.symbolic_trace(model)`` (the baseline)
  export    plain ``torch.export.export(model, args, kwargs, strict=False)`` (the second baseline)
  ampaudit  ``ampaudit.check(model, *args, **kwargs)`` with capture_mode="auto": its report's capture and findings

A stage that runs past the time limit (or kills its process) is recorded as failed with "timeout"; the worker
is killed and a fresh one builds the model again and goes on with the next stage. Models whose eager forward
fails skip the other stages.
"""
from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing as mp
import os
import sys
import time
import warnings
from multiprocessing.connection import wait
from pathlib import Path

STAGES = ("eager", "fx", "export", "ampaudit")
STARTUP_LIMIT = 300.0   # seconds a new worker may take to import torch and the model libraries
RECYCLE_AFTER = 40      # models per worker before a fresh one: bounds memory that leaks across models
HERE = Path(__file__).resolve().parent


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


@contextlib.contextmanager
def _quiet():
    # Model libraries print warnings and whole graph dumps on failures; the rows carry the errors.
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)


# -- in the worker -----------------------------------------------------------------------------------------------

def _eager(spec: dict):
    """Build on each device in turn until the forward runs; returns (built, result)."""
    import torch
    from coverage_models import build, devices_for

    errors = []
    for device in devices_for(spec):
        start = time.perf_counter()
        try:
            built = build(spec, device)
            with torch.no_grad():
                built.model(*built.args, **built.kwargs)
        except Exception as exc:
            errors.append(f"{device}: {_short(exc)}")
            continue
        return built, {"ok": True, "device": device, "seconds": time.perf_counter() - start,
                       "note": "; ".join(errors) or None}
    return None, {"ok": False, "error": " | ".join(errors)}


def _fx(built) -> dict:
    import torch.fx

    graph_module = torch.fx.symbolic_trace(built.model)
    return {"ok": True, "nodes": len(graph_module.graph.nodes)}


def _export(built) -> dict:
    import torch

    program = torch.export.export(built.model, tuple(built.args), dict(built.kwargs), strict=False)
    return {"ok": True, "nodes": len(program.graph.nodes)}


# Findings a model that trains fine under AMP should not get (bench/accuracy.py's PRECISION and MEASURED families):
# the rows keep the first few in full, so every one on a real model can be judged true or false.
ALARM_FAMILIES = ("sensitive-op", "normalization", "constant", "divergence", "range", "nonfinite")
KEPT_ALARMS = 8


def alarms(report) -> list[str]:
    """``rule severity module (file:line): message`` of the report's first warnings and errors in ALARM_FAMILIES."""
    out = []
    for f in report.findings:
        if f.family in ALARM_FAMILIES and f.severity in ("warning", "error") and len(out) < KEPT_ALARMS:
            where = f" ({f.location['file'].rsplit('/', 1)[-1]}:{f.location['line']})" if f.location else ""
            out.append(f"{f.rule} {f.severity} {f.module}{where}: {' '.join(f.message.split())[:200]}")
    return out


def _counts(report) -> dict[str, int]:
    counts: dict[str, int] = {}
    for f in report.findings:
        key = f"{f.rule}|{f.family}|{f.severity}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _ampaudit(built) -> dict:
    import ampaudit

    report = ampaudit.check(built.model, *built.args, **built.kwargs)
    return {"ok": True, "capture": report.capture, "findings": len(report.findings), "counts": _counts(report),
            "alarms": alarms(report), "notes": [n for n in report.notes if not n.startswith("calibrated")][:4]}


def verdict(report) -> dict:
    """What a user of the default target sees: findings per (rule, family, severity), and the table's height."""
    import io

    from rich.console import Console

    from ampaudit.report.console import render_report

    counts = _counts(report)
    console = Console(width=120, file=io.StringIO(), color_system=None)
    render_report(report, console)
    return {"counts": counts, "lines": console.file.getvalue().count("\n"), "worst": report.worst()}


def _audit(built) -> dict:
    """The static audit under the default target, with what its verdict looks like (bench/accuracy.py)."""
    import ampaudit

    report = ampaudit.check(built.model, *built.args, **built.kwargs)
    return {"ok": True, "capture": report.capture, **verdict(report)}


def _calibrate(built) -> dict:
    """``check --calibrate`` under the default target: needs real weights, so a meta model is rebuilt on CPU."""
    import ampaudit

    model = built.model
    if any(p.is_meta for p in model.parameters()):
        from coverage_models import build

        built = build(built.spec, "cpu")
        model = built.model
    report = ampaudit.check(model, *built.args, calibrate=True, **built.kwargs)
    return {"ok": True, "capture": report.capture, **verdict(report), "alarms": alarms(report),
            "notes": [n for n in report.notes if "skipped" in n][:4]}


_STAGE_FNS = {"fx": _fx, "export": _export, "ampaudit": _ampaudit, "audit": _audit, "calibrate": _calibrate}


def _preload(families: tuple[str, ...] | None) -> None:
    # Import the model libraries once per worker, before the first model's clock starts; only those needed.
    from coverage_tvops import import_torchvision

    import ampaudit  # noqa: F401

    wanted = set(families or ("torchvision", "timm", "transformers", "diffusers"))
    try:
        import_torchvision()   # timm, transformers and diffusers import torchvision when it is installed
        if "timm" in wanted:
            import timm  # noqa: F401
        if wanted & {"transformers", "transformers-all", "diffusers"}:
            import transformers  # noqa: F401
        if "diffusers" in wanted:
            import diffusers  # noqa: F401
    except Exception:   # noqa: BLE001 - a library that fails to import fails its own models, not the worker
        pass


def worker_main(conn, threads: int, families: tuple[str, ...] | None = None) -> None:
    """The worker loop: receive ``(spec, stages)``, send ``(stage, result)`` per stage, then ``("done", None)``."""
    sys.path.insert(0, str(HERE))
    # Model code prints from C++ and Python alike; the rows carry every error, so the worker prints nothing.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    import torch

    torch.set_num_threads(threads)
    with _quiet():
        _preload(families)
    conn.send(("ready", None))
    while True:
        job = conn.recv()
        if job is None:
            return
        spec, stages = job
        with _quiet():
            built, result = _eager(spec)
        if "eager" in stages:
            conn.send(("eager", result))
        for stage in [s for s in stages if s != "eager"]:
            if built is None:
                break
            start, cpu = time.perf_counter(), time.process_time()
            try:
                with _quiet():
                    result = _STAGE_FNS[stage](built)
            except Exception as exc:
                result = {"ok": False, "error": _short(exc)}
            # Wall seconds carry the machine's load; the process's CPU seconds (every thread) mostly do not.
            result["seconds"], result["cpu_seconds"] = time.perf_counter() - start, time.process_time() - cpu
            conn.send((stage, result))
        conn.send(("done", None))


# -- in the parent -----------------------------------------------------------------------------------------------

class _Worker:
    def __init__(self, threads: int, families: tuple[str, ...]):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, threads, families), daemon=True)
        self.proc.start()
        child.close()
        self.threads, self.families = threads, families
        self.started = time.monotonic()
        self.ready = False
        self.served = 0
        self.job: dict | None = None      # {"index", "row", "todo" (stages left), "deadline"}

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        self.conn.close()


def _new_row(spec: dict) -> dict:
    return {"family": spec["family"], "model": spec["name"], "device": None,
            **{s: None for s in (*STAGES, "audit", "calibrate")}, "capture": None, "findings": None, "seconds": {}, "cpu": {},
            "errors": {},
            "notes": []}


def _record(row: dict, stage: str, result: dict) -> None:
    row[stage] = bool(result.get("ok"))
    if "seconds" in result:
        row["seconds"][stage] = round(result["seconds"], 3)
    if "cpu_seconds" in result:
        row.setdefault("cpu", {})[stage] = round(result["cpu_seconds"], 3)
    if result.get("error"):
        row["errors"][stage] = result["error"]
    if stage == "eager" and result.get("ok"):
        row["device"] = result["device"]
        if result.get("note"):
            row["notes"].append(f"meta: {result['note']}")
    if stage == "ampaudit" and result.get("ok"):
        row["capture"], row["findings"] = result["capture"], result["findings"]
        row["notes"].extend(result.get("notes") or [])
        row.setdefault("detail", {})["check"] = {k: result[k] for k in ("counts", "alarms") if k in result}
    if stage in ("audit", "calibrate") and result.get("ok"):
        row["capture"] = row["capture"] or result["capture"]
        row.setdefault("detail", {})[stage] = {k: result[k] for k in ("counts", "lines", "worst", "notes", "alarms")
                                               if k in result}


def run_all(specs: list[dict], *, workers: int = 1, timeout: float = 90.0, on_row=None,
            stages: tuple[str, ...] = STAGES) -> list[dict]:
    """Run ``stages`` on every spec; returns one row per spec, in the order given."""
    cores = os.cpu_count() or 1
    threads = max(1, cores // max(1, workers))
    queue = [(i, _new_row(s), list(stages)) for i, s in enumerate(specs)]
    queue.reverse()
    rows: dict[int, dict] = {}
    families = tuple(sorted({s["family"] for s in specs}))
    pool = [_Worker(threads, families) for _ in range(min(workers, len(specs)) or 1)]
    try:
        while queue or any(w.job for w in pool):
            for w in pool:
                if w.ready and w.job is None and queue:
                    index, row, todo = queue.pop()
                    w.job = {"index": index, "row": row, "todo": todo, "deadline": time.monotonic() + timeout}
                    w.conn.send(({"family": row["family"], "name": row["model"]}, todo))
            now = time.monotonic()
            deadlines = [w.job["deadline"] for w in pool if w.job] + \
                        [w.started + STARTUP_LIMIT for w in pool if not w.ready]
            ready = wait([w.conn for w in pool], timeout=max(0.0, min(deadlines, default=now + 1) - now))
            for i, w in enumerate(pool):
                replacement = _service(w, w.conn in ready, timeout, queue, rows, on_row)
                if replacement is not None:
                    pool[i] = replacement
    finally:
        for w in pool:
            with contextlib.suppress(Exception):
                w.conn.send(None)
            w.kill()
    return [rows[i] for i in sorted(rows)]


def _service(w: _Worker, readable: bool, timeout: float, queue: list, rows: dict, on_row):
    """Handle one worker's message or its deadline; returns a replacement worker when this one had to go."""
    now = time.monotonic()
    if readable:
        try:
            kind, result = w.conn.recv()
        except (EOFError, OSError):
            if not w.ready:
                raise RuntimeError("a worker process exited while starting (run one model with --workers 1 and "
                                   "--models NAME, and import torch, ampaudit and the model library by hand)")
            return _fail_stage(w, "worker process died", queue, rows, on_row)
        if kind == "ready":
            w.ready = True
            return None
        job = w.job
        if kind == "done":
            rows[job["index"]] = job["row"]
            if on_row:
                on_row(job["row"])
            w.job = None
            w.served += 1
            if w.served >= RECYCLE_AFTER:
                w.conn.send(None)
                w.kill()
                return _Worker(w.threads, w.families)
            return None
        _record(job["row"], kind, result)
        job["todo"].remove(kind)
        job["deadline"] = now + timeout   # each stage gets the full limit
        return None
    if w.job and now >= w.job["deadline"]:
        return _fail_stage(w, f"timeout after {timeout:g} s", queue, rows, on_row)
    if not w.ready and now >= w.started + STARTUP_LIMIT:
        raise RuntimeError(f"a worker did not start within {STARTUP_LIMIT:g} s")
    return None


def _fail_stage(w: _Worker, reason: str, queue: list, rows: dict, on_row) -> _Worker:
    """The running stage failed by timeout or crash: record it, requeue the rest of the model, replace the worker."""
    job = w.job
    w.kill()
    if job is not None:
        stage = job["todo"].pop(0)
        _record(job["row"], stage, {"ok": False, "error": reason})
        if stage == "eager" or not job["todo"]:
            rows[job["index"]] = job["row"]
            if on_row:
                on_row(job["row"])
        else:
            queue.append((job["index"], job["row"], job["todo"]))   # the end of the list is the front
    return _Worker(w.threads, w.families)
