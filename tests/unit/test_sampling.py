from __future__ import annotations

import numpy as np
import pytest

from edge_agent.errors import InputError
from edge_agent.models.sampling import Sampler, SamplingParams, find_stop, repeated_too_often


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": ("",)}, "stop strings"),
    ],
)
def test_invalid_parameters_are_input_errors(kwargs, match):
    with pytest.raises(InputError, match=match):
        SamplingParams(**kwargs)


def test_greedy_is_argmax():
    logits = np.array([0.1, 2.0, -1.0, 1.9], np.float32)
    assert Sampler(SamplingParams()).choose(logits, []) == 1


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, seed=7)
    s1, s2 = Sampler(params), Sampler(params)
    draws1 = [s1.choose(logits, []) for _ in range(4000)]
    draws2 = [s2.choose(logits, []) for _ in range(4000)]
    assert draws1 == draws2
    freq = np.bincount(draws1, minlength=4) / 4000
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_top_k_and_top_p_restrict_the_support():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    top_k = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=1))
    assert {top_k.choose(logits, []) for _ in range(500)} == {0, 1}
    top_p = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=1))  # 0.4 + 0.3 < 0.75 -> needs the third
    assert {top_p.choose(logits, []) for _ in range(500)} == {0, 1, 2}


def test_temperature_sharpens_like_the_reference_softmax():
    logits = np.array([1.0, 0.0, -1.0])
    s = Sampler(SamplingParams(temperature=0.5, seed=3))
    freq = np.bincount([s.choose(logits, []) for _ in range(6000)], minlength=3) / 6000
    np.testing.assert_allclose(freq, softmax(logits / 0.5), atol=0.03)


def test_repetition_penalty_demotes_seen_tokens():
    logits = np.array([2.0, 1.9, -0.5], np.float32)
    s = Sampler(SamplingParams(repetition_penalty=1.2))
    assert s.choose(logits, [0]) == 1  # 2.0 / 1.2 < 1.9
    assert logits[0] == 2.0  # the caller's logits are untouched


def test_repeat_limit_and_stop_strings():
    assert repeated_too_often([1, 5, 5, 5], 3) and not repeated_too_often([5, 1, 5], 3)
    assert not repeated_too_often([5, 5, 5], 0)
    assert find_stop("hello world. Bye", [".", "Bye"]) == 11
    assert find_stop("abc</s", ["</s>"]) is None
    assert find_stop("abc</s>", ["</s>"], searched_upto=6) == 3  # a stop spanning the previous piece
