"""An engine core: admission, placement on executors, the executor link and the fronts' link.

It drives one scheduler (``scheduler_svc/sched/``) per executor, sends each its plans, and hands
every step's token updates to the fronts that own the requests. It never imports the fronts.
"""
