import signal

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


@pytest.fixture(autouse=True, scope="session")
def ctrl_c_as_in_a_terminal():
    """Tests press Ctrl-C (SIGINT) in processes they start, and in this one, as a terminal does to a foreground job.
    A job started in the background by a shell (`make test &`, nohup) inherits SIGINT ignored, and so would every
    process it starts: give this process Python's own handler, which a child's exec turns into the default."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
