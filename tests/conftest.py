import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    """Tests that train in the pytest process use one thread, as each gloo rank does: tiny models gain
    nothing from more, and spinning threads only steal the cores other ranks need."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
