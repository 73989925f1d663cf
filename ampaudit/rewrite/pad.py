"""Alignment padding (``fix --pad``): grow misaligned Linear / Embedding / Conv dims to the Tensor Core multiple
with zero rows and columns, so every output the model had is computed exactly as before.

    changed, changes = pad_dims(gm, work, findings)     # driven by the AMP101/102/103 findings

- Linear ``out_features`` o -> O: zero rows in weight and bias. When the output reaches one Linear only, through
  elementwise ops (relu, gelu, dropout, a scalar scale), that Linear gets O zero input columns and the padded
  features flow into it (they meet zero weights, so they add nothing); otherwise ``y[..., :o]`` slices them off.
- Linear ``in_features`` i -> I not fed that way: zero columns, and the input is padded with ``F.pad``.
- Embedding ``num_embeddings`` v -> V: zero rows no id ever reads. A weight tied to a Linear head (the same
  Parameter) is padded once and stays tied; the head's logits are sliced back to v.
- Conv (groups 1) ``out_channels``: zero filters and a ``y[:, :c]`` slice; ``in_channels``: zero input channels.

Parameter names do not change; their shapes do. A checkpoint saved before padding still loads: the root
module gets a load_state_dict pre-hook that zero-pads tensors of the old shape.

``pad_linear(module, {"out_features": 272})`` pads one Linear of an eager model in place, for training
(``train --pad``): the same zero rows and columns, the input padded by a forward pre-hook and the output sliced
back by a forward hook, so the model's class and code do not change. Its ``state_dict()`` holds the *unpadded*
shapes (the zero rows and columns cut off), so weights saved from the padded model load into the user's unpadded
model class; loading either shape into the padded one works (zero-padded as above).
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ampaudit.analysis.amp_prop import AMP_KEY
from ampaudit.findings import Finding
from ampaudit.rewrite.flags import op_of

# Ops a padded feature may pass through on its way to the next Linear: elementwise on one tensor.
PASS_THROUGH = frozenset({"relu", "gelu", "silu", "tanh", "sigmoid", "leaky_relu", "elu", "mish", "hardswish",
                          "dropout", "mul", "div", "add", "sub", "neg", "identity"})


@dataclass
class PadChange:
    """One padded layer: its dims before and after, the GEMM shapes, the new parameter shapes."""

    module: str
    kind: str
    dims: dict[str, tuple[int, int]]
    gemm_before: str
    gemm_after: str
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    module_attrs: dict[str, int] = field(default_factory=dict)
    slices: int = 0
    input_pads: int = 0

    def describe(self) -> str:
        dims = ", ".join(f"{k} {a}->{b}" for k, a, b in ((k, *v) for k, v in self.dims.items()))
        extra = []
        if self.slices:
            extra.append(f"{self.slices} slice(s)")
        if self.input_pads:
            extra.append(f"{self.input_pads} input pad(s)")
        more = f"; {', '.join(extra)}" if extra else ""
        return f"{self.module} {self.kind}: {dims}; GEMM {self.gemm_before} -> {self.gemm_after}{more}"

    def as_dict(self) -> dict:
        return {"module": self.module, "kind": self.kind, "dims": {k: list(v) for k, v in self.dims.items()},
                "gemm_before": self.gemm_before, "gemm_after": self.gemm_after,
                "param_shapes": {k: list(v) for k, v in self.param_shapes.items()},
                "slices": self.slices, "input_pads": self.input_pads}


def _shape(node) -> tuple | None:
    return getattr(node.meta.get(AMP_KEY), "shape", None) if isinstance(node, fx.Node) else None


def targets(findings: list[Finding], *, need_node: bool = True) -> dict[str, dict[str, int]]:
    """module path -> {dim name: padded size} from the alignment findings (on call_module nodes unless
    ``need_node=False``: the module-level padding needs no graph)."""
    out: dict[str, dict[str, int]] = {}
    for f in findings:
        if f.autofix.get("kind") != "pad" or (need_node and f.node is None):
            continue
        dim, padded = f.details.get("dim"), f.details.get("padded")
        if "dims" in f.autofix and dim not in f.autofix["dims"]:
            continue  # the rule pads only these (a wider embedding only moves the misalignment to every reader)
        if isinstance(dim, str) and isinstance(padded, int):
            out.setdefault(f.module, {})[dim] = padded
    return out


def _aliases(root: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it has (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _owners(root: nn.Module, tensor: torch.Tensor) -> list[tuple[str, nn.Module, str]]:
    out = []
    for path, m in root.named_modules(remove_duplicate=False):
        for attr, p in m.named_parameters(recurse=False):
            if p is tensor:
                out.append((path, m, attr))
    return out


def _grow(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = size - shape[dim]
    return torch.cat([t.detach(), t.detach().new_zeros(shape)], dim=dim)


class _Padder:
    def __init__(self, gm: fx.GraphModule, root: nn.Module):
        self.gm, self.root = gm, root
        self.calls: dict[str, list[fx.Node]] = {}
        for n in gm.graph.nodes:
            if n.op == "call_module":
                self.calls.setdefault(n.target, []).append(n)
        self.aliases = _aliases(root)
        self.shapes: dict[str, tuple[int, ...]] = {}         # final shape of every padded parameter name
        self.old_shapes: dict[str, tuple[int, ...]] = {}
        self.fed: dict[str, tuple[int, int]] = {}              # Linear fed padded features: in_features (old, new)
        self.touched: dict[str, set[str]] = {}                 # module path -> parameter names its change padded
        self.current = ""

    def replace_param(self, module: nn.Module, attr: str, dim: int, size: int) -> list[tuple[str, nn.Module, str]]:
        """Grow ``module.attr`` along ``dim`` to ``size``; every module sharing that Parameter gets the new one."""
        old = getattr(module, attr)
        owners = _owners(self.root, old)
        new = nn.Parameter(_grow(old, dim, size), requires_grad=old.requires_grad)
        for name in self.aliases.get(id(old), []):
            self.old_shapes.setdefault(name, tuple(old.shape))
            self.shapes[name] = tuple(new.shape)
            self.touched.setdefault(self.current, set()).add(name)
        for _, m, a in owners:
            setattr(m, a, new)
        self.aliases[id(new)] = self.aliases.pop(id(old), [])
        return owners

    def slice_after(self, node: fx.Node, dim: int, size: int) -> None:
        index = (Ellipsis, slice(None, size)) if dim == -1 else (slice(None),) * dim + (slice(None, size),)
        with self.gm.graph.inserting_after(node):
            cut = self.gm.graph.call_function(operator.getitem, (node, index))
        node.replace_all_uses_with(cut, delete_user_cb=lambda u: u is not cut)
        cut.meta.update({k: v for k, v in node.meta.items() if k != AMP_KEY})

    def pad_input(self, node: fx.Node, pad: tuple[int, ...]) -> None:
        x = node.args[0]
        with self.gm.graph.inserting_before(node):
            padded = self.gm.graph.call_function(F.pad, (x, pad))
        node.replace_input_with(x, padded)

    def chain_target(self, node: fx.Node) -> fx.Node | None:
        """The single Linear call a Linear's output reaches through elementwise ops only, or None."""
        cur = node
        for _ in range(6):
            users = list(cur.users)
            if len(users) != 1:
                return None
            u = users[0]
            if u.op == "call_module" and isinstance(self.root.get_submodule(u.target), nn.Linear):
                return u if len(self.calls.get(u.target, [])) == 1 and u.args and u.args[0] is cur else None
            if (op_of(u) or "") not in PASS_THROUGH:
                return None
            tensors = [a for a in u.all_input_nodes if _shape(a) is not None and len(_shape(a) or ()) > 0]
            if tensors != [cur]:
                return None  # a second tensor operand would need the padded width too
            cur = u
        return None


