"""Which BatchNorm layers normalize over one rank's micro-batch alone, and below which micro-batch that is noisy.

    per_rank_batchnorms(model)     # ["bn1", "layer1.0.bn1", ...]: not SyncBatchNorm, not the trainer's CPU one
    min_micro_batch()              # 16, from rules/policy/settings.toml [batchnorm]

Shared by the static audit (``check --batch``, AMP304) and the trainer's start-of-training warning
(:mod:`ampaudit.train.batchnorm`), so both judge the same layers against the same threshold.
"""
from __future__ import annotations

from torch import nn

from ampaudit.policy import settings

# A BatchNorm class that all-reduces its statistics over the ranks sets this class attribute to True (the
# trainer's CpuSyncBatchNorm; torch's SyncBatchNorm is known by its class).
SYNCS_RANKS = "syncs_across_ranks"


def min_micro_batch() -> int:
    """The micro-batch below which BatchNorm's per-rank statistics count as too noisy."""
    return int(settings()["batchnorm"]["min_micro_batch"])


def per_rank_batchnorms(model: nn.Module) -> list[str]:
    """Names of the BatchNorm modules of ``model`` that normalize over their own rank's micro-batch alone."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and not isinstance(m, nn.SyncBatchNorm) and not getattr(m, SYNCS_RANKS, False)]
