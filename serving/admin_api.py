"""The admin API: which weights serve, which are stored, swap and roll back (bearer token).

A swap (`specrl.serving.swaps`) verifies the stored version against its manifest, has the serving
loop load and check it off the decode path and apply it at a step boundary, then moves the
deployment's `current` (the store's pointer, and Redis's where there is one: every replica follows,
`specrl.serving.follower`). One swap at a time: a second one while the first loads is refused (409).
A failed swap changes nothing: the old weights keep serving, `current` stays.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from specrl.engine.swap import MODES, check_swap
from specrl.errors import AuthError, ForbiddenError, InvalidRequestError, SwapInProgressError
from specrl.serving.swaps import serving_versions, swap_to
from specrl.weights.store import ROLES


class SwapBody(BaseModel):
    role: Literal[ROLES]
    version: str = Field(min_length=1)
    mode: Literal[MODES] = "drain"  # a policy swap's; a drafter swap is immediate


class RollbackBody(BaseModel):
    role: Literal[ROLES]
    mode: Literal[MODES] = "drain"


def require_admin(request: Request) -> None:
    token = request.app.state.settings.admin_token
    if not token:
        raise ForbiddenError("the admin API is disabled: set SPECRL_ADMIN_TOKEN to enable it")
    header = request.headers.get("authorization", "")
    if not header.startswith("Bearer "):
        raise AuthError("missing 'Authorization: Bearer <token>' header")
    if not hmac.compare_digest(header[7:].encode(), token.encode()):
        raise ForbiddenError("wrong admin token")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


@router.get("/weights")
async def list_weights(request: Request):
    store = request.app.state.store
    return {"serving": _serving(request), "current": {r: store.current(r) for r in ROLES},
            "stored": {r: [m.to_dict() for m in store.versions(r)] for r in ROLES}}


@router.post("/weights")
async def swap_weights(body: SwapBody, request: Request):
    return await _swap(request, body.role, body.version, body.mode)


@router.post("/weights/rollback")
async def rollback(body: RollbackBody, request: Request):
    check_swap(body.role, body.mode)
    serving = _serving(request)[body.role]
    parent = request.app.state.store.parent(body.role, serving)
    if parent is None:
        raise InvalidRequestError(f"{body.role} {serving} has no parent to roll back to")
    return await _swap(request, body.role, parent, body.mode)


async def _swap(request: Request, role: str, version: str, mode: str) -> dict:
    """The swap on this replica, then the deployment's `current` moves to it: every other replica follows."""
    state = request.app.state
    check_swap(role, mode)
    if state.swap_lock.locked():
        raise SwapInProgressError("another swap is loading; retry when it is done")
    async with state.swap_lock:
        result = await swap_to(state, role, version, mode, origin="admin")
        await asyncio.to_thread(state.versions.set, role, version, mode)
    return {"role": role, "version": version, "mode": mode, "load_ms": round(result.load_ms, 2),
            "swap_ms": round(result.swap_ms, 2), "serving": _serving(request)}


def _serving(request: Request) -> dict:
    return serving_versions(request.app.state.loop)
