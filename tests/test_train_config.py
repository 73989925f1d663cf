"""TrainConfig: the Trainer's keywords and config= are one thing; `ampaudit train --config FILE` reads it from TOML,
the flags given on the command line win, and a bad file is one line with exit 2."""
import dataclasses
import inspect
import json

import pytest
import torch
from conftest import ASSETS, load_module
from typer.testing import CliRunner

import ampaudit.cli.commands  # noqa: F401  registers the commands
from ampaudit.cli.app import app
from ampaudit.cli.train import _FIELD_OF_FLAG, train
from ampaudit.errors import ConfigError
from ampaudit.runtime.trace import read_trace
from ampaudit.train import Trainer
from ampaudit.train.config import FIELDS, TrainConfig, load_train_config

MLP = ASSETS / "train_mlp.py"


@pytest.fixture(scope="module")
def mlp():
    return load_module(MLP)


def _trainer(mlp, **kwargs) -> Trainer:
    return Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, handle_signals=False, **kwargs)


def test_keywords_and_config_are_the_same_settings(mlp):
    by_keyword = _trainer(mlp, dtype="bfloat16", accum=2, clip_norm=1.0, scaler_options={"init_scale": 1024.0})
    config = TrainConfig(dtype="bfloat16", accum=2, clip_norm=1.0, init_scale=1024.0, handle_signals=False)
    by_config = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, config=config)
    assert by_keyword.config == by_config.config
    assert by_config.accum == 2 and by_config.dtype == torch.bfloat16 and by_config._clip_max == 1.0
    on_top = Trainer(mlp.build_model(), mlp.loss_fn, mlp.train_data, config=config, accum=4, dtype="float16")
    assert on_top.accum == 4 and on_top.scaler.get_scale() == 1024.0      # keywords win, the rest is the config's
    assert config.accum == 2                                              # and the config itself is unchanged


@pytest.mark.parametrize("kwargs, name", [({"acum": 2}, "acum"), ({"scaler_options": {"init_scal": 2.0}}, "init_scal")])
def test_an_unknown_keyword_is_a_type_error_naming_it(mlp, kwargs, name):
    with pytest.raises(TypeError, match=f"Trainer\\(\\) got an unexpected keyword argument '{name}'"):
        _trainer(mlp, **kwargs)


def test_every_train_flag_is_a_config_field():
    flags = [p for p in inspect.signature(train).parameters if p not in ("ctx", "target", "entry", "config",
                                                                           "preflight_only")]
    assert [f for f in flags if _FIELD_OF_FLAG.get(f, f) not in FIELDS] == []


def test_a_file_is_read_with_dashes_aliases_and_paths_relative_to_it(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "run.toml"
    path.write_text('accum = 4\nclip-norm = 1\ncheckpoint = "ckpt"\nclip_per_layer = true\ntrace = "t.jsonl"\n'
                    'fsdp_wrap = "Block, MLP"\ncompile = "aot_eager"\n')
    cfg = load_train_config(path)
    assert (cfg.accum, cfg.clip_norm, cfg.clip_mode, cfg.compile) == (4, 1.0, "layer", "aot_eager")
    assert cfg.checkpoint_dir == tmp_path / "sub" / "ckpt" and cfg.trace == tmp_path / "sub" / "t.jsonl"
    assert cfg.fsdp_wrap == ["Block", "MLP"]
    assert dataclasses.replace(cfg, accum=4) == cfg


@pytest.mark.parametrize("text, says", [
    ("acum = 4\n", "unknown key 'acum' (not a setting of train); did you mean 'accum'?"),
    ("optimizer = 'sgd'\n", "unknown key 'optimizer' (a function of the model file, not a setting)"),
    ("accum = 'four'\n", "'accum' must be an integer, got 'four'"),
    ("accum = true\n", "'accum' must be an integer, got True"),
    ("fsdp = 1\n", "'fsdp' must be true or false, got 1"),
    ("accum = \n", "cannot read it as TOML"),
])
def test_a_bad_file_is_one_config_error_naming_file_and_key(tmp_path, text, says):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as caught:
        load_train_config(path)
    assert str(path) in caught.value.one_line() and says in caught.value.one_line()


def run(*args: str):
    return CliRunner(env={"COLUMNS": "160"}).invoke(app, ["train", *args])


def test_cli_trains_from_the_file_and_flags_given_win(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 5\ndtype = "bfloat16"\naccum = 2\ntrace = "run.jsonl"\nsave = "final.pt"\n')
    r = run(str(MLP), "--config", str(path), "--steps", "3")
    assert r.exit_code == 0, r.output
    assert "trained 3 steps" in r.stdout and (tmp_path / "final.pt").is_file()
    events, problems = read_trace(tmp_path / "run.jsonl")
    assert not problems and events[0]["accum"] == 2 and events[0]["dtype"] == "bfloat16"
    # A flag left at its default does not undo the file: --accum was not given, so the file's 2 holds.
    assert len([e for e in events if e["event"] == "step"]) == 3


@pytest.mark.parametrize("text, says", [
    ("acum = 4\n", "unknown key 'acum'"),
    ("accum = 'four'\n", "'accum' must be an integer"),
    ("accum = 0\nsteps = 2\n", "accum must be >= 1, got 0"),
])
def test_cli_bad_file_is_one_line_exit_2(tmp_path, text, says):
    path = tmp_path / "run.toml"
    path.write_text(text)
    r = run(str(MLP), "--config", str(path), "--steps", "2")
    assert r.exit_code == 2 and says in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_cli_missing_config_file(tmp_path):
    r = run(str(MLP), "--config", str(tmp_path / "none.toml"), "--steps", "2")
    assert r.exit_code == 2 and "no config file" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_the_trace_meta_names_the_same_run_either_way(tmp_path, mlp):
    """The CLI's config and the API's keywords build the same trainer: same meta in the trace."""
    cli_trace, api_trace = tmp_path / "cli.jsonl", tmp_path / "api.jsonl"
    r = run(str(MLP), "--steps", "2", "--dtype", "bfloat16", "--accum", "2", "--clip-per-layer", "--clip-norm", "1",
            "--trace", str(cli_trace))
    assert r.exit_code == 0, r.output
    _trainer(mlp, dtype="bfloat16", accum=2, clip_mode="layer", clip_norm=1.0, trace=api_trace).fit(steps=2)
    keys = ("dtype", "opt_level", "accum", "scaler", "clip", "fsdp", "compile")
    cli, api = read_trace(cli_trace)[0][0], read_trace(api_trace)[0][0]
    assert json.dumps({k: cli[k] for k in keys}) == json.dumps({k: api[k] for k in keys})


def test_a_callback_takes_its_trace_settings_from_the_runs_config(tmp_path):
    pytest.importorskip("transformers")
    from ampaudit.integrations.transformers import AmpAuditCallback

    config = TrainConfig(trace=tmp_path / "run.jsonl", trace_every=7, divergence_every=21)
    session = AmpAuditCallback(config=config).session
    assert (session.trace, session.every, session.divergence_every) == (tmp_path / "run.jsonl", 7, 21)
    assert AmpAuditCallback("other.jsonl", every=3).session.every == 3        # without one, the arguments
