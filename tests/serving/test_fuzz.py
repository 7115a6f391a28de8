"""Bad input is never a 500: schemathesis generates requests for every route of a live server's own
/openapi.json (valid ones and invalid ones, boundary values first) and checks each answer.

Checks: no 5xx (`not_a_server_error`), and every answer is what the document states: its status documented, its
body of the documented schema and media type (`status_code_conformance`, `response_schema_conformance`,
`content_type_conformance`). So the OpenAPI document is the API that is enforced: a constraint validation has and
the document lacks shows up as a warning in the output, a status or body the document lacks as a failure.

The server is the native backend with the tiny model and a 128-token context, so that a generated request with no
max_tokens ends in well under a second; the admin token is sent, so the admin routes are explored past their 401.
Every body that names a model names the served one (tests/serving/fuzz_hooks.py).
"""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import pytest

from tests.backends import ADMIN_TOKEN, start_server

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ROOT = Path(__file__).parents[2]
CHECKS = "not_a_server_error,status_code_conformance,response_schema_conformance,content_type_conformance"
EXAMPLES_PER_ROUTE = 30  # under a minute on 2 cores
SEED = 60  # reproducible (the issue that asked for this test)


def test_no_generated_request_gets_a_server_error(home, tmp_path):
    server = start_server(home, tmp_path, env={"SPECRL_MAX_SEQ_LEN": "128"})
    junit = tmp_path / "fuzz.xml"
    try:
        document = httpx.get(server.url + "/openapi.json").json()
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.serving.fuzz_hooks", "SPECRL_FUZZ_MODEL": "tiny-random",
               "PYTHONPATH": str(ROOT)}
        run = subprocess.run(
            [str(Path(sys.executable).with_name("st")), "run", server.url + "/openapi.json", "--checks", CHECKS,
             "--max-examples", str(EXAMPLES_PER_ROUTE), "--seed", str(SEED), "--request-timeout", "60",
             "--generation-database", "none", "--no-color", "-H", f"Authorization: Bearer {ADMIN_TOKEN}",
             "--report-junit-path", str(junit)],
            env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)  # its cache and crash files there
    finally:
        server.stop()
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-8000:]
    cases = ET.parse(junit).getroot().iter("testcase")
    operations = {f"{method.upper()} {path}" for path, ops in document["paths"].items() for method in ops}
    assert {case.get("name") for case in cases} == operations, output[-3000:]  # every route was exercised
