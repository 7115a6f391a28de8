"""`specrl admin ...` against a live `specrl serve` (tiny-random, admin token): what the server answers
is printed; no token, a wrong one, a server that does not answer, a refused swap: one line, exit 1."""

import json
import os
import subprocess
import sys

import httpx
import pytest

from specrl.apps.launch import free_port
from specrl.models.drafter import EagleDrafter
from specrl.models.llama import load_llama
from specrl.weights import WeightsStore
from tests.backends import ADMIN_TOKEN, start_server


@pytest.fixture(scope="module")
def server(home, tiny_dir, tmp_path_factory):
    live = start_server(home, tmp_path_factory.mktemp("admin-cli"))
    yield live
    assert live.stop() == 0, live.log.read_text()[-3000:]


def admin(server_url: str, *args: str, token: str | None = ADMIN_TOKEN) -> subprocess.CompletedProcess:
    """`specrl admin <args> --server <url>`, the token from the environment as an operator would set it."""
    env = {k: v for k, v in os.environ.items() if k != "SPECRL_ADMIN_TOKEN"}
    if token is not None:
        env["SPECRL_ADMIN_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "specrl.apps.cli", "admin", *args, "--server", server_url],
                          capture_output=True, text=True, env=env, timeout=300)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("specrl: error: ")
    return line


def listing(server) -> dict:
    return httpx.get(server.url + "/admin/weights", headers=server.admin_headers(), timeout=30).json()


def test_weights_prints_the_versions_per_role(server):
    proc = admin(server.url, "weights")
    assert proc.returncode == 0, proc.stderr
    answer = listing(server)
    rows = {line.split()[0]: line.split() for line in proc.stdout.strip().splitlines()}
    assert set(rows) == {"drafter", "policy"}
    for role, row in rows.items():
        assert row[1:5] == ["serving", answer["serving"][role], "current", answer["current"][role] or "-"]
    proc = admin(server.url, "weights", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == listing(server)


def test_the_token_flag_overrides_the_environment(server):
    proc = admin(server.url, "weights", "--admin-token", ADMIN_TOKEN, token="stale")
    assert proc.returncode == 0, proc.stderr


def test_a_wrong_or_missing_token_is_one_line(server):
    assert "wrong admin token" in one_error_line(admin(server.url, "weights", token="nope"))
    assert "--admin-token" in one_error_line(admin(server.url, "weights", token=None))


def test_a_server_that_does_not_answer_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"  # free: nothing listens there
    assert f"no answer from {url}" in one_error_line(admin(url, "weights"))


def test_a_swap_to_an_unknown_version_carries_the_servers_message(server):
    line = one_error_line(admin(server.url, "swap", "--role", "drafter", "--version", "v999"))
    refusal = httpx.post(server.url + "/admin/weights", json={"role": "drafter", "version": "v999"},
                         headers=server.admin_headers(), timeout=60)
    assert refusal.status_code == 404 and refusal.json()["error"]["message"] in line and "v999" in line


def test_swap_then_rollback_print_the_servers_answer(server, tiny_dir, tmp_path):
    EagleDrafter.day0(load_llama(tiny_dir), seed=5).save(tmp_path)
    store = WeightsStore(server.store)
    v1 = store.publish("drafter", tmp_path).version
    v2 = store.publish("drafter", tmp_path, parent=v1).version
    proc = admin(server.url, "swap", "--role", "drafter", "--version", v2)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert (answer["role"], answer["version"], answer["serving"]["drafter"]) == ("drafter", v2, v2)
    proc = admin(server.url, "rollback", "--role", "drafter")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["serving"]["drafter"] == v1 == listing(server)["serving"]["drafter"]
    proc = admin(server.url, "weights")
    assert f"serving {v1}" in " ".join(proc.stdout.split()) and v2 in proc.stdout
