"""PyTorch's own autocast test lists (torch/testing/_internal/autocast_test_lists.py), read without importing it.

    cuda, cpu = autocast_lists()          # AutocastTestLists("cpu"), AutocastCPUTestLists("cpu")
    cuda.torch_fp32                       # [(op name, args[, kwargs]), ...], tensors on the CPU
    cuda, _ = autocast_lists("cuda")      # the same entries (same seed, same values) on a GPU

Importing the module needs ``expecttest`` (through common_utils, for a TestCase this file never uses), which
the test extra does not install: only the two list classes are taken from its source and run.
"""
from __future__ import annotations

import ast
import collections
from functools import lru_cache
from pathlib import Path

import torch
import torch.testing._internal as internal

SOURCE = Path(internal.__file__).parent / "autocast_test_lists.py"
LIST_CLASSES = ("AutocastTestLists", "AutocastCPUTestLists")


@lru_cache(maxsize=None)
def autocast_lists(device: str = "cpu"):
    tree = ast.parse(SOURCE.read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in LIST_CLASSES]
    assert len(classes) == len(LIST_CLASSES), f"{SOURCE} no longer defines {LIST_CLASSES}"
    ns = {"torch": torch, "collections": collections, "TEST_WITH_ROCM": False}
    exec(compile(ast.Module(body=classes, type_ignores=[]), str(SOURCE), "exec"), ns)
    torch.manual_seed(0)
    return ns["AutocastTestLists"](device), ns["AutocastCPUTestLists"](device)


def split(entry: tuple) -> tuple[str, tuple, dict]:
    """(op, args, kwargs) of a list entry, as the lists' ``args_maybe_kwargs`` reads it."""
    op, args = entry[0], entry[1]
    kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
    return op, args, kwargs
