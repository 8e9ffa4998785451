"""Job-file value checks: accepted values come back normalised, refused ones say what is allowed."""

from __future__ import annotations

import pytest

from batchgen.options import (
    byte_size,
    column_names,
    device_name,
    format_template,
    int_at_least,
    one_of,
    or_null,
    template_columns,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(4096, 4096), ("2GiB", 2 * 2**30), ("512 MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("100", 100),
     ("64kib", 64 * 1024)],
)
def test_byte_size_accepts_ints_and_sizes(value, expected):
    assert byte_size(value) == expected


@pytest.mark.parametrize("value", [0, -5, True, "2 parsecs", "GiB", "0GiB", 1.5, None])
def test_byte_size_refuses_other_values(value):
    with pytest.raises(ValueError, match='expected a number of bytes or a size such as "512MiB" or "2GiB"'):
        byte_size(value)


def test_int_at_least_refuses_bools_floats_and_small_values():
    assert int_at_least(1)(3) == 3
    for value in (True, 2.0, 0, "3"):
        with pytest.raises(ValueError, match=r"^expected an integer >= 1$"):
            int_at_least(1)(value)


def test_one_of_or_null_and_device_names():
    assert or_null(one_of("a", "b"))(None) is None
    with pytest.raises(ValueError, match=r"^expected one of: a, b, or null$"):
        or_null(one_of("a", "b"))("c")
    assert [device_name(name) for name in ("auto", "cpu", "cuda", "cuda:1")] == ["auto", "cpu", "cuda", "cuda:1"]
    with pytest.raises(ValueError, match="cuda:N"):
        device_name("cuda:x")


def test_column_names_must_be_a_list_of_non_empty_strings():
    assert column_names(["a", "b"]) == ["a", "b"]
    for value in ("a", ["a", ""], ["a", 1]):
        with pytest.raises(ValueError, match="expected a list of column names"):
            column_names(value)


def test_format_templates_name_plain_columns():
    assert format_template("Q: {prompt} ({topic})") == "Q: {prompt} ({topic})"
    assert template_columns("{topic}: {prompt} {topic}") == ["topic", "prompt"]
    for bad in ("no fields", "{}", "{0}", "{a.b}", "{a[0]}", "open {"):
        with pytest.raises(ValueError, match="expected a template"):
            format_template(bad)
