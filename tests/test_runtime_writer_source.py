"""The two rules of the one stack walker (ampaudit.runtime.module_stack): the model's line (``user_source``: the
innermost user frame, whatever machinery lies between) and the writer's line (``writer_source``: the first frame
outside torch and the calling module must be the user's, else no line)."""
from __future__ import annotations

from conftest import load_module

METER = '''
import sys

from ampaudit.runtime.module_stack import user_source, writer_source


def writer(_=None):
    return writer_source(__file__)


def model_line(_=None):
    return user_source(sys._getframe(1))
'''

USER = '''
from torch.utils._pytree import tree_map

from ampaudit.runtime.replay_state import rng_kept


def direct(meter):
    return meter.writer()


def through_torch(meter):
    return tree_map(meter.writer, [0])[0]


def through_ampaudit(meter, fn):
    return rng_kept()(fn)()          # contextlib's wrapper (Python's, not the user's) calls fn
'''


def _files(tmp_path):
    (tmp_path / "meter.py").write_text(METER)
    (tmp_path / "user_code_file.py").write_text(USER)
    return load_module(tmp_path / "meter.py"), load_module(tmp_path / "user_code_file.py")


def _line(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_the_writer_is_the_users_line_past_torch_and_the_calling_module(tmp_path):
    meter, user = _files(tmp_path)
    where = tmp_path / "user_code_file.py"
    assert user.direct(meter).endswith(f"user_code_file.py:{_line(where, 'return meter.writer()')}")
    assert user.through_torch(meter).endswith(f"user_code_file.py:{_line(where, 'tree_map(meter.writer')}")


def test_a_write_called_by_machinery_has_no_writer_but_the_model_line_looks_past_it(tmp_path):
    meter, user = _files(tmp_path)
    where = tmp_path / "user_code_file.py"
    assert user.through_ampaudit(meter, meter.writer) is None          # strict: Python's contextlib called in
    model = user.through_ampaudit(meter, meter.model_line)              # lenient: past contextlib to the user
    assert model.endswith(f"user_code_file.py:{_line(where, 'rng_kept()(fn)()')}"), model
