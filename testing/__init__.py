"""Support shared by the tests and the benchmarks: fakes, drivers, simulators, references.

Nothing in the services imports it (tests/test_layout.py checks).
"""
