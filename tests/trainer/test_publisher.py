"""post_swap's retry rules against a real HTTP server that answers from a script: a swap already in
flight (409) is waited out, a refused checkpoint (other 4xx) is not retried."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specrl.trainer.publisher import post_swap


@pytest.fixture
def scripted_admin():
    """A server whose /admin/weights answers the queued (status, body) pairs in turn, recording each request."""
    answers, seen = [], []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            seen.append((self.path, self.headers["Authorization"],
                         json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            status, body = answers.pop(0)
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", answers, seen
    finally:
        server.shutdown()
        server.server_close()


def test_a_swap_in_flight_is_waited_out(scripted_admin):
    url, answers, seen = scripted_admin
    in_flight = {"error": {"type": "conflict_error", "message": "a drafter swap to v3 is in progress"}}
    answers += [(409, in_flight), (409, in_flight), (200, {"version": "v2", "load_ms": 5.0, "swap_ms": 1.0})]
    body = {"role": "policy", "version": "v2", "mode": "interrupt"}
    result, error = post_swap(url, "tok", body, retries=4, backoff_s=0.01)
    assert error is None and result["swap_ms"] == 1.0
    assert seen == [("/admin/weights", "Bearer tok", body)] * 3


def test_a_refused_checkpoint_is_not_retried_and_the_last_error_is_said(scripted_admin):
    url, answers, seen = scripted_admin
    answers += [(400, {"error": {"message": "hidden size 64 does not fit 576"}})]
    result, error = post_swap(url, "tok", {"role": "policy", "version": "v9"}, retries=4, backoff_s=0.01)
    assert result is None and error.startswith("HTTP 400") and "does not fit" in error
    assert len(seen) == 1

    answers += [(409, {"error": {"message": "in progress"}})] * 2
    result, error = post_swap(url, "tok", {"role": "policy", "version": "v9"}, retries=2, backoff_s=0.01)
    assert result is None and error.startswith("HTTP 409") and len(seen) == 3
