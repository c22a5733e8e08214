"""The OpenAPI document says what the app does: schemathesis drives every route (but the endless SSE streams)
with generated input, and every answer is a documented status, media type and schema, and never a 5xx."""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from deployment.ingress.api.routes import create_api
from deployment.ingress.stats.mirror import StatsMirror
from deployment.settings import Settings
from tests.support.http_support import FakeEngine, FakeStats

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def _app():
    stats = FakeStats()
    stats.add(3, 1)
    return create_api(FakeEngine(), StatsMirror(stats, keepalive_s=0.1), Settings(model="random", dp=2, tp=1,
                      served_model_name="fake-model", max_tokens_default=4))


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@pytest.mark.slow
@schema.exclude(path="/stats/stream").exclude(path="/kv_events").parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_route_answers_as_documented(case):
    case.call_and_validate(checks=CHECKS)


def test_the_document_states_errors_and_media_types_as_they_are():
    doc = _app().openapi()
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in completions and completions["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"}
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(doc["paths"]["/stats/stream"]["get"]["responses"]["200"]["content"]) == {"text/event-stream"}
