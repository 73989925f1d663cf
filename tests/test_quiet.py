"""ampaudit.quiet: torch's own warnings stay off the screen while ampaudit captures or calibrates; the user's
code's warnings still show (once each), and AMPAUDIT_DEBUG=1 shows everything."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ampaudit.quiet import quiet


def _torch_warning():
    # A warning attributed to a torch file, as torch's own chatter is.
    warnings.warn_explicit("torch machinery talking", UserWarning, torch.__file__, 1)


def _user_warning():
    warnings.warn("your model did something odd", UserWarning)    # attributed to this file: the user's code


def test_torch_warnings_are_dropped_and_the_users_shown_once():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet():
            for _ in range(3):
                _torch_warning()
                _user_warning()
    assert [str(w.message) for w in seen] == ["your model did something odd"]
    assert seen[0].filename == __file__


def test_an_error_filter_outside_does_not_turn_torch_chatter_into_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with quiet():
            _torch_warning()


def test_debug_shows_every_warning(monkeypatch):
    monkeypatch.setenv("AMPAUDIT_DEBUG", "1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet():
            _torch_warning()
            _user_warning()
    assert len(seen) == 2


class _Lstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 4)

    def forward(self, x):
        if x.sum() > 0:              # data-dependent: fx fails, export warns about the LSTM's flat weights
            return self.lstm(x)[0]
        return x


def test_capture_keeps_torch_warnings_off_the_screen():
    from ampaudit.capture import capture_any

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cap = capture_any(_Lstm(), (torch.ones(2, 3, 4),), {})
    assert cap.mode in ("export", "dispatch")
    assert not seen, [f"{w.filename}:{w.lineno}: {w.message}" for w in seen]


@pytest.mark.filterwarnings("error")
def test_cuda_simulation_keeps_its_kernel_override_warning_quiet():
    from ampaudit.policy import Policy
    from ampaudit.simulate import simulation

    with torch.autocast("cpu", dtype=torch.float16), simulation(Policy.load("cuda", "float16")):
        assert torch.nn.functional.softmax(torch.randn(3), -1).dtype == torch.float32


def test_an_installed_librarys_own_warnings_are_dropped():
    import sysconfig

    from ampaudit.quiet import concerns_user

    library = str(__import__("pathlib").Path(sysconfig.get_paths()["purelib"]) / "torchvision" / "_meta.py")
    assert not concerns_user(library)        # torchvision's fake kernels warn while shapes propagate
    assert concerns_user(__file__)
