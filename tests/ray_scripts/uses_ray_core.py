import ray

ray.init()


@ray.remote
def square(x):
    return x * x


print(ray.get([square.remote(i) for i in range(4)]))
