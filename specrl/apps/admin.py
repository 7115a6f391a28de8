"""`specrl admin ...`: a thin HTTP client of a running server's admin API (serving/admin_api.py):
which weights serve and which are stored, swap a stored version in, roll back to its parent.

It sends what it is given and prints what the server answers; the server checks the role, the
version and the mode, and its refusal is the one-line error. HTTP only, as an operator's curl.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import urllib.error
import urllib.request

from specrl.apps.flags import add_settings, settings_from
from specrl.config import Settings
from specrl.engine.swap import MODES
from specrl.errors import SpecrlError
from specrl.weights.store import ROLES

# A swap answers once the new weights are loaded, checked and applied at a step boundary.
TIMEOUT_S = 300.0
# the URL a `specrl serve` with the default --host and --port answers at
DEFAULT_SERVER = "http://{host}:{port}".format(**{f.name: f.default for f in dataclasses.fields(Settings)})
STORED_SHOWN = 8  # `admin weights` lists the newest this many stored versions of a role


def register(sub) -> None:
    admin = sub.add_parser("admin", help="a running server's weights: list, swap, roll back")
    actions = admin.add_subparsers(title="admin commands")

    weights = actions.add_parser("weights", help="the versions serving, current in the store, and stored, per role")
    weights.add_argument("--json", action="store_true", help="print the server's whole answer (manifests included)")
    weights.set_defaults(run=list_weights)

    swap = actions.add_parser("swap", help="serve a stored version (POST /admin/weights)")
    swap.add_argument("--role", required=True, choices=ROLES, help="the weights to swap")
    swap.add_argument("--version", required=True, help="a version of the server's weights store")
    swap.set_defaults(run=swap_weights)

    rollback = actions.add_parser("rollback", help="serve the parent of the serving version (POST "
                                                   "/admin/weights/rollback)")
    rollback.add_argument("--role", required=True, choices=ROLES, help="the weights to roll back")
    rollback.set_defaults(run=roll_back)

    for p in (swap, rollback):
        p.add_argument("--mode", choices=MODES, default=None,
                       help="policy swaps: drain (the server's default: running requests finish on the old "
                            "weights) or interrupt (they move to the new ones now)")
    for p in (weights, swap, rollback):
        p.add_argument("--server", metavar="URL", default=None,
                       help=f"the server (default: http://<host>:<port> of the settings, env SPECRL_HOST and "
                            f"SPECRL_PORT; unset: {DEFAULT_SERVER})")
        add_settings(p, "admin_token")


def list_weights(args: argparse.Namespace) -> int:
    answer = request(args, "GET", "/admin/weights")
    print(json.dumps(answer, indent=2) if args.json else versions_table(answer))
    return 0


def swap_weights(args: argparse.Namespace) -> int:
    body = {"role": args.role, "version": args.version, **({"mode": args.mode} if args.mode else {})}
    print(json.dumps(request(args, "POST", "/admin/weights", body), indent=2))
    return 0


def roll_back(args: argparse.Namespace) -> int:
    body = {"role": args.role, **({"mode": args.mode} if args.mode else {})}
    print(json.dumps(request(args, "POST", "/admin/weights/rollback", body), indent=2))
    return 0


def versions_table(answer: dict) -> str:
    """GET /admin/weights' answer -> one line per role: serving, the store's current, the newest stored."""
    lines = []
    for role in ROLES:
        stored = [manifest["version"] for manifest in answer["stored"].get(role, [])]
        newest = " ".join(stored[-STORED_SHOWN:]) or "-"
        older = f" (and {len(stored) - STORED_SHOWN} older)" if len(stored) > STORED_SHOWN else ""
        lines.append(f"{role:<8} serving {answer['serving'].get(role) or '-':<12} "
                     f"current {answer['current'].get(role) or '-':<12} stored {newest}{older}")
    return "\n".join(lines)


def request(args: argparse.Namespace, method: str, path: str, body: dict | None = None) -> dict:
    """One admin API call -> the server's JSON answer. SpecrlError (one line) when there is no token,
    the server does not answer, or it refuses (its own message)."""
    settings = settings_from(args)
    server = (args.server or f"http://{settings.host}:{settings.port}").rstrip("/")
    if not settings.admin_token:
        raise SpecrlError("no admin token: pass --admin-token or set SPECRL_ADMIN_TOKEN (the server's token)")
    if not server.startswith(("http://", "https://")):
        raise SpecrlError(f"--server must be an http:// or https:// URL, got {server!r}")
    call = urllib.request.Request(server + path, method=method,
                                  data=None if body is None else json.dumps(body).encode(),
                                  headers={"Authorization": f"Bearer {settings.admin_token}",
                                           "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(call, timeout=TIMEOUT_S) as resp:
            text = resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:  # before URLError: its subclass
        raise SpecrlError(f"{server} refused {method} {path}: {_server_message(exc)} (HTTP {exc.code})") from None
    # refused, timed out, unresolvable, not speaking HTTP, a malformed URL
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        raise SpecrlError(f"no answer from {server}: {_one_line(getattr(exc, 'reason', exc))} "
                          "(is `specrl serve` running there?)") from None
    try:
        return json.loads(text)
    except ValueError:
        raise SpecrlError(f"{server}{path} answered something other than JSON: {_one_line(text)!r}") from None


def _server_message(exc: urllib.error.HTTPError) -> str:
    """The message of an OpenAI-shaped error body ({"error": {"message": ...}}), else the body itself."""
    text = exc.read().decode(errors="replace")
    try:
        return _one_line(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return _one_line(text) or exc.reason


def _one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]
