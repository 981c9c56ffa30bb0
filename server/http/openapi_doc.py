"""The OpenAPI document (/openapi.json) with the statuses the server really sends.

FastAPI documents a 422 validation error on every route; swaserve answers bad input with 400 (and every
error with the OpenAI envelope, server/errors.py), refuses large bodies with 413 before parsing, a
missing key with 401, a foreign Host / Origin without a key with 403, unknown models with 404, a full
queue / loading / draining with 503, and unexpected failures with 500 carrying an error id. Each
operation lists those, with the envelope's schema, instead of 422.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: dict[str, Any] = {
    "title": "ErrorResponse",
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

_STATUS = {  # status -> (description, methods it applies to; None = all)
    "400": ("invalid request: the envelope's param names the field", {"post"}),
    "401": ("missing or wrong API key (only with --api-key / --api-key-file / SWASERVE_API_KEY)", None),
    "403": ("Host (or, for a POST, Origin) not allowed: a browser page of another site (only without an "
            "API key)", None),
    "404": ("unknown model (or route)", None),
    "413": ("request body over --max-request-bytes (refused before parsing)", {"post"}),
    "500": ("internal error; the message carries an error id the server log repeats", None),
    "503": ("model loading, server draining, or the queue full (--max-queued-requests)", None),
}
NOT_ON_OPEN = {"403"}  # /health and /metrics answer whatever the Host (server/http/admin_guard.py)


def install_openapi(app: FastAPI, open_paths: tuple[str, ...]) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        _document_bodies(app, doc, schemas)
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["ErrorResponse"] = ERROR_SCHEMA
        ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for status, (desc, methods) in _STATUS.items():
                    if methods is not None and method not in methods:
                        continue
                    if status in NOT_ON_OPEN and path in open_paths:
                        continue
                    responses[status] = {"description": desc, **ref}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _document_bodies(app: FastAPI, doc: dict[str, Any], schemas: dict[str, Any]) -> None:
    """Request bodies parsed off the event loop (server/body.py json_body) are dependencies, which
    FastAPI does not document: add each route's model as its requestBody."""
    for route in app.routes:
        dependant = getattr(route, "dependant", None)
        if dependant is None:
            continue
        for dep in dependant.dependencies:
            model = getattr(dep.call, "model", None)
            if model is None:
                continue
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            for method in route.methods:
                op = doc.get("paths", {}).get(route.path, {}).get(method.lower())
                if op is not None:
                    op["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
