"""Write a fix to OUTDIR: a readable, standalone ``model.py`` that follows the model-file protocol, its weights,
and a summary.

    write_outdir(result, "fixed/", source=loaded, entry="build_model")
    # fixed/model.py  fixed/weights.pt  fixed/fix.json  fixed/summary.txt  [constants.pt] [inputs.pt]

How ``model.py`` is built, and why: it imports the *original* model file (by absolute path, or the
``pkg.module`` it came from) and calls its factory, so the module tree is built by the user's own code, not
reconstructed from reprs. It then swaps in a subclass whose ``forward`` is the rewritten graph printed as Python
(torch.fx code generation, with a comment above every fp32 island), re-pads padded layers from a table of
shapes, and loads ``weights.pt`` with ``torch.load(weights_only=True)``. ``example_inputs`` and the training hooks
are taken from the original file, so ``ampaudit check`` and ``ampaudit train`` work on the result directly.
Nothing is pickled but tensors, and the file needs only torch and the original model file.

A model torch.fx cannot trace keeps its own forward (``result.form == "modules"``): its ``model.py`` builds the
original, loads ``weights.pt`` (the original's shapes) and applies ``ampaudit.rewrite.module_fix``'s table of
fp32 modules and padded layers, so that file needs ampaudit too.
"""
from __future__ import annotations

import builtins
import inspect
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch.fx.graph import _custom_builtins

from ampaudit.errors import UsageError
from ampaudit.fileio import atomic_write_bytes, atomic_write_text
from ampaudit.rewrite.build import forward_source
from ampaudit.rewrite.island_insert import ISLAND_KEY
from ampaudit.rewrite.report import OUTPUT_POLICY

MARKER = "ampaudit fix"
HOOKS = ("train_data", "loss_fn", "make_optimizer")
DYNAMIC_PREFIX = "_ampaudit_model_"     # module names loading.py gives model files


