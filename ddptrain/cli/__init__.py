"""The ``ddptrain`` command: ``main`` (its subcommands), ``runs`` (listing and showing runs),
``dashboard`` and ``dashboard_server`` (the local web dashboard, ``dashboard.html``).
"""