def _tokens(shape) -> int | None:
    return math.prod(shape[:-1]) if shape else None


def pad_dims(gm: fx.GraphModule, root: nn.Module, findings: list[Finding]) -> tuple[bool, list[PadChange]]:
    """Pad the layers the alignment findings name; rewrites ``gm`` and ``root``'s parameters in place."""
    wanted = targets(findings)
    if not wanted:
        return False, []
    p = _Padder(gm, root)
    changes: dict[str, PadChange] = {}
    order = [n for n in gm.graph.nodes if n.op == "call_module" and n.target in wanted]
    for node in order:
        path = node.target
        if path in changes or len(p.calls.get(path, [])) != 1:
            continue  # a module called twice would need every call site checked; left as it is
        m = root.get_submodule(path)
        want = wanted[path]
        p.current = path
        if isinstance(m, nn.Linear):
            changes[path] = _pad_linear(p, node, m, path, want)
        elif isinstance(m, nn.Embedding) and "num_embeddings" in want:
            changes[path] = _pad_embedding(p, m, path, want["num_embeddings"])
        elif isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and m.groups == 1 and isinstance(m.padding, tuple):
            changes[path] = _pad_conv(p, node, m, path, want)
    for path, c in changes.items():
        c.param_shapes = {name: p.shapes[name] for name in sorted(p.touched.get(path, ()))}
    if p.old_shapes:
        root._register_load_state_dict_pre_hook(functools.partial(pad_checkpoint, dict(p.shapes)))
    gm.graph.lint()
    gm.recompile()
    return bool(changes), list(changes.values())


