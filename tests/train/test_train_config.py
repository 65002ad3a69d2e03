"""shmap/train/config.py: the command line and the checks that refuse a run before it starts."""
import re

import pytest
import torch

from shmap.train import config
from shmap.train.config import ConfigError, parse_args, parse_mesh

from .tiny import TINY_FLAGS, tiny


def test_mesh_flag_is_parsed_in_mesh_order():
    assert parse_mesh("tensor=4,fsdp=2") == {"fsdp": 2, "tensor": 4}
    assert parse_mesh("none") is None
    assert parse_mesh(" data=2 , fsdp=2 ,tensor=2") == {"data": 2, "fsdp": 2, "tensor": 2}


@pytest.mark.parametrize("text, words", [
    ("model=2", ["unknown axis 'model'", "data, fsdp, tensor"]),
    ("fsdp", ["is not AXIS=N"]),
    ("fsdp=x", ["is not AXIS=N"]),
    ("fsdp=2,fsdp=2", ["given twice"]),
    ("fsdp=0", ["sizes must be >= 1"]),
    ("", ["no axes"]),
    ("fsdp=2,,tensor=2", ["an empty entry"]),  # (were dropped silently)
    ("data=2,", ["an empty entry"]),
    ("data=\u0662", ["is not AXIS=N"]),  # (an Arabic-Indic digit, which int() reads as 2)
])
def test_bad_mesh_flags_name_the_flag_and_the_fix(text, words):
    with pytest.raises(ConfigError) as e:
        parse_mesh(text)
    assert "--mesh" in str(e.value)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize("mesh, kw, words", [
    # (a suggested head count divides --embed-dim too: --heads 6 would not divide 32, the next error)
    ("tensor=3", dict(heads=4, mlp_dim=66), ["--heads 4 is not divisible by tensor = 3", "Fix: a tensor size "
                                             "dividing 4"]),
    ("tensor=3", dict(heads=4, mlp_dim=66, embed_dim=48), ["Fix: --heads 3 (it divides --embed-dim 48)"]),
    ("fsdp=2", dict(heads=3, embed_dim=33), ["--embed-dim 33 is not divisible by fsdp = 2", "Fix: --embed-dim 36,"]),
    ("fsdp=3", dict(batch_size=9, embed_dim=36, mlp_dim=66), ["the vocabulary size 256 (bytes) is not divisible by "
                                                              "fsdp = 3", "Fix: an fsdp size dividing 256, e.g. fsdp=2"]),
    ("tensor=4", dict(mlp_dim=66), ["--mlp-dim 66 is not divisible by tensor = 4", "Fix: --mlp-dim 68"]),
    ("data=3", dict(), ["--batch-size 8 is not divisible by data*fsdp = 3", "Fix: --batch-size 9"]),
    ("fsdp=3", dict(batch_size=9), ["--embed-dim 32 is not divisible by fsdp = 3"]),
    ("none", dict(embed_dim=30), ["--embed-dim 30 is not divisible by --heads 4"]),
])
def test_a_mesh_that_does_not_divide_the_model_is_refused(mesh, kw, words):
    with pytest.raises(ConfigError) as e:
        tiny(mesh, **kw)
    for w in words:
        assert w in str(e.value)


def test_the_command_line_exits_with_the_message(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--mesh", "pipeline=2"])
    assert e.value.code == 2
    assert "unknown axis 'pipeline'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--resume"])
    assert "--resume needs --checkpoint-dir" in capsys.readouterr().err


def test_the_command_line_maps_onto_the_config():
    cfg = parse_args(TINY_FLAGS + ["--mesh", "fsdp=2", "--steps", "7", "--lr", "0.01", "--block", "cookbook",
                                   "--out", "x", "--checkpoint-dir", "c", "--checkpoint-every", "3", "--resume"])
    assert cfg.mesh == {"fsdp": 2} and cfg.steps == 7 and cfg.lr == 0.01 and cfg.block == "cookbook"
    assert cfg.head_dim == 8 and cfg.progress is False and cfg.resume and cfg.checkpoint_every == 3
    assert config.Config().mesh == {"fsdp": 2, "tensor": 4}  # the default: the mesh `make train` shows


@pytest.mark.parametrize("kw, words", [
    (dict(lr=float("inf")), "--lr inf: must be a finite number > 0"),
    (dict(clip=-1.0), "--clip -1.0: must be a finite number >= 0"),
    (dict(clip=float("nan")), "--clip nan"),
    (dict(eval_batches=0), "--eval-batches 0: must be >= 1"),
    (dict(sample_len=-5), "--sample-len -5: must be >= 0"),
    (dict(checkpoint_every=2), "--checkpoint-every 2 needs --checkpoint-dir"),
    # (an Adam step past float32's range overflowed in torch.optim's arithmetic, with torch's message)
    (dict(lr=1e39, dtype="float32"),
     "--lr 1e+39: Adam's first step moves each parameter by up to lr / (1 - beta1) = 1e+40, more than the largest "
     "float32"),
    (dict(lr=1e39, dtype="bfloat16"), "the parameters are float32). Fix: a learning rate such as 0.003"),
    # (a seed past ~1.8e13 overflowed in the data order's generator, with a raw ValueError)
    (dict(seed=9223372036854775807), "--seed 9223372036854775807: must be in [0, 2**32)"),
    (dict(seed=-1), "--seed -1: must be in [0, 2**32)"),
])
def test_numbers_the_run_cannot_use_are_refused_naming_the_flag(kw, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        tiny("none", **kw)


def test_only_rank_0_prints_a_bad_command_line_under_torchrun(capsys, monkeypatch):
    """Every rank parses the same command line: the others exit with the same status, silently."""
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        parse_args(["--mesh", "pipeline=2"])
    assert e.value.code == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        parse_args(["--mesh", "pipeline=2"])
    assert "unknown axis 'pipeline'" in capsys.readouterr().err
    assert tiny("none", lr=1e39, dtype="float64").lr == 1e39  # (float64 parameters hold that step)


@pytest.mark.parametrize("device, words", [
    ("gpu0", "--device gpu0: not a torch device this machine can use (Invalid device string: 'gpu0')"),
    ("meta", "--device meta: not a torch device this machine can use (the meta device holds no values)"),
] + ([] if torch.cuda.is_available() else [
    ("cuda", "--device cuda: not a torch device this machine can use (")]))  # (torch's reason varies by build)
def test_a_device_this_machine_lacks_is_refused_naming_the_flag(device, words):
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        tiny("fsdp=2,tensor=4", device=device)
    assert "Fix: --device cpu" in str(e.value)
    assert parse_args(TINY_FLAGS + ["--device", "cpu"]).device == "cpu" == config.Config().device


def test_device_is_refused_under_torchrun(monkeypatch):
    """--device places a simulated mesh on one accelerator; torchrun's processes are gloo CPU ones."""
    from shmap.train.loop import _init_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = tiny("data=2").replace(device="cuda")  # (set past validation: no GPU needed for this check)
    with pytest.raises(ConfigError, match=re.escape("--device cuda: under torchrun the 2 processes run gloo on the "
                                                    "CPU")):
        _init_distributed(cfg)


def test_validation_batches_that_cannot_fit_are_refused_before_training():
    """--eval-batches 1e9 built its batches for minutes before any output (it looked like a hang)."""
    with pytest.raises(ConfigError, match=r"--eval-batches 1000000000: the validation batches .* would take "
                                          r"[0-9.]+ GiB, more than half of this machine's"):
        tiny("none", eval_batches=10**9)
    tiny("none", eval_batches=1000)  # (a large but possible count is fine)
