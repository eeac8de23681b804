"""A missing fetchable model (the registry's, or one with a shipped adapter) says how to get it."""

from __future__ import annotations

import pytest


def test_a_missing_fetchable_model_says_how_to_get_it(tmp_path):
    from edge_agent.importers.adapter import ADAPTERS
    from edge_agent.importers.fetch import FETCHABLE
    from edge_agent.models.catalog import FETCHABLE_NAMES, ModelNotFound, resolve_model

    assert set(FETCHABLE_NAMES) == {*FETCHABLE, *ADAPTERS}
    with pytest.raises(ModelNotFound) as err:
        resolve_model("gemma-3-270m-home", tmp_path)
    assert (
        str(err.value)
        == "model 'gemma-3-270m-home' is not here yet: get it with `edge-agent models fetch gemma-3-270m-home`"
    )
