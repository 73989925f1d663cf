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
