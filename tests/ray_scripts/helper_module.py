# A module of the user's that the workers import themselves: it says `import ray.train` too.
import ray.train


def report_rank():
    ray.train.report({"rank": ray.train.get_context().get_world_rank()})
    return __import__("ray").__name__


def ray_train_name(_: object = None) -> str:
    """What `ray.train` is in the process that calls it (a multiprocessing child, say)."""
    return ray.train.__name__


class Numbers:
    """A map-style dataset of a module that says `import ray.train`: a DataLoader's spawned
    workers import this module to unpickle it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[str | int]:
        return [ray.train.__name__, i]
