"""Source fixers that add a block or change a layer: a module that must run in fp32 gets its ``forward`` body in
``with torch.autocast(device_type=x.device.type, enabled=False):`` with its floating inputs upcast (or, for a
built-in layer such as ``nn.LSTM``, the statement that calls it); a misaligned vocabulary is padded.

    with torch.autocast(device_type=x.device.type, enabled=False):   # what fp32_module writes
        x = x.float()
        ...the forward as it was...

With autocast off the block changes nothing (``.float()`` of an fp32 tensor is that tensor), so FP32 results are
bitwise unchanged; under autocast the block computes in fp32 and its output stays fp32, as ampaudit.keep_fp32
and the graph rewrite's islands leave theirs.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from ampaudit.sourcefix.cst_tools import (ReplaceNodes, autocast_off, callee_name, contains, is_autocast_off,
                                          is_simple, upcast)
from ampaudit.sourcefix.registry import FixContext, keep_fp32_instead, source_fixer

COMMENT = "# fp32 under autocast ({rule}): {why}"


@dataclass
class ModuleInputs:
    """What a module's forward received in an FP32 run: which positional arguments and parameter names held
    floating tensors (those are the ones to upcast)."""

    positional: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)


def _comment(ctx: FixContext, why: str) -> cst.EmptyLine:
    return cst.EmptyLine(comment=cst.Comment(COMMENT.format(rule=ctx.finding.rule, why=why)))


def _inside_autocast_off(ctx: FixContext, node: cst.CSTNode) -> bool:
    src = ctx.src
    cur = src.parent.get(node)
    while cur is not None:
        if is_autocast_off(cur):
            return True
        cur = src.parent.get(cur)
    return False


def _device_tensor(ctx: FixContext, stmt: cst.CSTNode, candidates: list[cst.BaseExpression]):
    """A tensor expression the statement has, to name autocast's device: ``x`` of a ``device=x.device`` in it,
    else a simple upcast operand, else a floating input of the enclosing forward."""
    found = []

    class _Dev(cst.CSTVisitor):
        def visit_Attribute(self, node):
            if node.attr.value == "device" and is_simple(node.value) and not found:
                found.append(node.value)

    stmt.visit(_Dev())
    if found:
        return found[0]
    for c in candidates:
        if is_simple(c):
            return c
    probe = ctx.inputs.get(ctx.finding.module)
    func = ctx.src.function_of(stmt)
    if probe and probe.names and func is not None and func.name.value == "forward":
        return cst.Name(probe.names[0])
    return None


def wrap_statement(ctx: FixContext, expr: cst.CSTNode, inner: dict, why: str):
    """Put the statement holding ``expr`` in an autocast-disabled block, with the ``inner`` upcasts applied."""
    src = ctx.src
    stmt = src.statement_of(expr)
    if not isinstance(stmt, cst.SimpleStatementLine):
        return ctx.refuse(f"line {ctx.line} is part of a compound statement", _keep(ctx))
    if _inside_autocast_off(ctx, stmt):
        if not inner:
            return ctx.refuse(f"line {ctx.line} already runs with autocast off", _keep(ctx))
        return [ctx.edit(inner, f"{why}: upcast inside the existing autocast-disabled block")]
    device = _device_tensor(ctx, stmt, list(inner))
    if device is None:
        return ctx.refuse(f"no tensor on line {ctx.line} names the device to turn autocast off on", _keep(ctx))
    body = stmt.visit(ReplaceNodes(inner)).with_changes(leading_lines=[])
    block = autocast_off(device, [body], leading=[*stmt.leading_lines, _comment(ctx, why)])
    return [ctx.edit({stmt: block}, f"{why}: line {src.line_of(stmt)} in an autocast-disabled block"
                     + (f", {', '.join(src.code(k).strip() for k in inner)} upcast" if inner else ""),
                     line=src.line_of(stmt), phase="block")]




def _keep(ctx: FixContext) -> str:
    return keep_fp32_instead(ctx.finding.module)


def _class_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None


def _defines_forward(cls: type) -> bool:
    return "forward" in vars(cls)


@source_fixer("fp32_module", needs_inputs=True)
def fp32_module(ctx: FixContext):
    """The module the finding measured runs in fp32: its class's forward body in an autocast-disabled block with
    floating inputs upcast; a layer whose class is not the user's (torch.nn, a library) at the statement that
    calls it."""
    if ctx.finding.op == "buffer":
        return ctx.refuse("a buffer's value is the model's state, not something autocast computes (it overflows "
                          "only when the model itself is cast to half)",
                          "keep the module's buffers in fp32 when casting the model (ampaudit train --opt-level O2)")
    path = ctx.finding.module
    try:
        mod = ctx.model.get_submodule(path)
    except AttributeError:
        return ctx.refuse(f"the model has no module {path!r}", _keep(ctx))
    cls = type(mod)
    file = _class_file(cls)
    if file and _defines_forward(cls) and ctx.allowed(file):
        return _wrap_forward(ctx, cls, file)
    if not path:
        return ctx.refuse(f"the top module is a {cls.__name__} whose code is not in the audited files", _keep(ctx))
    return _wrap_call_site(ctx, path, cls)


def _wrap_forward(ctx: FixContext, cls: type, file: str):
    src = ctx.source_for(file)
    try:
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        line = None
    cdef = src.class_def(cls.__name__, line)
    func = next((s for s in (cdef.body.body if cdef else ()) if isinstance(s, cst.FunctionDef)
                 and s.name.value == "forward"), None)
    if func is None:
        return ctx.refuse(f"cannot find {cls.__name__}.forward in {file}", _keep(ctx))
    body = list(func.body.body)
    doc = []
    if body and isinstance(body[0], cst.SimpleStatementLine) and isinstance(body[0].body[0], cst.Expr) \
            and isinstance(body[0].body[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        doc, body = body[:1], body[1:]
    if len(body) == 1 and is_autocast_off(body[0]):
        return ctx.refuse(f"{cls.__name__}.forward already runs with autocast off", _keep(ctx))
    probe = ctx.inputs.get(ctx.finding.module)
    params = {p.name.value for p in func.params.params} | {p.name.value for p in func.params.kwonly_params}
    names = [n for n in (probe.names if probe else []) if n in params]
    if not names:
        return ctx.refuse(f"{cls.__name__}.forward gets no floating tensor argument to name autocast's device",
                          _keep(ctx))
    ups = [cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(n))], upcast(cst.Name(n)))])
           for n in names]
    first = body[0] if body else None
    lead = list(first.leading_lines) if first is not None and hasattr(first, "leading_lines") else []
    if first is not None and hasattr(first, "leading_lines"):
        body[0] = first.with_changes(leading_lines=[])
    block = autocast_off(cst.Name(names[0]), [*ups, *body],
                         leading=[*lead, _comment(ctx, _why(ctx))])
    new_func = func.with_changes(body=func.body.with_changes(body=[*doc, block]))
    mods = [p for p, m_ in ctx.model.named_modules() if type(m_) is cls]
    where = f"{cls.__name__}.forward" + (f" (also {', '.join(p or '<top>' for p in mods if p != ctx.finding.module)})"
                                        if len(mods) > 1 else "")
    edit = ctx.edit({func: new_func}, f"{where} runs in fp32: autocast off, {', '.join(names)} upcast",
                    line=src.line_of(func), phase="block", file=file)
    edit.scope = "class"
    return [edit]


def _why(ctx: FixContext) -> str:
    if ctx.finding.name == "decisions-flipped":       # AMP702: a divergence in the choices, not in the values
        return "its choices (argmax, topk, x > t, round) differ from FP32's in low precision"
    return {"nonfinite": "it turns finite values into inf/NaN in low precision",
            "range": "its values leave the low dtype's range",
            "divergence": "it loses far more accuracy than the dtype's rounding"}.get(
        ctx.finding.family, ctx.finding.name)


def _wrap_call_site(ctx: FixContext, path: str, cls: type):
    attr = path.rsplit(".", 1)[-1]
    if attr.isdigit():
        return ctx.refuse(f"{path} is an entry of a container (no statement calls it by name)", _keep(ctx))
    src = ctx.src
    calls = [c for c in src.on_line(ctx.line, cst.Call) if isinstance(c.func, cst.Attribute)
             and c.func.attr.value == attr and callee_name(c) == attr]
    if not calls:
        return ctx.refuse(f"no call of {attr} on line {ctx.line}", _keep(ctx))
    call = calls[0]
    probe = ctx.inputs.get(path)
    positional = [a for a in call.args if a.keyword is None and not a.star]
    indices = probe.positional if probe else [0]
    inner = {positional[i].value: upcast(positional[i].value) for i in indices if i < len(positional)}
    return wrap_statement(ctx, call, inner, f"{cls.__name__} {path} in fp32")


@source_fixer("pad_to_multiple")
def pad_to_multiple(ctx: FixContext):
    """A misaligned vocabulary: the ``nn.Embedding(<literal>, ...)`` that builds it gets the padded size (unsafe:
    the weight's shape, and so checkpoints and the random init, change). Linear and conv widths are refused: a
    source edit cannot pad them without changing what every consumer of the layer sees."""
    d = ctx.finding.details
    path = ctx.finding.module
    layer = ctx.params.get("layer", "")
    if d.get("kind") != "Embedding" or d.get("dim") != "num_embeddings" or not path:
        return ctx.refuse(f"padding {d.get('dim')} of {d.get('kind')} {path} changes the shapes its users see",
                          "ampaudit fix --pad -o DIR pads it with zeros in the graph rewrite (outputs unchanged); "
                          "Hugging Face models: resize_token_embeddings(n, pad_to_multiple_of="
                          f"{d.get('multiple', 8)})" if layer != "conv" else
                          "ampaudit fix --pad -o DIR pads it with zeros in the graph rewrite (outputs unchanged)")
    parent_path, _, attr = path.rpartition(".")
    parent = ctx.model.get_submodule(parent_path)
    file = _class_file(type(parent))
    if not file or not ctx.allowed(file):
        return ctx.refuse(f"{type(parent).__name__} is not defined in the audited files",
                          f"resize_token_embeddings(n, pad_to_multiple_of={d.get('multiple', 8)}) if the library "
                          "offers it, or ampaudit fix --pad -o DIR")
    src = ctx.source_for(file)
    cdef = src.class_def(type(parent).__name__)
    for assign in (src.nodes(cst.Assign) if cdef else ()):
        if not contains(cdef, assign):
            continue
        tgt = assign.targets[0].target if len(assign.targets) == 1 else None
        if not (isinstance(tgt, cst.Attribute) and tgt.attr.value == attr and isinstance(assign.value, cst.Call)
                and callee_name(assign.value) == "Embedding"):
            continue
        call = assign.value
        args = list(call.args)
        idx = next((i for i, a in enumerate(args) if (a.keyword is None and i == 0)
                    or (a.keyword is not None and a.keyword.value == "num_embeddings")), None)
        if idx is None or not isinstance(args[idx].value, cst.Integer) or args[idx].value.evaluated_value != d["value"]:
            return ctx.refuse(f"the vocabulary size of {path} is not a literal {d['value']} in its constructor",
                              f"pad it to {d.get('padded')} where it is set, or ampaudit fix --pad -o DIR")
        args[idx] = args[idx].with_changes(value=cst.Integer(str(d["padded"])))
        return [ctx.edit({call: call.with_changes(args=args)},
                         f"nn.Embedding({d['value']} -> {d['padded']}, ...): vocabulary padded to a multiple of "
                         f"{d.get('multiple')} (new rows are never looked up; the weight's shape changes)",
                         line=src.line_of(assign), file=file)]
    return ctx.refuse(f"cannot find where {path} is built in {Path(file).name}", "ampaudit fix --pad -o DIR")
