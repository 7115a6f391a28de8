"""Load tests against a live `specrl serve`: locust users, a weight-swap driver, and the report that reads their logs.

Run from a source checkout (not installed): `locust -f loadtest/locustfile.py`, `python loadtest/swap_driver.py`.
"""
