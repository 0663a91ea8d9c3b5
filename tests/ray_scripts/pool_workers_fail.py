"""A spawn Pool whose workers cannot import this script: it must fail, not hang."""

import multiprocessing

import ray.train  # noqa: F401

if __name__ != "__main__":  # only the Pool's workers (they import this script as `__mp_main__`)
    import module_only_the_children_miss  # noqa: F401


def square(x):
    return x * x


if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        print(pool.map(square, range(4)))
