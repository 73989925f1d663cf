"""libcst helpers the source fixers share: find the expression a finding's line holds, and build the edits.

    src = Source.parse(text)                          # a module with line positions
    calls = src.calls_on(12, "masked_fill")          # Call nodes starting on line 12 whose callee is named so
    new = upcast(expr)                                # ``expr.float()`` (parenthesized where precedence needs it)
    text = src.replace({old_node: new_node})          # the edited source, comments and formatting kept

Every edit replaces nodes by identity, so what a fixer did not touch is printed back byte for byte.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

# fx / aten op names of Python operators -> the libcst operator class.
BINARY_OPS = {"mul": cst.Multiply, "add": cst.Add, "sub": cst.Subtract, "rsub": cst.Subtract, "div": cst.Divide,
              "truediv": cst.Divide, "pow": cst.Power, "matmul": cst.MatrixMultiply, "bmm": cst.MatrixMultiply,
              "floordiv": cst.FloorDivide, "mod": cst.Modulo}


class Source:
    """One parsed file: its CST with positions and parents, and the lines a node spans."""

    def __init__(self, text: str):
        self.text = text
        self.wrapper = MetadataWrapper(cst.parse_module(text), unsafe_skip_copy=True)
        self.module = self.wrapper.module
        self.pos = self.wrapper.resolve(PositionProvider)
        self.parent = self.wrapper.resolve(ParentNodeProvider)

    @classmethod
    def parse(cls, text: str) -> "Source":
        return cls(text)

    def line_of(self, node: cst.CSTNode) -> int:
        return self.pos[node].start.line

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        p = self.pos[node]
        return p.start.line, p.end.line

    def nodes(self, kind: type | tuple[type, ...]) -> Iterator[cst.CSTNode]:
        for node in self.pos:
            if isinstance(node, kind):
                yield node

    def on_line(self, line: int, kind: type | tuple[type, ...]) -> list[cst.CSTNode]:
        """Nodes of ``kind`` starting on ``line``; else those spanning it (a call written over several lines)."""
        start = [n for n in self.nodes(kind) if self.pos[n].start.line == line]
        if start:
            return sorted(start, key=lambda n: (self.pos[n].start.column, -self.pos[n].end.column))
        spans = [n for n in self.nodes(kind) if self.pos[n].start.line <= line <= self.pos[n].end.line]
        return sorted(spans, key=lambda n: self.pos[n].end.line - self.pos[n].start.line)

    def calls_on(self, line: int, *names: str) -> list[cst.Call]:
        """Calls on ``line`` whose callee's last name is one of ``names`` (``F.softmax``, ``x.softmax``, ``softmax``)."""
        wanted = set(names)
        return [c for c in self.on_line(line, cst.Call) if callee_name(c) in wanted]

    def binops_on(self, line: int, op: str) -> list[cst.BinaryOperation]:
        kind = BINARY_OPS.get(op)
        if kind is None:
            return []
        return [b for b in self.on_line(line, cst.BinaryOperation) if isinstance(b.operator, kind)]

    def statement_of(self, node: cst.CSTNode) -> cst.CSTNode | None:
        """The statement line (SimpleStatementLine) or compound statement that holds ``node``."""
        cur = node
        while cur is not None and not isinstance(cur, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            cur = self.parent.get(cur)
        return cur

    def function_of(self, node: cst.CSTNode) -> cst.FunctionDef | None:
        cur = self.parent.get(node)
        while cur is not None and not isinstance(cur, cst.FunctionDef):
            cur = self.parent.get(cur)
        return cur

    def class_def(self, name: str, line: int | None = None) -> cst.ClassDef | None:
        """The class named ``name`` (the one defined on ``line`` when several share the name)."""
        found = [c for c in self.nodes(cst.ClassDef) if c.name.value == name]
        if line is not None:
            found = [c for c in found if self.pos[c].start.line <= line <= self.pos[c].end.line] or found
        return found[0] if found else None

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def replace(self, mapping: dict[cst.CSTNode, cst.CSTNode]) -> str:
        """The source with each key node replaced by its value (by identity); the rest printed as it was."""
        return self.module.visit(ReplaceNodes(mapping)).code


def callee_name(call: cst.Call) -> str | None:
    func = call.func
    if isinstance(func, cst.Attribute):
        return func.attr.value
    if isinstance(func, cst.Name):
        return func.value
    return None


def receiver(call: cst.Call) -> cst.BaseExpression | None:
    """``x`` of a method call ``x.op(...)`` (None for ``torch.op(...)``/``F.op(...)``: those name a module)."""
    func = call.func
    if isinstance(func, cst.Attribute) and not is_namespace(func.value):
        return func.value
    return None


_NAMESPACES = {"torch", "F", "nn", "functional", "math", "np", "numpy", "special", "linalg", "fft"}


def is_namespace(expr: cst.BaseExpression) -> bool:
    """``torch``, ``F``, ``torch.nn.functional``, ``torch.special``: a module prefix, not a tensor."""
    if isinstance(expr, cst.Name):
        return expr.value in _NAMESPACES
    if isinstance(expr, cst.Attribute):
        return expr.attr.value in _NAMESPACES and is_namespace(expr.value)
    return False


def is_simple(expr: cst.BaseExpression) -> bool:
    """A name or attribute chain (``x``, ``self.scale``): cheap and side-effect free to repeat."""
    if isinstance(expr, cst.Name):
        return True
    return isinstance(expr, cst.Attribute) and is_simple(expr.value)


def _atom(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``expr`` as something an attribute can follow: parenthesized unless it is a name, call, subscript, ..."""
    if isinstance(expr, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) or expr.lpar:
        return expr
    return expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def method(expr: cst.BaseExpression, name: str, *args: cst.Arg) -> cst.Call:
    return cst.Call(func=cst.Attribute(value=_atom(expr), attr=cst.Name(name)), args=list(args))


def is_upcast(expr: cst.BaseExpression) -> bool:
    """Already ``x.float()``, ``x.to(torch.float32)`` or ``x.double()``: nothing to add."""
    if not isinstance(expr, cst.Call) or not isinstance(expr.func, cst.Attribute):
        return False
    name = expr.func.attr.value
    if name in ("float", "double") and not expr.args:
        return True
    return name == "to" and len(expr.args) == 1 and m.matches(expr.args[0].value, FP32_MATCHER)


FP32_MATCHER = m.Attribute(value=m.Name("torch"), attr=m.Name("float32") | m.Name("float")) | m.Name("float32")


def upcast(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``expr.float()``: a no-op on an fp32 tensor (it returns the tensor itself), so FP32 results are unchanged."""
    if is_upcast(expr):
        return expr
    # Keep the expression's own parentheses on the outside: (a + b) -> (a + b).float(), not ((a + b)).float().
    return method(expr, "float")


def cast_to_dtype_of(expr: cst.BaseExpression, like: cst.BaseExpression) -> cst.Call:
    """``expr.to(like.dtype)``."""
    return method(expr, "to", cst.Arg(cst.Attribute(value=_atom(like), attr=cst.Name("dtype"))))


def fp32_dtype() -> cst.Attribute:
    return cst.Attribute(value=cst.Name("torch"), attr=cst.Name("float32"))


def with_keyword(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    """``call`` with ``name=value`` set (replacing an existing keyword of that name)."""
    args = list(call.args)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value == name:
            args[i] = a.with_changes(value=value)
            return call.with_changes(args=args)
    if args:
        last = args[-1]
        if isinstance(last.comma, cst.MaybeSentinel):
            args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        new = cst.Arg(value=value, keyword=cst.Name(name),
                      equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                            whitespace_after=cst.SimpleWhitespace("")))
        if not isinstance(last.comma, cst.MaybeSentinel):  # a trailing comma: keep it last
            new = new.with_changes(comma=last.comma)
            args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        args.append(new)
    else:
        args.append(cst.Arg(value=value, keyword=cst.Name(name),
                            equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                  whitespace_after=cst.SimpleWhitespace(""))))
    return call.with_changes(args=args)


def keyword_value(call: cst.Call, name: str) -> cst.BaseExpression | None:
    for a in call.args:
        if a.keyword is not None and a.keyword.value == name:
            return a.value
    return None


def autocast_off(device_of: cst.BaseExpression, body: Iterable[cst.BaseStatement],
                 leading: list[cst.EmptyLine] | None = None) -> cst.With:
    """``with torch.autocast(device_type=<device_of>.device.type, enabled=False):`` around ``body``.

    The device comes from a tensor the code already has, so the block turns off the autocast that is really on
    (cuda on a GPU, cpu in a CPU run) without naming a device the machine may lack.
    """
    device = cst.Attribute(value=cst.Attribute(value=_atom(device_of), attr=cst.Name("device")), attr=cst.Name("type"))
    eq = dict(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))
    call = cst.Call(func=cst.Attribute(value=cst.Name("torch"), attr=cst.Name("autocast")),
                    args=[cst.Arg(device, keyword=cst.Name("device_type"), equal=cst.AssignEqual(**eq),
                                  comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                          cst.Arg(cst.Name("False"), keyword=cst.Name("enabled"), equal=cst.AssignEqual(**eq))])
    return cst.With(items=[cst.WithItem(call)], body=cst.IndentedBlock(body=list(body)),
                    leading_lines=leading or [])


def is_autocast_off(stmt: cst.CSTNode) -> bool:
    """A ``with torch.autocast(..., enabled=False)`` block (what an earlier fix wrote, or the user)."""
    if not isinstance(stmt, cst.With):
        return False
    for item in stmt.items:
        call = item.item
        if isinstance(call, cst.Call) and callee_name(call) == "autocast":
            enabled = keyword_value(call, "enabled")
            if isinstance(enabled, cst.Name) and enabled.value == "False":
                return True
    return False


def contains(outer: cst.CSTNode, inner: cst.CSTNode) -> bool:
    found = False

    class _Find(cst.CSTVisitor):
        def on_visit(self, node):
            nonlocal found
            if node is inner:
                found = True
            return not found

    outer.visit(_Find())
    return found


class ReplaceNodes(cst.CSTTransformer):
    """Replace each node that is a key of ``mapping`` (by identity, as located in the original tree) by its value:
    ``tree.visit(ReplaceNodes({old: new}))``."""

    def __init__(self, mapping: dict):
        super().__init__()
        self.mapping = mapping

    def on_leave(self, original_node, updated_node):
        return self.mapping.get(original_node, updated_node)
