"""Fixtures of the runtime tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (the CPU reference is many small ops: faster and steadier on a shared CPU)
    and denormals flushed (the decaying KDA state would hit the slow path); both restored afterwards. Use it as
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    yield
    torch.set_num_threads(threads)
    torch.set_flush_denormal(False)
