"""Pure scheduling state, no I/O: requests, the block pool, the KV cache manager, the scheduler.

Everything here is deterministic and synchronous, so it is tested without sockets or processes;
``check_integrity()`` of the pool and the manager runs in every scheduler test.
"""
