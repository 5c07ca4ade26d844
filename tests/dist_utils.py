"""The tests' name for tonp_parallel.launch (run_distributed: N spawned gloo ranks, free port,
timeout, fail fast)."""
from tonp_parallel.launch import DistributedError, free_port, run_distributed

__all__ = ["DistributedError", "free_port", "run_distributed"]
