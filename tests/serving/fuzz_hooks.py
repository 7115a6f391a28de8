"""Schemathesis hooks for tests/serving/test_fuzz.py (loaded by `st run` through SCHEMATHESIS_HOOKS).

Every generated body that names a model names the one served, so the generation routes' bodies are explored past
the 404 a random name gets (test_api covers that 404). `map_case` runs in both of schemathesis's phases, coverage
and fuzzing."""

import os

import schemathesis

MODEL = os.environ["SPECRL_FUZZ_MODEL"]
NAMED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@schemathesis.hook
def map_case(context, case):
    if context.operation.path in NAMED_ROUTES and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body = {**case.body, "model": MODEL}
    return case
