"""bench/coverage.py: the tables, the plain-PyTorch nms, and smoke runs of the worker pool on torchvision models.

The smoke runs need the ``bench`` extra's torchvision; without it they are skipped (CI may not install it).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import coverage as cov  # noqa: E402
from coverage_tvops import _nms_cpu  # noqa: E402


def _row(family, model, eager=True, fx=True, export=True, ampaudit=True, capture="fx", seconds=1.0, error=None):
    return {"family": family, "model": model, "device": "meta", "eager": eager, "fx": fx, "export": export,
            "ampaudit": ampaudit, "capture": capture if ampaudit else None, "findings": 0,
            "seconds": {"ampaudit": seconds}, "errors": {"ampaudit": error} if error else {}, "notes": []}


ROWS = [
    _row("torchvision-cls", "a"),
    _row("torchvision-cls", "b", fx=False, capture="export", seconds=3.0),
    _row("torchvision-det", "c", fx=False, export=False, capture="dispatch", seconds=9.0),
    _row("timm", "d", eager=False, fx=None, export=None, ampaudit=None),
    _row("timm", "e", fx=False, export=False, ampaudit=False, error="CaptureError: boom"),
]


def test_shares_count_only_models_whose_eager_forward_runs():
    assert cov.share(ROWS, "ampaudit") == (3, 4)
    assert cov.share(ROWS, "fx") == (1, 4)
    table = {line[0]: line for line in cov.family_table(ROWS)}
    assert table["timm"][1:6] == ["2", "1", "0.0% (0/1)", "0.0% (0/1)", "0.0% (0/1)"]
    assert table["all"][5] == "75.0% (3/4)"
    assert table["torchvision-cls"][6] == "fx 1, export 1"
    assert "transformers" not in table   # families without rows get no line


def test_capture_table_and_failures():
    lines = {line[0]: line for line in cov.capture_table(ROWS)}
    assert lines["dispatch"][1:5] == ["1", "25.0% (1/4)", "9.00", "9.00"]
    assert lines["export"][5] == "torchvision-cls"
    assert cov.failures(ROWS) == ["timm/e: CaptureError: boom"]
    md = cov.render(cov.COLUMNS, cov.family_table(ROWS), markdown=True).splitlines()
    assert md[0].startswith("| family | models |") and md[1] == "|" + "---|" * len(cov.COLUMNS)


def test_bad_flags_exit_with_a_message(capsys):
    with pytest.raises(SystemExit) as exc:
        cov.parse_args(["--families", "torchvision-cls,nope"])
    assert exc.value.code == 2
    assert "unknown family nope" in capsys.readouterr().err


def _nms_reference(boxes, scores, thr):
    def iou(a, b):
        lt, rb = torch.maximum(a[:2], b[:2]), torch.minimum(a[2:], b[2:])
        inter = (rb - lt).clamp(min=0).prod()
        area = lambda x: (x[2] - x[0]) * (x[3] - x[1])  # noqa: E731
        return inter / (area(a) + area(b) - inter)

    keep = []
    for i in scores.argsort(descending=True).tolist():
        if all(iou(boxes[i], boxes[j]) <= thr for j in keep):
            keep.append(i)
    return keep


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_nms_matches_greedy_reference(seed):
    g = torch.Generator().manual_seed(seed)
    boxes = torch.rand(60, 4, generator=g) * 50
    boxes[:, 2:] += boxes[:, :2] + 1
    scores = torch.rand(60, generator=g)
    assert _nms_cpu(boxes, scores, 0.5).tolist() == _nms_reference(boxes, scores, 0.5)
    assert _nms_cpu(boxes[:0], scores[:0], 0.5).numel() == 0


def _torchvision_or_skip():
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("the bench extra (torchvision) is not installed")
    from coverage_tvops import import_torchvision

    try:
        import_torchvision()
    except Exception as exc:   # a torchvision that does not fit this torch
        pytest.skip(f"torchvision does not import beside torch {torch.__version__}: {exc}")


def _run(tmp_path, *flags):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH / "coverage.py"), "--families", "torchvision-cls",
                           "--workers", "1", "--json", str(out), *flags],
                          check=False, capture_output=True, text=True, timeout=240)
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_smoke_run_audits_every_model_whose_forward_runs(tmp_path):
    _torchvision_or_skip()
    proc, payload = _run(tmp_path, "--models", "alexnet,squeezenet1_1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = payload["rows"]
    assert [r["model"] for r in rows] == ["alexnet", "squeezenet1_1"]
    for r in rows:
        assert r["eager"] and r["device"] == "meta"
        assert r["ampaudit"] and r["capture"] == "fx" and r["fx"] is True and r["export"] is True
        assert set(r["seconds"]) >= {"eager", "fx", "export", "ampaudit"}
    assert "torchvision-cls  2" in proc.stdout and "100.0% (2/2)" in proc.stdout
    assert payload["meta"]["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert "partial" not in payload["meta"] and payload["meta"]["wall_s"] > 0


@pytest.mark.slow
def test_a_stage_past_the_time_limit_is_recorded_and_the_run_goes_on(tmp_path):
    _torchvision_or_skip()
    proc, payload = _run(tmp_path, "--limit", "1", "--timeout", "0.001")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [row] = payload["rows"]
    assert row["eager"] is False and row["errors"]["eager"].startswith("timeout after")
    assert row["ampaudit"] is None   # no model whose forward runs, so no incomplete audit and exit 0


@pytest.mark.slow
def test_a_family_whose_library_is_missing_is_a_one_line_error():
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here")
    proc = subprocess.run([sys.executable, str(BENCH / "coverage.py"), "--families", "torchvision-cls"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: the torchvision-cls family needs torchvision: pip install -e '.[bench]' torch==<the installed torch>"]


def _timed(family, model, capture, check, export, calibrate=None, counts=None, eager=True):
    row = _row(family, model, eager=eager, capture=capture, seconds=check, export=export is not None)
    row["seconds"]["export"] = export
    row["detail"] = {"check": {"counts": counts or {}}}
    if calibrate is not None:
        row["calibrate"] = calibrate
        if calibrate:
            row["detail"]["calibrate"] = {"counts": {}}
            row["seconds"]["calibrate"] = 3.0 * check
    return row


def test_timing_table_ratios_are_against_plain_export_and_alarms_count_only_precision_warnings():
    rows = [
        _timed("diffusers", "a", "export", 2.0, 1.0, calibrate=True,
               counts={"AMP301|sensitive-op|warning": 2, "AMP301|sensitive-op|info": 5, "AMP401|alignment|warning": 1}),
        _timed("diffusers", "b", "export", 6.0, 2.0, calibrate=False),
        _timed("diffusers", "c", "dispatch", 9.0, None),     # export failed: no ratio
    ]
    assert [cov.bare_ratio(r) for r in rows] == [2.0, 3.0, None]
    assert cov.precision_alarms(rows[0]) == 2
    line = {l[0]: l for l in cov.timing_table(rows)}["diffusers"]
    assert line == ["diffusers", "100.0% (3/3)", "6.00", "9.00", "2.50", "3.00", "2 / 0", "1/2", "6.0 / 6.0"]


def test_build_failures_group_by_reason_without_the_model_specific_parts():
    rows = [_row("transformers-all", m, eager=False, fx=None, export=None, ampaudit=None) for m in "xyz"]
    rows[0]["errors"]["eager"] = "meta: RuntimeError: a | cpu: TypeError: Bros2Model() needs 1 input: 'bbox'"
    rows[1]["errors"]["eager"] = "meta: RuntimeError: b | cpu: TypeError: Bros3Model() needs 2 input: \"ids\""
    rows[2]["errors"]["eager"] = "cpu: KeyError: 'rope_type'"
    rows.append(_row("transformers-all", "w", eager=False, fx=None, export=None, ampaudit=None))
    rows[3]["errors"]["eager"] = "cpu: TypeError: GroundingDinoModel.forward() missing 1 required argument: 'ids'"
    rows.append(_row("transformers-all", "v", eager=False, fx=None, export=None, ampaudit=None))
    rows[4]["errors"]["eager"] = "cpu: TypeError: Blip2QFormerModel.forward() missing 1 required argument: 'q'"
    assert cov.build_failures(rows) == [(2, "TypeError: BrosNModel() needs N input: '_'", ["x", "y"]),
                                        (2, "TypeError: forward() missing N required argument: '_'", ["w", "v"]),
                                        (1, "KeyError: '_'", ["z"])]


def test_shards_partition_the_selection():
    args = cov.parse_args(["--families", "diffusers"])
    full = [s["name"] for s in cov.select(args)]
    parts = []
    for i in (1, 2, 3):
        args = cov.parse_args(["--families", "diffusers", "--shard", f"{i}/3"])
        parts.extend(s["name"] for s in cov.select(args))
    assert sorted(parts) == sorted(full) and len(full) == 7


def test_transformers_configs_shrink_by_name_and_keep_special_tokens_inside_the_vocab():
    transformers = pytest.importorskip("transformers")
    from coverage_hf import shrink

    config = transformers.PretrainedConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                           intermediate_size=11008, head_dim=128, vocab_size=152064,
                                           image_token_id=151655, depths=[3, 4, 6, 3], hidden_sizes=[256, 2048],
                                           max_position_embeddings=32768)
    config.vision_config = transformers.PretrainedConfig(hidden_size=1152, num_hidden_layers=27)
    shrink(config)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (32, 2, 2)
    assert (config.intermediate_size, config.head_dim) == (64, 16)
    assert config.vocab_size == 151656                     # the image token must stay a valid id
    assert config.depths == [1, 1, 1, 1] and config.hidden_sizes == [8, 64]
    assert config.max_position_embeddings == 32768          # not a size of the weights: left alone
    assert (config.vision_config.hidden_size, config.vision_config.num_hidden_layers) == (32, 2)


def test_merge_lays_a_calibration_pass_over_the_static_rows(tmp_path, capsys):
    static = _timed("diffusers", "a", "export", 2.0, 1.0)
    static["calibrate"] = None
    later = {**_row("diffusers", "a", fx=None, export=None, ampaudit=None), "calibrate": True,
             "seconds": {"eager": 0.1, "calibrate": 4.0}, "errors": {},
             "detail": {"calibrate": {"counts": {}, "alarms": ["AMP301 warning head: softmax in fp16"]}}}
    for name, rows in (("s.json", [static]), ("c.json", [later])):
        (tmp_path / name).write_text(json.dumps({"meta": {"versions": {"torch": "x"}}, "rows": rows}))
    [row] = cov.merge([tmp_path / "s.json", tmp_path / "c.json"])
    assert row["ampaudit"] is True and row["export"] is True and row["calibrate"] is True
    assert row["seconds"]["calibrate"] == 4.0 and row["seconds"]["export"] == 1.0
    assert set(row["detail"]) == {"check", "calibrate"}
    assert cov.main(["--merge", str(tmp_path / "s.json"), str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "check --calibrate completed on 1/1 models" in out and "torch x" in out
    assert "alarm (calibrate): diffusers/a: AMP301 warning head: softmax in fp16" in out


def test_cpu_table_reads_each_check_s_cpu_seconds_and_names_the_slow_ones():
    rows = [_timed("diffusers", m, "export", 1.0, 1.0) for m in "abc"]
    for row, cpu in zip(rows, (2.0, 14.5, 3.0)):
        row["cpu"] = {"ampaudit": cpu}
    rows.append(_timed("diffusers", "d", "export", 1.0, 1.0))      # a run from before CPU seconds were kept
    line = {l[0]: l for l in cov.cpu_table(rows)}["diffusers"]
    assert line == ["diffusers", "3", "3.00", "14.50 (b)", "b 14.5", "-"]
    assert cov.cpu_table([rows[3]]) == []
