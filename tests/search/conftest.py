"""Fixtures shared by the search tests."""
import pytest


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 2 CPUs for one test module, shut down by its own handle."""
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=True,
             logging_level="ERROR")
    try:
        yield ray
    finally:
        ray.shutdown()
