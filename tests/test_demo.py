"""The main job (`make demo`) runs and reports what the seed examples promise."""
from shmap import demo


def test_demo_prints_devices_results_and_communication(capsys):
    demo.main()
    out = capsys.readouterr().out
    assert "device (i=3, j=1)" in out  # per-device blocks are shown
    assert "matmul_basic: c.shape = (8, 32), equals a @ b: True" in out
    assert "matmul_reduce_scatter: equals a @ b: True" in out
    assert "f5: psum over ('i', 'j'), out_specs=P() -> shape (3, 6)" in out
    assert "backward communication: CommLog({'psum': 1}" in out
