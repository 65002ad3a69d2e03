"""shmap/train/checkpoint.py: resume exactly on the same mesh, resume on another mesh, refuse a
checkpoint of another model."""
import shutil

import pytest

from shmap.train import checkpoint, loop
from shmap.train.config import ConfigError

from .tiny import tiny


def _losses(result):
    return {r["step"]: r["train_loss"] for r in result["history"] if "train_loss" in r}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An uninterrupted fsdp=4 run of 6 steps that checkpointed after step 3 and at the end."""
    d = tmp_path_factory.mktemp("ck")
    full = loop.train(tiny("fsdp=4", steps=6, checkpoint_dir=str(d / "c"), checkpoint_every=3), log=lambda *a: None)
    return d, _losses(full)


def _resume_from_step_3(d, mesh, tmp_path):
    ck = tmp_path / "c"
    shutil.copytree(d / "c" / "step_00000003", ck / "step_00000003")
    assert checkpoint.latest(ck).name == "step_00000003"
    return _losses(loop.train(tiny(mesh, steps=6, checkpoint_dir=str(ck), resume=True), log=lambda *a: None))


def test_a_resumed_run_continues_bitwise_on_the_same_mesh(saved, tmp_path):
    d, full = saved
    resumed = _resume_from_step_3(d, "fsdp=4", tmp_path)
    assert sorted(resumed) == [3, 4, 5]
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # float64, same mesh: bitwise


def test_a_checkpoint_saved_on_one_mesh_resumes_on_another(saved, tmp_path):
    d, full = saved
    resumed = _resume_from_step_3(d, "data=2,tensor=2", tmp_path)
    for s in (3, 4, 5):
        assert resumed[s] == pytest.approx(full[s], rel=1e-7)


def test_a_checkpoint_of_another_model_shape_is_refused(saved):
    d, _ = saved
    with pytest.raises(ConfigError, match=r"another model shape.*--embed-dim 32 \(this run: 64\)"):
        loop.train(tiny("fsdp=4", steps=6, embed_dim=64, checkpoint_dir=str(d / "c"), resume=True),
                   log=lambda *a: None)
    with pytest.raises(ConfigError, match="past --steps 2"):
        loop.train(tiny("fsdp=4", steps=2, checkpoint_dir=str(d / "c"), resume=True), log=lambda *a: None)


def test_resume_without_a_checkpoint_says_so(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint in --checkpoint-dir"):
        loop.train(tiny("none", checkpoint_dir=str(tmp_path), resume=True), log=lambda *a: None)
    missing = tmp_path / "nothere"  # (was made, then the run was refused: an empty directory left behind)
    with pytest.raises(ConfigError, match=r"--resume: --checkpoint-dir .*nothere does not exist"):
        loop.train(tiny("none", checkpoint_dir=str(missing), resume=True), log=lambda *a: None)
    assert not missing.exists()


def test_an_unfinished_save_is_never_taken_for_a_checkpoint(saved, tmp_path):
    d, _ = saved
    shutil.copytree(d / "c" / "step_00000003", tmp_path / "step_00000003")
    shutil.copytree(d / "c" / "step_00000006", tmp_path / "step_00000009.tmp")  # a save cut off midway
    assert checkpoint.latest(tmp_path).name == "step_00000003"


def test_an_unreadable_checkpoint_names_the_one_before_it(saved, tmp_path):
    d, _ = saved
    ck = tmp_path / "c"
    for name in ("step_00000003", "step_00000006"):
        shutil.copytree(d / "c" / name, ck / name)
    for f in (ck / "step_00000006").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:10])  # truncated
    with pytest.raises(ConfigError, match=r"step_00000006 cannot be read .*Fix: delete it to resume from the one "
                                          r"before, .*step_00000003"):
        loop.train(tiny("fsdp=4", steps=8, checkpoint_dir=str(ck), resume=True), log=lambda *a: None)
    (ck / "step_00000006" / "meta.json").write_text("{}")  # damaged metadata
    with pytest.raises(ConfigError, match=r"step_00000006 cannot be read \(KeyError"):
        loop.train(tiny("fsdp=4", steps=8, checkpoint_dir=str(ck), resume=True), log=lambda *a: None)


def test_only_step_numbers_count_as_checkpoints_newest_by_number(saved, tmp_path):
    d, _ = saved
    ck = tmp_path / "c"
    shutil.copytree(d / "c" / "step_00000003", ck / "step_00000003")
    shutil.copytree(d / "c" / "step_00000003", ck / "step_junk")   # not a step number
    (ck / "step_99").mkdir()                                          # no meta.json: not complete
    shutil.copytree(d / "c" / "step_00000003", ck / "step_10")       # numerically newer than 00000003
    assert checkpoint.latest(ck).name == "step_10"
    assert checkpoint.previous(ck / "step_10").name == "step_00000003"


def _lines(path):
    import json

    return [{k: v for k, v in json.loads(x).items() if k != "tokens_per_s"} for x in path.read_text().splitlines()]


def test_a_run_stopped_during_an_evaluation_resumes_with_that_evaluation(tmp_path):
    """Ctrl-C during the evaluation after step 4 saved the state after 4 steps but no val line for it; the
    resumed run evaluates there first, so its metrics.jsonl equals the uninterrupted run's."""
    straight = tmp_path / "straight"
    loop.train(tiny("data=2", steps=8, eval_every=4, out=str(straight)), log=lambda *a: None)
    ck, out = tmp_path / "c", tmp_path / "out"
    loop.train(tiny("data=2", steps=8, eval_every=4, out=str(out), checkpoint_dir=str(ck), checkpoint_every=4),
               log=lambda *a: None)
    shutil.rmtree(ck / "step_00000008")  # as the interrupted run left them: the state after 4 steps,
    lines = _lines(out / "metrics.jsonl")  # and steps 0-3's training lines, no evaluation of the state after 4
    (out / "metrics.jsonl").write_text("".join(
        __import__("json").dumps(r) + "\n" for r in lines if r["step"] < 4 and "train_loss" in r))
    loop.train(tiny("data=2", steps=8, eval_every=4, out=str(out), checkpoint_dir=str(ck), resume=True),
               log=lambda *a: None)
    assert _lines(out / "metrics.jsonl") == _lines(straight / "metrics.jsonl")


