"""The fix at module granularity, for models torch.fx cannot rewrite (check captured them through torch.export or
the dispatch recording): the same findings, fixed on the module tree instead of in a graph.

    plan = plan_module_fix(work, findings, pad=True)        # which modules go fp32, which layers are padded
    apply_module_fix(model, plan.keep, plan.pad)            # what fix() does to its copy, and what the written
                                                            # model.py does to the model its factory builds

- FP32 islands become whole modules: each module holding a flagged op runs in fp32 under autocast
  (:func:`ampaudit.keep_fp32`), its inputs upcast, its outputs fp32. Coarser than the graph rewrite's islands
  (the module's GEMMs run in fp32 too), so a module and its ancestor are never both listed: the ancestor wins.
  The top module's own ops cannot be one (that would be the whole model in fp32): those stay unfixed.
- Padding needs no graph at all: a misaligned Linear is padded by :func:`ampaudit.rewrite.pad.pad_linear` (zero
  rows and columns, the input padded by a pre-hook, the output sliced back by a hook: outputs unchanged), a Conv
  (groups 1) the same way by :func:`ampaudit.rewrite.pad.pad_conv`, an Embedding's ``num_embeddings`` by zero
  rows no id reads. A Linear whose weight is tied to an Embedding (nanoGPT's ``wte.weight = lm_head.weight``)
  stays tied: the Embedding gets the same padded Parameter. ``state_dict()`` keeps
  the user's shapes, so weights saved from the fixed model load into the original class.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from ampaudit.findings import Finding
from ampaudit.rewrite.flags import island_findings
from ampaudit.rewrite.island_insert import IslandChange
from ampaudit.rewrite.pad import PadChange, _grow, _unpad_state, pad_checkpoint, pad_conv, pad_linear, targets


CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class ModulePlan:
    """What the module-level fix does: modules kept in fp32 (paths), layers padded ({path: {dim: size}})."""

    keep: list[str] = field(default_factory=list)
    pad: dict[str, dict[str, int]] = field(default_factory=dict)
    islands: list[IslandChange] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _outermost(paths: set[str]) -> list[str]:
    """The paths none of whose ancestors is also listed, in module-tree order of their names."""
    return sorted(p for p in paths if not any(p.startswith(q + ".") for q in paths if q != p))


def plan_module_fix(root: nn.Module, findings: list[Finding], *, pad: bool) -> ModulePlan:
    """The modules to keep in fp32 (for the island findings) and, with ``pad``, the layers to pad."""
    plan = ModulePlan()
    hits = island_findings(findings)
    top = [f for f in hits if not f.module]
    if top:
        plan.notes.append(f"{len(top)} finding(s) in the top module's own forward ({', '.join(sorted({f.rule for f in top}))}) "
                          "are not fixed: at module granularity that island would be the whole model; "
                          "ampaudit fix --diff edits those lines in your source")
    for i, path in enumerate(_outermost({f.module for f in hits if f.module}), start=1):
        mine = [f for f in hits if f.module == path or f.module.startswith(path + ".")]
        plan.keep.append(path)
        plan.islands.append(IslandChange(index=i, modules=[path], ops=sorted({f.op or "?" for f in mine}),
                                         rules=sorted({f.rule for f in mine}), casts=0))
    if pad:
        _plan_padding(root, targets(findings, need_node=False), plan)
    return plan


def _plan_padding(root: nn.Module, wanted: dict[str, dict[str, int]], plan: ModulePlan) -> None:
    # Linears first: an Embedding tied to a padded head is padded with it, to the head's rows.
    order = sorted(wanted, key=lambda p: not isinstance(_submodule(root, p), nn.Linear))
    for path in order:
        m, dims = _submodule(root, path), wanted[path]
        if isinstance(m, nn.Embedding) and any(
                isinstance(t, nn.Linear) and t in [_submodule(root, q) for q in plan.pad]
                and plan.pad[_path_of(root, t)].get("out_features") == dims.get("num_embeddings")
                for t in _tied(root, m.weight, m)):
            continue
        why = _unpaddable(root, m, dims)
        if why:
            plan.notes.append(f"{path or '<top module>'} not padded: {why}")
        else:
            plan.pad[path] = dims


def _path_of(root: nn.Module, module: nn.Module) -> str:
    return next(p for p, m in root.named_modules() if m is module)


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def _tied(root: nn.Module, p: torch.Tensor, me: nn.Module) -> list[nn.Module]:
    return [m for _, m in root.named_modules() if m is not me
            and any(q is p for q in m.parameters(recurse=False))]


def _unpaddable(root: nn.Module, m: nn.Module | None, dims: dict[str, int]) -> str | None:
    """Why ``m`` cannot be padded on the module tree to ``dims``, or None."""
    if isinstance(m, nn.Linear):
        tied = _tied(root, m.weight, m)
        if tied and (any(not isinstance(t, nn.Embedding) for t in tied) or
                     dims.get("in_features", m.in_features) != m.in_features):
            return "its weight is shared with another layer that would have to change shape with it"
        return None
    if isinstance(m, nn.Embedding) and "num_embeddings" in dims:
        return None if not _tied(root, m.weight, m) else "its weight is tied to a layer not padded with it"
    if isinstance(m, CONVS):
        return None if m.groups == 1 and not _tied(root, m.weight, m) else \
            "a grouped or weight-sharing Conv would need every group or sharer padded with it"
    kind = type(m).__name__ if m is not None else "no such module"
    return f"the module-level padding covers Linear, Embedding and Conv layers, not {kind}"


def apply_module_fix(model: nn.Module, keep: list[str], pad: dict[str, dict[str, int]]) -> list[PadChange]:
    """Pad the layers in ``pad`` and make the modules in ``keep`` run in fp32, in place; FP32 outputs unchanged."""
    from ampaudit.precision.keep_fp32 import fp32_modules

    changes = []
    for path, dims in pad.items():
        m = model.get_submodule(path)
        if isinstance(m, nn.Embedding):
            changes.append(_pad_embedding(m, dims["num_embeddings"], path))
        elif isinstance(m, CONVS):
            changes.append(pad_conv(m, dims, name=path))
        else:
            changes.append(_pad_linear_tied(model, m, dims, path))
    fp32_modules(model, keep)
    return changes


def _pad_linear_tied(root: nn.Module, m: nn.Linear, dims: dict[str, int], path: str) -> PadChange:
    """``pad_linear``, with the Embeddings that share its weight given the padded Parameter (they stay tied)."""
    tied = _tied(root, m.weight, m)
    rows = m.out_features
    change = pad_linear(m, dims, name=path)
    for emb in tied:
        emb.weight = m.weight
        emb.num_embeddings = m.out_features
        _unpad_hooks(emb, {"weight": (rows, emb.embedding_dim)}, {"weight": tuple(m.weight.shape)})
        change.gemm_after += f"; tied {_path_of(root, emb)} num_embeddings {rows}->{m.out_features}"
    return change


def _pad_embedding(m: nn.Embedding, size: int, path: str) -> PadChange:
    """Zero rows no id reads: outputs unchanged for every valid id."""
    v = m.num_embeddings
    m.weight = nn.Parameter(_grow(m.weight, 0, size), requires_grad=m.weight.requires_grad)
    m.num_embeddings = size
    _unpad_hooks(m, {"weight": (v, m.embedding_dim)}, {"weight": tuple(m.weight.shape)})
    return PadChange(path, "Embedding", {"num_embeddings": (v, size)}, f"vocab {v}", f"vocab {size}",
                     param_shapes={"weight": tuple(m.weight.shape)}, module_attrs={"num_embeddings": size})


def _unpad_hooks(m: nn.Module, user: dict[str, tuple], padded: dict[str, tuple]) -> None:
    """state_dict() in the user's shapes; load_state_dict() takes either shape (zero-padded)."""
    m.register_state_dict_post_hook(functools.partial(_unpad_state, user))
    m._register_load_state_dict_pre_hook(functools.partial(pad_checkpoint, padded))
