"""The serving fixtures (`backend`, `live`, `bare`, `servers`) are in tests/conftest.py, the live-server
helpers in tests/backends.py; re-exported here for the tests that import them from this path."""

from tests.backends import ADMIN_TOKEN, REDIS_URL, LiveServer, start_server  # noqa: F401