def test_resume_refuses_an_out_holding_another_runs_metrics(saved, tmp_path):
    """--resume into an --out another run wrote: refused, its metrics intact (it cut them down to the
    checkpoint's step and appended this run's)."""
    d, _ = saved
    other = tmp_path / "other"
    loop.train(tiny("fsdp=4", steps=6, seed=7, out=str(other)), log=lambda *a: None)
    before = (other / "metrics.jsonl").read_text()
    ck = tmp_path / "c"
    shutil.copytree(d / "c" / "step_00000003", ck / "step_00000003")
    with pytest.raises(ConfigError, match=r"--out: .*metrics.jsonl holds another run's metrics \(its step 2 trained "
                                          r"to loss .*, the resumed run's to .*\)"):
        loop.train(tiny("fsdp=4", steps=6, checkpoint_dir=str(ck), resume=True, out=str(other)), log=lambda *a: None)
    assert (other / "metrics.jsonl").read_text() == before


def test_resume_from_one_checkpoints_directory_names_the_runs(saved):
    d, _ = saved
    one = d / "c" / "step_00000003"
    with pytest.raises(ConfigError, match=rf"which is one checkpoint. Fix: --checkpoint-dir {d / 'c'} "):
        loop.train(tiny("fsdp=4", steps=6, checkpoint_dir=str(one), resume=True), log=lambda *a: None)


def test_a_checkpoint_without_its_metadata_is_one_message_without_dcps_tracebacks(saved, tmp_path, capsys):
    d, _ = saved
    ck = tmp_path / "c"
    shutil.copytree(d / "c" / "step_00000003", ck / "step_00000003")
    (ck / "step_00000003" / ".metadata").unlink()
    with pytest.raises(ConfigError, match=r"step_00000003 cannot be read \(.*No such file or directory: .*\.metadata"):
        loop.train(tiny("fsdp=4", steps=6, checkpoint_dir=str(ck), resume=True), log=lambda *a: None)
    assert "Traceback" not in capsys.readouterr().err  # (DCP logged two on the root logger)
