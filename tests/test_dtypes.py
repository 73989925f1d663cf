"""One table of dtype names."""
import pytest
import torch

from ampaudit.dtypes import by_name, name_of, parse_train_dtype
from ampaudit.errors import UsageError


def test_names_and_aliases():
    assert by_name("bf16") is torch.bfloat16 and by_name("torch.half") is torch.float16 and by_name("x") is None
    assert name_of(torch.float16) == "float16" and name_of(None) == "?"


def test_training_dtypes_are_the_two_16_bit_ones_and_fp32():
    assert parse_train_dtype("fp16") is torch.float16 and parse_train_dtype(torch.float32) is torch.float32
    with pytest.raises(UsageError, match="unsupported training dtype"):
        parse_train_dtype("int64")


def test_low_precision_is_narrower_than_fp32_and_half_is_autocasts_two():
    from ampaudit.dtypes import FLOAT8, is_half, is_low, is_low_tensor

    assert is_low(torch.float16) and is_low(torch.bfloat16) and all(is_low(d) for d in FLOAT8)
    assert not any(is_low(d) for d in (torch.float32, torch.float64, torch.int16, torch.int8, None))
    assert is_half(torch.bfloat16) and not is_half(torch.float8_e4m3fn) and not is_half(torch.float32)
    assert is_low_tensor(torch.zeros(2, dtype=torch.bfloat16)) and not is_low_tensor(torch.zeros(2))


def test_limits_and_rounding_come_from_finfo():
    from ampaudit.dtypes import dtype_of, exact_int_limit, limits, low_dtype, max_of, narrower, unit_roundoff

    fp16 = limits(torch.float16)
    assert (fp16.max, fp16.normal, fp16.subnormal, fp16.bits) == (65504.0, 2.0 ** -14, 2.0 ** -24, 16)
    assert fp16.as_dtype(70000.0) == float("inf") and fp16.as_dtype(2.0 ** -26) == 0.0
    assert unit_roundoff(torch.float16) == 2.0 ** -11 and unit_roundoff(torch.bfloat16) == 2.0 ** -8
    # Every integer up to 2 ** (mantissa bits + 1) is exact; the next one is not.
    for dtype in (torch.float16, torch.bfloat16):
        n = exact_int_limit(dtype)
        assert torch.tensor(float(n), dtype=dtype).item() == n
        assert torch.tensor(float(n + 1), dtype=dtype).item() != n + 1
    assert (exact_int_limit(torch.float16), exact_int_limit(torch.bfloat16)) == (2048, 256)
    assert max_of("bfloat16") == float(torch.finfo(torch.bfloat16).max)
    assert dtype_of("float8_e4m3fn") is torch.float8_e4m3fn and dtype_of("bf16") is torch.bfloat16
    assert dtype_of("softmax") is None and dtype_of(3) is None
    assert low_dtype("bfloat16") is torch.bfloat16 and low_dtype(torch.float32) is torch.float16
    assert narrower(torch.float16, torch.bfloat16) and not narrower(torch.float32, torch.bfloat16)


def test_policy_keeps_the_old_import_path_of_dtype_limits():
    from ampaudit import dtypes, policy

    assert policy.DTypeLimits is dtypes.DTypeLimits and policy.unit_roundoff is dtypes.unit_roundoff
    assert policy.Policy.load("cuda", "float16").limits.max == 65504.0
    assert policy.Policy.load("cuda", "float8").short() == "fp8"


def test_only_dtypes_reads_finfo():
    """torch.finfo is read in one place; everything else asks ampaudit.dtypes."""
    import ast
    from pathlib import Path

    import ampaudit

    root = Path(ampaudit.__file__).parent
    readers = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "finfo":
                readers.append(str(path.relative_to(root)))
    assert sorted(set(readers)) == ["dtypes.py"]
