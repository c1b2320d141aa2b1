import pytest

from dist_pool import DistPool


@pytest.fixture(scope="session")
def dist2():
    """Two gloo ranks shared by every test of the session."""
    pool = DistPool(2)
    yield pool
    pool.stop()