def check_outdir(outdir: Path) -> None:
    """Refuse a non-empty OUTDIR that ``ampaudit fix`` did not write (one-line UsageError)."""
    if outdir.exists() and not outdir.is_dir():
        raise UsageError(f"{outdir} exists and is not a directory", hint="pass a folder for -o/--output")
    if outdir.is_dir() and any(outdir.iterdir()):
        meta = outdir / "fix.json"
        try:
            ok = json.loads(meta.read_text(encoding="utf-8")).get("tool") == MARKER
        except (OSError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise UsageError(f"{outdir} is not empty and was not written by ampaudit fix",
                             hint="choose a new or empty folder for -o/--output")


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _imports(src: str, globals_: dict) -> tuple[list[str], list[str]]:
    """(import lines, lines that need the original module) for the globals the forward source uses."""
    lines: list[str] = []
    late: list[str] = []
    for name, obj in sorted(globals_.items()):
        if not re.search(rf"\b{re.escape(name)}\b", src):
            continue
        if name in _custom_builtins:
            lines.append(_custom_builtins[name].import_str)
        elif getattr(builtins, name, None) is obj:
            continue
        elif inspect.ismodule(obj):
            lines.append(f"import {obj.__name__}" if obj.__name__ == name else f"import {obj.__name__} as {name}")
        else:
            mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
            if not mod or not qual or "<locals>" in qual:
                raise UsageError(f"the rewritten forward refers to {name!r} ({type(obj).__name__}), which a file "
                                 "cannot import", hint="use ampaudit.fix(model, ...) in Python and keep the module")
            if mod.startswith(DYNAMIC_PREFIX):
                late.append(f"{name} = _original.{qual}")
            elif "." not in qual:
                lines.append(f"from {mod} import {qual}" + (f" as {name}" if qual != name else ""))
            else:
                lines += [f"import {mod}"]
                late.append(f"{name} = {mod}.{qual}")
    return sorted(set(lines)), late


def _annotated_forward(result) -> tuple[str, dict, list[str]]:
    """The forward source indented for a class body, with a comment above each island; and the generated code's
    ``torch.fx`` wrap calls (a wrapped function the graph calls), which must run at the top level of a module."""
    src, globals_ = forward_source(result.gm)
    first_enter: dict[str, int] = {}
    for node in result.gm.graph.nodes:
        i = node.meta.get(ISLAND_KEY)
        if i is not None and node.op == "call_function" and node.target.__name__ == "_enter_autocast" \
                and i not in first_enter.values():
            first_enter[node.name] = i
    by_index = {c.index - 1: c for c in result.report.islands}
    out, wraps = [], []
    for line in src.strip("\n").splitlines():
        if re.match(r"torch\.fx\._symbolic_trace\.wrap\(", line):
            wraps.append(line)
            continue
        m = re.match(r"\s+(\w+) = torch\.amp\.autocast_mode\._enter_autocast\(", line)
        if m and m.group(1) in first_enter and first_enter[m.group(1)] in by_index:
            change = by_index[first_enter[m.group(1)]]
            where = ", ".join(x or "<top module>" for x in change.modules)
            out.append(f"    # fp32 island {change.index} ({where}; {', '.join(change.rules)}): "
                       "autocast off, inputs upcast, outputs stay fp32")
        out.append(line)
    while out and not out[0].strip():       # the blank line after the wrap calls
        out.pop(0)
    body = "\n".join("    " + ln if ln.strip() else "" for ln in out).rstrip()
    return body, globals_, wraps


def _original_lines(path: Path, outdir: Path | None) -> list[str]:
    # The model file relative to this folder, so the two move together (a repository checkout, a CI runner); the
    # absolute path where it was written only if the folder moved alone.
    try:
        rel = Path(os.path.relpath(Path(path).resolve(), Path(outdir).resolve())) if outdir is not None else None
    except ValueError:  # another drive (Windows)
        rel = None
    if rel is None:
        return [f"ORIGINAL = Path({str(path)!r})"]
    return [f"ORIGINAL = (HERE / {rel.as_posix()!r}).resolve()",
            "if not ORIGINAL.is_file():  # this folder was moved without the model file",
            f"    ORIGINAL = Path({str(Path(path).resolve())!r})"]


def _loader_lines(source, entry: str, outdir: Path | None = None) -> list[str]:
    if source.path is not None:
        return [
            *_original_lines(source.path, outdir),
            "",
            "",
            "def _load_original():",
            "    # Import the original model file under its own name; its folder goes on sys.path for sibling imports.",
            "    name = '_fixed_original_' + ORIGINAL.stem",
            "    spec = importlib.util.spec_from_file_location(name, ORIGINAL)",
            "    module = importlib.util.module_from_spec(spec)",
            "    sys.modules[name] = module",
            "    if str(ORIGINAL.parent) not in sys.path:",
            "        sys.path.insert(0, str(ORIGINAL.parent))",
            "    spec.loader.exec_module(module)",
            "    return module",
        ]
    module_name = source.display.partition(":")[0]
    return [f"ORIGINAL = {module_name!r}", "", "", "def _load_original():",
            "    return importlib.import_module(ORIGINAL)"]


def render_model_py(result, source, entry: str, *, has_constants: bool, saved_inputs: bool,
                    outdir: Path | None = None) -> str:
    """The text of OUTDIR/model.py."""
    body, globals_, wraps = _annotated_forward(result)
    imports, late = _imports(body, globals_)
    rep = result.report
    pol = f"{rep.policy.get('dtype')} autocast on {rep.policy.get('device')}"
    head = [f'"""{rep.target} rewritten by `ampaudit fix` for {pol}.', ""]
    if rep.islands:
        head.append(f"{len(rep.islands)} fp32 island(s), {rep.casts} cast(s) added:")
        head += [f"  {c.describe()}" for c in rep.islands]
    for c in rep.padding:
        head.append(f"  padded {c.describe()}")
    head += ["", f"{OUTPUT_POLICY[0].upper()}{OUTPUT_POLICY[1:]}.",
             "build_model() builds the original module tree with the original file's factory (so parameter and",
             "buffer names and state_dict keys are unchanged), swaps in the forward below and loads weights.pt.",
             "Regenerate this file with ampaudit fix rather than editing it.", '"""']
    std = ["import importlib", "import importlib.util", "import sys", "from pathlib import Path", "", "import torch"]
    extra = [ln for ln in imports if ln != "import torch"]
    lines = head + std + extra + ["", "HERE = Path(__file__).resolve().parent", f"ENTRY = {entry!r}"]
    lines += _loader_lines(source, entry, outdir)
    lines += ["", "", "_original = _load_original()"] + late + wraps
    if rep.padding:
        shapes = {name: list(shape) for c in rep.padding for name, shape in c.param_shapes.items()}
        attrs: dict[str, dict] = {}
        for c in rep.padding:
            attrs.setdefault(c.module, {}).update(c.module_attrs)
        lines += ["", "# Padded parameter shapes and layer sizes (--pad): the extra rows and columns are zeros.",
                  "PADDED = {"] + [f"    {k!r}: {tuple(v)!r}," for k, v in shapes.items()] + ["}", "SIZES = {"]
        lines += [f"    {k!r}: {v!r}," for k, v in attrs.items()] + ["}", "", "",
                  "def _pad(model: torch.nn.Module) -> None:",
                  "    made = {}",
                  "    for name, shape in PADDED.items():",
                  "        owner, _, attr = name.rpartition('.')",
                  "        module = model.get_submodule(owner)",
                  "        old = getattr(module, attr)",
                  "        if id(old) not in made:  # tied weights stay tied",
                  "            made[id(old)] = torch.nn.Parameter(old.detach().new_zeros(shape), old.requires_grad)",
                  "        setattr(module, attr, made[id(old)])",
                  "    for path, sizes in SIZES.items():",
                  "        for key, value in sizes.items():",
                  "            setattr(model.get_submodule(path), key, value)",
                  "    model._register_load_state_dict_pre_hook(_pad_checkpoint)",
                  "",
                  "",
                  "def _pad_checkpoint(state_dict, prefix, *args) -> None:",
                  "    # A checkpoint saved before padding loads too: its tensors are zero-padded to the new shapes.",
                  "    for name, shape in PADDED.items():",
                  "        t = state_dict.get(prefix + name)",
                  "        if isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(shape) and t.dim() == len(shape):",
                  "            out = t.new_zeros(shape)",
                  "            out[tuple(slice(0, n) for n in t.shape)] = t",
                  "            state_dict[prefix + name] = out"]
    lines += ["", "", "class FixedForward(torch.nn.Module):",
              '    """The rewritten forward; build_model() puts it in front of the original class."""', "", body,
              "", "", "def build_model() -> torch.nn.Module:",
              "    factory = getattr(_original, ENTRY)",
              "    model = factory if isinstance(factory, torch.nn.Module) else factory()",
              "    base = type(model)",
              "    model.__class__ = type('Fixed' + base.__name__, (FixedForward, base), {})"]
    if rep.padding:
        lines.append("    _pad(model)")
    lines.append("    model.load_state_dict(torch.load(HERE / 'weights.pt', weights_only=True))")
    if has_constants:
        lines += ["    for name, value in torch.load(HERE / 'constants.pt', weights_only=True).items():",
                  "        setattr(model, name, value)"]
    lines.append("    return model")
    return "\n".join(lines + _tail(source, saved_inputs)) + "\n"


def _tail(source, saved_inputs: bool) -> list[str]:
    """example_inputs() and the training hooks of the original file, for check and train on the result."""
    lines = ["", ""]
    if saved_inputs:
        lines += ["def example_inputs():", "    saved = torch.load(HERE / 'inputs.pt', weights_only=True)",
                  "    return tuple(saved['args']), dict(saved['kwargs'])"]
    else:
        lines += ["def example_inputs():", "    return _original.example_inputs()"]
    for hook in HOOKS:
        if source.hook(hook) is not None:
            lines += ["", "", f"{hook} = _original.{hook}"]
    return lines


def render_module_py(result, source, entry: str, *, saved_inputs: bool, outdir: Path | None = None) -> str:
    """OUTDIR/model.py of a module-level fix (torch.fx could not rewrite the graph): the original model, its
    weights, and :func:`ampaudit.rewrite.module_fix.apply_module_fix` with the fix's table."""
    rep, plan = result.report, result.plan
    pol = f"{rep.policy.get('dtype')} autocast on {rep.policy.get('device')}"
    head = [f'"""{rep.target} fixed by `ampaudit fix` for {pol},',
            "on the module tree (torch.fx cannot rewrite its graph, so its own forward runs):", ""]
    head += [f"  fp32: {', '.join(c.modules)} ({', '.join(c.rules)})" for c in rep.islands]
    head += [f"  padded {c.describe()}" for c in rep.padding]
    head += ["", "build_model() builds the original model with the original file's factory, loads weights.pt (the",
             "original's parameter names and shapes) and applies the fix with ampaudit's apply_module_fix: the",
             "modules in KEEP_FP32 run in fp32 under autocast, the layers in PAD get zero rows and columns",
             "(outputs unchanged). Regenerate this file with ampaudit fix rather than editing it.", '"""']
    lines = head + ["import importlib", "import importlib.util", "import sys", "from pathlib import Path", "",
                    "import torch", "", "from ampaudit.rewrite.module_fix import apply_module_fix", "",
                    "HERE = Path(__file__).resolve().parent", f"ENTRY = {entry!r}"]
    lines += _loader_lines(source, entry, outdir)
    lines += ["", "", "_original = _load_original()", f"KEEP_FP32 = {plan.keep!r}", f"PAD = {plan.pad!r}", "", "",
              "def build_model() -> torch.nn.Module:",
              "    factory = getattr(_original, ENTRY)",
              "    model = factory if isinstance(factory, torch.nn.Module) else factory()",
              "    model.load_state_dict(torch.load(HERE / 'weights.pt', weights_only=True))",
              "    apply_module_fix(model, KEEP_FP32, PAD)",
              "    return model"]
    return "\n".join(lines + _tail(source, saved_inputs)) + "\n"


def write_outdir(result, outdir: str | Path, *, source, entry: str, saved_inputs: bool) -> list[Path]:
    """Write model.py, weights.pt (and constants.pt / inputs.pt when needed), fix.json and summary.txt."""
    outdir = Path(outdir)
    check_outdir(outdir)
    hint = "choose a writable folder for -o/--output"
    constants = missing_attrs_of(result) if result.gm is not None else {}
    if result.plan is not None:
        text = render_module_py(result, source, entry, saved_inputs=saved_inputs, outdir=outdir)
    else:
        text = render_model_py(result, source, entry, has_constants=bool(constants), saved_inputs=saved_inputs,
                               outdir=outdir)
    compile(text, str(outdir / "model.py"), "exec")  # a bug here must not leave a broken file behind
    # The marker goes first, so a run killed half-way leaves a folder the next run may overwrite.
    atomic_write_text(outdir / "fix.json", json.dumps({"tool": MARKER, "complete": False}) + "\n", hint=hint)
    written = [atomic_write_bytes(outdir / "weights.pt", _torch_bytes(result.module.state_dict()), hint=hint)]
    if constants:
        written.append(atomic_write_bytes(outdir / "constants.pt", _torch_bytes(constants), hint=hint))
    if saved_inputs:
        written.append(atomic_write_bytes(outdir / "inputs.pt", _torch_bytes(
            {"args": list(source.args), "kwargs": dict(source.kwargs)}), hint=hint))
    written.append(atomic_write_text(outdir / "model.py", text, hint=hint))
    written.append(atomic_write_text(outdir / "summary.txt", result.report.to_text() + "\n", hint=hint))
    meta = {"tool": MARKER, "complete": True, "original": str(source.path or source.display), "entry": entry,
            "files": sorted(p.name for p in written) + ["fix.json"], "report": result.report.to_dict()}
    written.append(atomic_write_text(outdir / "fix.json", json.dumps(meta, indent=2, default=str) + "\n", hint=hint))
    return written


def missing_attrs_of(result) -> dict:
    """Tensor constants the forward reads that are not parameters or buffers of the model (saved separately)."""
    names = {n.target for n in result.gm.graph.nodes if n.op == "get_attr" and "." not in n.target}
    keys = set(result.module.state_dict())
    return {n: getattr(result.module, n) for n in names
            if n not in keys and isinstance(getattr(result.module, n, None), torch.Tensor)}
