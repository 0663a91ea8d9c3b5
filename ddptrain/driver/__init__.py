"""The driver: the process that called ``fit()``.

``controller`` runs attempts until one succeeds or the failure budget is spent, and takes every
decision; ``attempt`` runs one worker group and returns ``Succeeded`` or ``Failed``; ``plan``
places ranks on hosts; ``worker_group`` starts the group through a launcher and is polled for
what happened (``group_events``); ``run`` holds the run's state and storage;
``local_run`` is local mode (``ScalingConfig(num_workers=0)``: the function runs in this
process); ``warm`` hands groups from one fit to the next; ``watchdog`` warns about stalls;
``progress`` and ``logs`` are the console and the per-rank log files.
"""
