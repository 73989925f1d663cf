"""Which module of the model made its output: the module to act on when the output logits grow (a z-loss on its
output, keeping it in fp32, its weight decay), named on the ``output_logit`` / ``output_lse`` precursor events.

    producer = OutputProducer(root)
    producer.observe(mod, args, out)     # each module's forward hook on a sampled pass (children fire first)
    producer.resolve(logits)             # the root's forward hook: the module whose output ``logits`` is
    producer.name                        # "lm_head", or None (no module's output is the model's)

A module's output *is* the model's output when it is the same tensor object (the root and containers above the
producer return it as it is), or, when the root changes it on the way out (``logits.float()``, a soft cap
``cap * tanh(logits / cap)``, ``.view``), when the output's autograd graph leads back to that tensor through the
casts, views and elementwise ops of ``[output_logit] producer_ops`` (rules/policy/precursors.toml), each with one
input that is not a parameter (a learned scale may be the other); a product (``x @ wte.weight.T``) is the root's
own. Of the modules that qualify the first to
return it is named: the innermost, since hooks run child first. A module that returns one of its inputs (nn.Identity,
an in-place activation, dropout in eval) passes a tensor on without making it and is never named. Without autograd
(no_grad) only the same object counts. What is kept per pass is a name, a weak reference and the autograd node of
each module output, dropped when the pass ends.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn

from ampaudit.policy import precursors as precursor_policy


def _kind(node: Any) -> str:
    """An autograd node's op, without the overload's number (``MulBackward0`` -> ``MulBackward``)."""
    return type(node).__name__.rstrip("0123456789")


def _chain(node: Any, ops: frozenset[str], depth: int) -> list[Any]:
    """``node`` and the nodes before it, while each is one of ``ops`` with one input that is not a parameter
    (AccumulateGrad), at most ``depth`` of them."""
    out = []
    while node is not None and len(out) < depth:
        out.append(node)
        if _kind(node) not in ops:
            break
        nexts = [f for f, _ in node.next_functions if f is not None and _kind(f) != "AccumulateGrad"]
        node = nexts[0] if len(nexts) == 1 else None
    return out


class OutputProducer:
    """The module that made the model's output, found on the passes whose module hooks are in place."""

    def __init__(self, root: nn.Module):
        self._names = {m: n for n, m in root.named_modules() if m is not root}
        cfg = precursor_policy()["output_logit"]
        self._ops, self._depth = frozenset(cfg["producer_ops"]), int(cfg["producer_depth"])
        self._seen: list[tuple[str, Any, Any]] = []      # (name, weakref to its output, its output's grad_fn)
        self.name: str | None = None

    def observe(self, mod: nn.Module, args: Any, out: Any) -> None:
        """A module returned ``out`` (called from its forward hook)."""
        if type(out) is not torch.Tensor or not out.is_floating_point():
            return
        if isinstance(args, tuple) and any(a is out for a in args):     # passed on, not made here
            return
        name = self._names.get(mod)
        if name is not None:
            self._seen.append((name, weakref.ref(out), out.grad_fn))

    @property
    def observed(self) -> bool:
        """Whether module outputs were seen since the last :meth:`resolve` / :meth:`clear`."""
        return bool(self._seen)

    def resolve(self, out: torch.Tensor) -> str | None:
        """Set and return :attr:`name`: the module whose output ``out`` is (None when none is); ends the pass."""
        seen, self._seen = self._seen, []
        found = next((name for name, ref, _ in seen if ref() is out), None)
        if found is None:
            for node in _chain(out.grad_fn, self._ops, self._depth):
                found = next((name for name, _, fn in seen if fn is node), None)
                if found is not None:
                    break
        self.name = found
        return found

    def clear(self) -> None:
        """Forget this pass's outputs (a forward that raised; the watch closing)."""
        self._seen = []
