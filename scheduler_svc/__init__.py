"""The scheduler service (CPU only): fronts (public APIs), engine cores (scheduling), and how they start.

Its processes check for the scheduler extra where they start (``entrypoints/``); the scheduling
state and the contracts load without it, so the executor's tools and tests may use them.
"""
