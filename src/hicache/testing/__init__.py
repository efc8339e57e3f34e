"""Programs that tests and benchmarks start beside hicache: never part of serving.

The stores' servers (Redis/Valkey, LMCache's server, the Mooncake master) and
``hicache serve`` itself run here as child processes on loopback, each through
the one launcher in ``launcher.py`` (``cpu_limit.py`` pins one to a few cores for
a benchmark). One tool works in process instead: ``throttled_io.py`` holds a built
engine's host->device loads to a chosen latency and bandwidth. Nothing that
``hicache serve`` or ``hicache router`` imports may import this package
(tests/e2e/test_import_graph.py).
"""
