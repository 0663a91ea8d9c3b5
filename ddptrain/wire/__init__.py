"""What travels between the driver, the agents and the workers.

``protocol`` (every message a frozen dataclass), ``agent_events`` (what an agent tells the
driver about its workers), ``sealing`` and ``channel`` (the signed store channel; its driver end
is ``driver_channel``), ``boot`` (the version table and the agent's command line). The agent
reads these before it forks, so they stay light: no torch at import, no driver code.
"""
