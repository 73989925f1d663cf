"""What this machine and install mean for mixed precision (``ampaudit doctor``).

    facts.py    gather(): the torch build, GPUs, CPU flags, precision flags and extras, as plain data
    advice.py   judge(facts) and doctor(): one check per fact, with a status and what to change
    kernels.py  kernel_gap(exc) and fp16_kernel_missing(probe): a kernel this CPU lacks for a dtype (a machine
                note, never a finding about the target), and the probe the tests skip on

The package is not named ``doctor``: ``import ampaudit.doctor`` would then bind the module over the
``ampaudit.doctor()`` function that ``ampaudit/__init__.py`` exports.
"""
from ampaudit.machine.advice import doctor, judge
from ampaudit.machine.facts import gather

__all__ = ["doctor", "gather", "judge"]
