"""/v1/embeddings (server/embeddings.py): this generative model serves none, said in an OpenAI error
envelope through the openai client; the body is checked first, another model is a 404."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import SERVED, LiveServer


def test_embeddings_is_a_404_saying_so(client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model=SERVED, input=["a", "b"])
    body = e.value.body
    assert e.value.status_code == 404 and body["type"] == "invalid_request_error"
    assert body["param"] == "model" and body["code"] == "model_does_not_support_embeddings"
    assert "does not support embeddings" in body["message"]


def test_bad_body_and_other_model(server: LiveServer, client: openai.OpenAI):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="text-embedding-3-small", input="a")
    assert e.value.body["code"] == "model_not_found"
    with server.http() as h:
        r = h.post("/v1/embeddings", json={"model": SERVED})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = h.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
