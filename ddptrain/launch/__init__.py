"""How a host's agent is started and reached.

``hosts`` parses host files and probes GPUs; ``launcher`` starts the local agent and fans out
over hosts; ``ssh_connect`` logs in to a host, ``ssh`` runs its agent over that connection,
``ssh_files`` stages and copies back files for hosts that do not share the run folder;
``agent_session`` is the driver's side of one agent's stdio; ``host_scripts`` holds the small
programs run on a host before the agent; ``known_hosts`` checks host keys.
"""
