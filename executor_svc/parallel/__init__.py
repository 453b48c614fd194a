"""Tensor parallelism: one model served across N ranks as one executor.

See docs/ARCHITECTURE.md, "Tensor parallelism". Modules: ``shard`` (who holds what), ``group``
(start-up, store, collectives, fatal exits), ``launch`` (starting local ranks), ``watchdog`` (each
rank watching the others), ``channel`` (plans to the followers, no pickle), ``runner`` (the leader
and follower runners), ``serve`` (a rank process from start to exit).
"""
