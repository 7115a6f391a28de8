"""Load tests against a live `specrl serve`, HTTP only (installed as `specrl.loadtest`): locust users,
a weight-swap driver, and the report that reads their logs.

    locust -f loadtest/locustfile.py ...             (in its own process: locust patches the network)
    python -m specrl.loadtest.swap_driver --url ... --token ...
"""
