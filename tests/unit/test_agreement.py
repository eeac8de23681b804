"""LocalAgreement-2: what two consecutive hypotheses share is committed, and never changes."""

from __future__ import annotations

import pytest

from edge_agent.models.agreement import LocalAgreement, common_prefix


@pytest.mark.parametrize(
    "a, b, n", [([], [], 0), ([1, 2], [1, 2, 3], 2), ([1, 2], [2, 1], 0), ([1, 2, 3], [1, 2, 4], 2)]
)
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n


@pytest.mark.parametrize(
    "hypotheses, commits",
    [
        # the first hypothesis alone commits nothing; the second commits the shared prefix
        ([["the", "cat"], ["the", "cat", "sat"], ["the", "cat", "sat", "on"]], [[], ["the", "cat"], ["sat"]]),
        # a changed guess is not committed until it is repeated
        ([["a", "bat"], ["a", "cat"], ["a", "cat", "sat"]], [[], ["a"], ["cat"]]),
        # hypotheses that shrink commit nothing more
        ([["x", "y", "z"], ["x", "y", "z"], ["x"]], [[], ["x", "y", "z"], []]),
    ],
)
def test_insert_commits_the_prefix_of_the_last_two(hypotheses, commits):
    la = LocalAgreement(2)
    assert [la.insert(h) for h in hypotheses] == commits


def test_committed_never_changes_even_if_a_hypothesis_contradicts_it():
    la = LocalAgreement(2)
    la.insert([1, 2, 3])
    la.insert([1, 2, 4])
    assert la.committed == [1, 2]
    assert la.insert([9, 9, 9]) == []  # rewrites the committed part: judged as what follows it
    assert la.committed == [1, 2] and la.unstable == [9, 9, 9]
    assert la.insert([9, 9, 7]) == [9, 9]  # two hypotheses agree on "9 9" after the committed part
    assert la.committed == [1, 2, 9, 9]


def test_finish_commits_the_last_hypothesis():
    la = LocalAgreement(2)
    la.insert([1, 2])
    la.insert([1, 2, 3])
    assert la.finish([1, 2, 3, 4]) == [3, 4]
    assert la.committed == [1, 2, 3, 4]


def test_a_final_that_revises_committed_tokens_replaces_them_whole():
    la = LocalAgreement(2)
    la.insert([1, 2, 3])
    la.insert([1, 2, 3, 4])
    assert la.committed == [1, 2, 3]
    assert la.finish([1, 5, 3, 4]) == [5, 3, 4]  # a free final heard the second token again
    assert la.committed == [1, 5, 3, 4] and la.unstable == []
    la = LocalAgreement(2)
    la.insert([7, 8])
    la.insert([7, 8])
    assert la.finish([7]) == [] and la.committed == [7]  # shorter than the commits: the final's text
    assert LocalAgreement(2).finish() == []


def test_n_three_needs_three_agreeing():
    la = LocalAgreement(3)
    assert la.insert([1, 2]) == [] and la.insert([1, 2]) == []
    assert la.insert([1, 3]) == [1]


def test_n_must_be_positive():
    with pytest.raises(ValueError):
        LocalAgreement(0)
