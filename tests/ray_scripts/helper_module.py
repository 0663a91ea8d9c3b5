# A module of the user's that the workers import themselves: it says `import ray.train` too.
import ray.train


def report_rank():
    ray.train.report({"rank": ray.train.get_context().get_world_rank()})
    return __import__("ray").__name__
