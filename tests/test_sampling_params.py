import pytest

from batchgen.sampling_params import SamplingParams


def test_defaults():
    params = SamplingParams()
    assert params.n == 1
    assert params.max_tokens == 16
    assert params.min_tokens == 0
    assert params.temperature == 1.0
    assert params.top_k == 0
    assert params.top_p == 1.0
    assert params.min_p == 0.0
    assert params.repetition_penalty == 1.0
    assert params.seed is None
    assert params.stop == []
    assert params.stop_token_ids == []
    assert params.ignore_eos is False
    assert params.skip_special_tokens is True
    assert not params.is_greedy


def test_default_lists_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": 1.5}, "n must be an int >= 1, got 1.5 (float)"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": "10"}, "max_tokens must be an int >= 1, got '10' (str)"),
        ({"max_tokens": 1.5}, "max_tokens must be an int >= 1, got 1.5 (float)"),
        ({"max_tokens": True}, "max_tokens must be an int >= 1, got True (bool)"),
        ({"min_tokens": -1}, "min_tokens must be in [0, max_tokens=16], got -1"),
        ({"min_tokens": 17}, "min_tokens must be in [0, max_tokens=16], got 17"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": float("nan")}, "temperature must be >= 0, got nan"),
        ({"temperature": "hot"}, "temperature must be a number >= 0, got 'hot' (str)"),
        ({"temperature": False}, "temperature must be a number >= 0, got False (bool)"),
        ({"top_k": -2}, "top_k must be >= 1, or 0 / -1 for off, got -2"),
        ({"top_k": 2.0}, "top_k must be an int >= 1, or 0 / -1 for off, got 2.0 (float)"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0, got 0.0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be > 0, got inf"),
        ({"seed": -1}, "seed must be in [0, 9223372036854775807] or None, got -1"),
        ({"seed": "42"}, "seed must be an int in [0, 9223372036854775807] or None, got '42' (str)"),
        ({"stop": 3}, "stop must be a str or a list of str, got 3 (int)"),
        ({"stop": ["ok", 1]}, "stop must be a str or a list of str"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of int >= 0, got 5 (int)"),
        ({"stop_token_ids": [1, -3]}, "stop_token_ids item must be >= 0, got -3"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids item must be an int >= 0, got '2' (str)"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool (true or false), got 1 (int)"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens must be a bool (true or false), got 'yes' (str)"),
    ],
)
def test_bad_values_are_refused_with_field_range_and_value(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert message in str(excinfo.value)


def test_values_are_normalised():
    params = SamplingParams(temperature=0, top_p=1, top_k=-1, stop="END", stop_token_ids=(3, 4), min_tokens=16)
    assert params.temperature == 0.0 and isinstance(params.temperature, float)
    assert isinstance(params.top_p, float)
    assert params.top_k == 0
    assert params.stop == ["END"]
    assert params.stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    "kwargs, is_greedy",
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({"temperature": 0.7, "top_k": 2}, False),
        ({"temperature": 1e-3}, False),
    ],
)
def test_is_greedy(kwargs, is_greedy):
    assert SamplingParams(**kwargs).is_greedy is is_greedy


def test_dict_round_trip():
    params = SamplingParams(n=3, max_tokens=64, temperature=0.5, seed=7, stop=["\n\n"], stop_token_ids=[2])
    data = params.to_dict()
    assert data["seed"] == 7 and data["stop"] == ["\n\n"]
    data["stop"].append("changed")
    assert params.stop == ["\n\n"]
    assert SamplingParams(**params.to_dict()) == params
