"""Test-wide set-up.

JAX (the differential oracle) must see 8 CPU devices; the flag has to be set
before jax is first imported, so it lives here.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_ENABLE_X64", "1")