def pad_checkpoint(shapes: dict[str, tuple[int, ...]], state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: zero-pad tensors saved before padding to the padded shapes."""
    for name, shape in shapes.items():
        key = prefix + name
        t = state_dict.get(key)
        if isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(shape) and t.dim() == len(shape) \
                and all(a <= b for a, b in zip(t.shape, shape)):
            out = t.new_zeros(shape)
            out[tuple(slice(0, s) for s in t.shape)] = t
            state_dict[key] = out


def _pad_linear(p: _Padder, node: fx.Node, m: nn.Linear, path: str, want: dict[str, int]) -> PadChange:
    fin, fout = p.fed.get(path, (m.in_features, m.in_features))[0], m.out_features
    tokens = _tokens(_shape(node.args[0]) if node.args else None)
    change = PadChange(path, "Linear", {}, f"M={fout} N={tokens} K={fin}", "")
    if path in p.fed:
        change.dims["in_features"] = p.fed[path]
    elif want.get("in_features", fin) != fin:
        new_in = want["in_features"]
        p.replace_param(m, "weight", 1, new_in)
        p.pad_input(node, (0, new_in - fin))
        m.in_features = new_in
        change.dims["in_features"] = (fin, new_in)
        change.input_pads += 1
    new_out = want.get("out_features", fout)
    if new_out != fout:
        p.replace_param(m, "weight", 0, new_out)
        if m.bias is not None:
            p.replace_param(m, "bias", 0, new_out)
        m.out_features = new_out
        change.dims["out_features"] = (fout, new_out)
        nxt = p.chain_target(node)
        nxt_mod = p.root.get_submodule(nxt.target) if nxt is not None else None
        if nxt_mod is not None and nxt_mod.in_features == fout and nxt.target not in p.fed:
            # The padded features flow on: the next Linear gets zero input columns instead of a slice here.
            p.current = nxt.target
            p.replace_param(nxt_mod, "weight", 1, new_out)
            p.current = path
            p.fed[nxt.target] = (fout, new_out)
            nxt_mod.in_features = new_out
        else:
            p.slice_after(node, -1, fout)
            change.slices += 1
    change.module_attrs = {"in_features": m.in_features, "out_features": m.out_features}
    change.gemm_after = f"M={m.out_features} N={tokens} K={m.in_features}"
    return change


def _pad_embedding(p: _Padder, m: nn.Embedding, path: str, new_v: int) -> PadChange:
    v = m.num_embeddings
    owners = p.replace_param(m, "weight", 0, new_v)
    m.num_embeddings = new_v
    change = PadChange(path, "Embedding", {"num_embeddings": (v, new_v)}, f"vocab {v}", f"vocab {new_v}",
                       module_attrs={"num_embeddings": new_v})
    for owner_path, owner, _ in owners:
        if owner is m or not isinstance(owner, nn.Linear):
            continue
        # A tied head: its logits grow to new_v rows of which the last are zeros; cut them back to v.
        owner.out_features = new_v
        for call in p.calls.get(owner_path, []):
            p.slice_after(call, -1, v)
            change.slices += 1
        change.gemm_before += f"; tied {owner_path} M={v}"
        change.gemm_after += f"; tied {owner_path} M={new_v}"
    return change


def _pad_conv(p: _Padder, node, m: nn.Conv1d, path, want) -> PadChange:
    cin, cout = m.in_channels, m.out_channels
    kvol = math.prod(m.kernel_size)
    spatial = len(m.kernel_size)
    change = PadChange(path, type(m).__name__, {}, f"M={cout} K={cin}x{kvol}", "")
    new_in, new_out = want.get("in_channels", cin), want.get("out_channels", cout)
    in_shape = _shape(node.args[0]) if node.args else None
    if new_in != cin and in_shape is not None and len(in_shape) == spatial + 2:
        p.replace_param(m, "weight", 1, new_in)
        p.pad_input(node, (0, 0) * spatial + (0, new_in - cin))
        m.in_channels = new_in
        change.dims["in_channels"] = (cin, new_in)
        change.input_pads += 1
    if new_out != cout:
        p.replace_param(m, "weight", 0, new_out)
        if m.bias is not None:
            p.replace_param(m, "bias", 0, new_out)
        m.out_channels = new_out
        p.slice_after(node, 1, cout)
        change.dims["out_channels"] = (cout, new_out)
        change.slices += 1
    change.module_attrs = {"in_channels": m.in_channels, "out_channels": m.out_channels}
    change.gemm_after = f"M={m.out_channels} K={m.in_channels}x{kvol}"
    return change


def pad_linear(module: nn.Linear, dims: dict[str, int], name: str = "") -> PadChange:
    """Pad ``module`` (an nn.Linear or a subclass such as torchao's Float8Linear) in place to ``dims``
    ({"in_features": I, "out_features": O}); see the module docstring. The padded rows and columns get zero
    gradients (their inputs are zero, their outputs are cut off), so SGD, Adam and AdamW keep them zero and the
    unpadded state_dict loses nothing."""
    fin, fout = module.in_features, module.out_features
    new_in, new_out = max(dims.get("in_features", fin), fin), max(dims.get("out_features", fout), fout)
    change = PadChange(name, type(module).__name__, {}, f"M={fout} K={fin}", f"M={new_out} K={new_in}")
    weight = module.weight
    if new_in != fin:
        weight = _grow(weight, 1, new_in)
        change.dims["in_features"] = (fin, new_in)
        change.input_pads = 1
        module.register_forward_pre_hook(lambda mod, args: (F.pad(args[0], (0, new_in - fin)), *args[1:]))
    if new_out != fout:
        weight = _grow(weight, 0, new_out)
        if module.bias is not None:
            module.bias = nn.Parameter(_grow(module.bias, 0, new_out), requires_grad=module.bias.requires_grad)
        change.dims["out_features"] = (fout, new_out)
        change.slices = 1
        module.register_forward_hook(lambda mod, args, out: out[..., :fout])
    if not change.dims:
        return change
    module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    module.in_features, module.out_features = new_in, new_out
    shapes = {"weight": (new_out, new_in), **({"bias": (new_out,)} if module.bias is not None else {})}
    change.param_shapes, change.module_attrs = shapes, {"in_features": new_in, "out_features": new_out}
    module.register_state_dict_post_hook(functools.partial(_unpad_state, {"weight": (fout, fin), "bias": (fout,)}))
    module._register_load_state_dict_pre_hook(functools.partial(pad_checkpoint, shapes))
    return change


def pad_conv(module: nn.Conv1d, dims: dict[str, int], name: str = "") -> PadChange:
    """Pad a Conv1d/2d/3d with ``groups == 1`` in place to ``dims`` ({"in_channels": I, "out_channels": O}), as
    :func:`pad_linear` pads a Linear: zero input channels (the input padded by a pre-hook) and zero filters (the
    output sliced back by a hook); ``state_dict()`` keeps the unpadded shapes."""
    cin, cout = module.in_channels, module.out_channels
    new_in, new_out = max(dims.get("in_channels", cin), cin), max(dims.get("out_channels", cout), cout)
    kvol = math.prod(module.kernel_size)
    change = PadChange(name, type(module).__name__, {}, f"M={cout} K={cin}x{kvol}", f"M={new_out} K={new_in}x{kvol}")
    weight = module.weight
    spatial = len(module.kernel_size)
    if new_in != cin:
        weight = _grow(weight, 1, new_in)
        change.dims["in_channels"], change.input_pads = (cin, new_in), 1
        pad = (0, 0) * spatial + (0, new_in - cin)
        module.register_forward_pre_hook(lambda mod, args: (F.pad(args[0], pad), *args[1:]))
    if new_out != cout:
        weight = _grow(weight, 0, new_out)
        if module.bias is not None:
            module.bias = nn.Parameter(_grow(module.bias, 0, new_out), requires_grad=module.bias.requires_grad)
        change.dims["out_channels"], change.slices = (cout, new_out), 1
        module.register_forward_hook(lambda mod, args, out: out[:, :cout])
    if not change.dims:
        return change
    user = {"weight": tuple(module.weight.shape), "bias": (cout,)}
    module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    module.in_channels, module.out_channels = new_in, new_out
    shapes = {"weight": tuple(weight.shape), **({"bias": (new_out,)} if module.bias is not None else {})}
    change.param_shapes, change.module_attrs = shapes, {"in_channels": new_in, "out_channels": new_out}
    module.register_state_dict_post_hook(functools.partial(_unpad_state, user))
    module._register_load_state_dict_pre_hook(functools.partial(pad_checkpoint, shapes))
    return change


def _unpad_state(shapes: dict[str, tuple[int, ...]], module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook of ``pad_linear``: the padded tensors cut back to the user's shapes (copies, so a
    saved file holds only those)."""
    for name, shape in shapes.items():
        t = state_dict.get(prefix + name)
        if isinstance(t, torch.Tensor) and t.dim() == len(shape):
            state_dict[prefix + name] = t.detach()[tuple(slice(0, s) for s in shape)].clone()
