"""A program that trains with ddptrain (started by `host_lists.py`): the hosts its trainers use."""

import ddptrain as train
from ddptrain.driver.plan import Plan


def trainer_hosts():
    """Where a trainer with `ScalingConfig(num_workers=4)` and no `hosts` would run its workers."""
    placement = Plan(train.ScalingConfig(num_workers=4)).placement
    return "this machine" if placement is None else [host.name for host in placement.hosts]


if __name__ == "__main__":
    print("other program's trainers:", trainer_hosts(), flush=True)
