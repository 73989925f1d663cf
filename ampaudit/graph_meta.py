"""What a captured graph's nodes carry besides the op: the one owner of those ``node.meta`` keys.

    module_of(node)     # "encoder.layers.0.attn": the module whose own code ran the op ("" for the top module)
    source_of(node)     # SourceLoc(file, line, code) of the user's line, or None
    example_of(node)    # the output a dispatch capture recorded (meta tensors), or None
    recorded(node)      # True for an op of a wrapped body recorded at the example shapes (fix leaves it as written)
    owner(node, root)   # the nn.Module whose own code ran it
    set_origin(node, module, source)

Every capture (fx, export, dispatch) stamps these; passes and rules read them through these accessors. A pass's
own results live under its own key (``ampaudit.analysis.amp_prop.AMP_KEY``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

MODULE_KEY = "ampaudit_module"
SOURCE_KEY = "ampaudit_source"
EXAMPLE_KEY = "ampaudit_example"
RECORDED_KEY = "ampaudit_recorded"      # an op of a wrapped body recorded at the example inputs' shapes


@dataclass(frozen=True)
class SourceLoc:
    file: str
    line: int
    code: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"

    def as_dict(self) -> dict:
        return {"file": self.file, "line": self.line}


def module_of(node: fx.Node, default: str = "") -> str:
    return node.meta.get(MODULE_KEY, default)


def source_of(node: fx.Node) -> SourceLoc | None:
    return node.meta.get(SOURCE_KEY)


def example_of(node: fx.Node) -> Any:
    return node.meta.get(EXAMPLE_KEY)


def recorded(node: fx.Node) -> bool:
    return bool(node.meta.get(RECORDED_KEY))


def owner(node: fx.Node, root: nn.Module) -> nn.Module | None:
    """The module whose own code ran ``node``: the called module of a call_module node (looked up in the graph's
    own module, which holds it), else the module ``module_of`` names, in ``root``; None when there is none."""
    if node.op == "call_module":
        where, path = node.graph.owning_module or root, str(node.target)
    else:
        where, path = root, module_of(node)
    try:
        return where.get_submodule(path)
    except AttributeError:
        return None


def set_origin(node: fx.Node, module: str, source: SourceLoc | None) -> None:
    node.meta[MODULE_KEY] = module
    node.meta[SOURCE_KEY] = source
