"""Shared fixtures for the kernel tests.

One pool of 4 shared-memory workers serves every shm test of a pytest
process (starting workers costs seconds: each imports torch); tests run
kernels on its first 2, 3 or 4 devices.
"""
import pytest
import torch

from shmap.kernels import ShmGroup


@pytest.fixture(scope="session")
def shm_group():
    group = ShmGroup(4, capacity=16 << 20, timeout=20.0)
    yield group
    group.close()


@pytest.fixture
def float32_default():
    """Messages quote byte counts, so pin the default dtype (other test modules change it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(before)
