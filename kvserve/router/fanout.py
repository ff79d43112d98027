"""The replicas' admin routes through the router (``fan_out``): sent to every replica, each one's answer reported.

``POST /update_weights_from_disk``, ``/sleep``, ``/wake_up``, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` change what a replica serves, so the router sends each to every replica it
knows, at once (prefill replicas too, and those its health checks took out: a wake-up must reach them),
and answers with each one's status and body: 200 ``{"success": true, "replicas": [...]}`` when every
replica answered 2xx, else OpenAI's error body with the same list (the status: the replicas' own when the
failed ones agree, else 502). The call runs to its end even if the client goes away, so the replicas are
never left half-way by the router.

Keys: with ``--admin-key`` the routes need it (the router's own key), and the replicas get
``--backend-api-key`` in its place; without it the client's ``Authorization`` goes on as it came, and each
replica checks it against its own ``--api-key``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi.responses import JSONResponse

from kvserve.router.proxy import Route

FANNED_OUT = ("/update_weights_from_disk", "/sleep", "/wake_up", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def replica_headers(route: Route, admin_keyed: bool, backend_key: str | None) -> list[tuple[str, str]]:
    """The headers each replica gets: the client's, with the router's admin key swapped for the replicas' key."""
    if not admin_keyed:
        return route.headers
    headers = [(k, v) for k, v in route.headers if k.lower() != "authorization"]
    return headers + [("authorization", f"Bearer {backend_key}")] if backend_key else headers


async def _one(client: httpx.AsyncClient, url: str, route: Route, headers: list[tuple[str, str]]) -> dict[str, Any]:
    try:
        resp = await client.request(route.method, url + route.path, params=route.query or None, headers=headers,
                                    content=route.body)
    except httpx.HTTPError as e:
        return {"replica": url, "status_code": None, "body": None, "error": f"unreachable: {type(e).__name__}: {e}"}
    try:
        body: Any = resp.json()
    except ValueError:
        body = resp.text
    return {"replica": url, "status_code": resp.status_code, "body": body}


def _message(result: dict[str, Any]) -> str:
    body = result["body"]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return result.get("error") or f"answered {result['status_code']}"


async def fan_out(client: httpx.AsyncClient, urls: list[str], route: Route,
                  headers: list[tuple[str, str]]) -> JSONResponse:
    """``route`` sent to every replica in ``urls`` at once; the answer as the module says."""
    # shielded: a client that goes away does not stop the replicas' calls half-way
    return summarize(await asyncio.shield(asyncio.gather(*(_one(client, u, route, headers) for u in urls))))


def summarize(results: list[dict[str, Any]]) -> JSONResponse:
    """One answer from each replica's (``{"replica", "status_code", "body"}``, ``status_code`` None and an
    ``error`` for one that could not be reached): the module's 200, or an error with the replicas' status or 502."""
    if not results:
        return JSONResponse({"error": {"message": "there is no replica to send this to", "type":
                                       "service_unavailable_error", "param": None, "code": "no_backend"}},
                            status_code=503)
    failed = [r for r in results if r["status_code"] is None or not 200 <= r["status_code"] < 300]
    if not failed:
        return JSONResponse({"success": True, "replicas": results})
    statuses = {r["status_code"] for r in failed}
    status = statuses.pop() if len(statuses) == 1 and None not in statuses else 502
    first = failed[0]["body"]
    error = first["error"] if isinstance(first, dict) and isinstance(first.get("error"), dict) else {}
    message = f"{len(failed)} of {len(results)} replicas failed: " + "; ".join(
        f"{r['replica']}: {_message(r)}" for r in failed)
    return JSONResponse({"error": {"message": message,
                                   "type": error.get("type") or ("invalid_request_error" if status < 500
                                                                 else "service_unavailable_error"),
                                   "param": error.get("param"), "code": error.get("code") or "replicas_failed"},
                         "success": False, "replicas": results}, status_code=status)
