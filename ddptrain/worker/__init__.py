"""The worker process: forked by its host's agent, one per rank.

``main`` joins the run's store, builds the rank's session (``ddptrain.context``), runs the
training function when the driver says so and reports how it ended.
"""
