"""``[api] cors_origins`` (TOML or ``EDGE_AGENT_API__CORS_ORIGINS``) and the CORS policy it makes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from edge_agent.config import Settings
from edge_agent.config.api import ApiConfig
from edge_agent.serving.doors.http.guard import Cors


def test_cors_is_off_by_default():
    assert ApiConfig().cors_origins == []
    assert not Cors(ApiConfig().cors_origins).allowed("http://localhost:3000")


def test_the_environment_sets_the_origins_as_json(monkeypatch):
    monkeypatch.setenv("EDGE_AGENT_API__CORS_ORIGINS", '["http://localhost:3000"]')
    assert Settings().api.cors_origins == ["http://localhost:3000"]


@pytest.mark.parametrize("bad", ["http://localhost:3000/", "localhost:3000", "http://ui/app", " http://ui"])
def test_what_is_not_an_origin_is_refused_with_the_form_to_write(bad):
    with pytest.raises(ValidationError, match="scheme://host"):
        ApiConfig(cors_origins=[bad])


def test_an_allow_list_allows_exactly_its_origins_and_star_any():
    cors = Cors(["http://localhost:3000"])
    assert cors.allowed("http://localhost:3000")
    assert not cors.allowed("http://localhost:3001") and not cors.allowed(None) and not cors.allowed("")
    assert Cors(["*"]).allowed("https://anything.example")
    # the origin itself, never "*": a page that sends credentials is refused a wildcard by browsers
    assert Cors(["*"]).response_headers("http://a.example")["Access-Control-Allow-Origin"] == "http://a.example"
