"""The agent process: one per host, started by a launcher (``python -m ddptrain.agent.main``).

It imports torch once, forks one worker per rank (``main``), watches them through /proc
(``process``), keeps evidence of memory kills (``memory``) and relays their output and exits to
the driver (``relay``). It imports ``wire`` and the worker's entry point, never the driver.
"""
