"""Load balancing shared by the router (across servers) and data parallelism (across replicas in
one server): the policies choosing a worker and the approximate radix tree behind `cache_aware`.

Plain Python: neither the runtime nor the router's HTTP side is imported.
"""
