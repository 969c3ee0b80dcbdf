import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from p2ptrain import checkpoint
from p2ptrain.identity import load_or_create
from p2ptrain.params import ParamSpace


def make_snapshot(space, params, step, fingerprint="fp1", term=0):
    return checkpoint.Snapshot(
        step=step, term=term, swarm_count={"n1": step * 10}, fingerprint=fingerprint,
        arch={"model": "test"},
        model_tensors=[(s.name, space.view(params, s.name)) for s in space],
        state_tensors=[("adam.m", params * 2)], state_meta={"step": step})


@pytest.fixture
def setup(tmp_path):
    space = ParamSpace([("a.w", (40, 30)), ("a.b", (30,)), ("z", (3, 1, 5))])
    params = np.random.default_rng(0).normal(size=space.size).astype(np.float32)
    ident = load_or_create(tmp_path / "state")
    return space, params, ident, tmp_path / "state" / "checkpoints"


def test_roundtrip_and_the_safetensors_library_reads_the_weights(setup):
    space, params, ident, root = setup
    path = checkpoint.save(root, make_snapshot(space, params, 5), ident, keep=3)
    found = checkpoint.find_latest(root, "fp1")
    assert found.path == path and found.skipped == [] and found.manifest.step == 5
    assert found.manifest.leader == ident.node_id and found.manifest.swarm_samples == 50
    lib = load_file(str(path / checkpoint.MODEL_FILE))
    for s in space:
        np.testing.assert_array_equal(lib[s.name], space.view(params, s.name))
    out = space.zeros()
    checkpoint.load_tensors(path, checkpoint.MODEL_FILE, space.views(out))
    for s in space:  # (padding between tensors is not part of the model)
        np.testing.assert_array_equal(space.view(out, s.name), space.view(params, s.name))
    m = space.zeros()
    meta = checkpoint.load_tensors(path, checkpoint.STATE_FILE, {"adam.m": m})
    np.testing.assert_array_equal(m, params * 2)
    assert checkpoint.state_meta(meta) == {"step": 5}


def test_keeps_the_newest_k(setup):
    space, params, ident, root = setup
    for step in range(1, 6):
        checkpoint.save(root, make_snapshot(space, params, step), ident, keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(root)] == [
        "ckpt-t000000-s0000000005", "ckpt-t000000-s0000000004"]


def corrupt_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,reason", [
    (lambda p: corrupt_byte(p / checkpoint.MODEL_FILE, -3), "does not match its hash"),
    (lambda p: (p / checkpoint.MODEL_FILE).write_bytes(
        (p / checkpoint.MODEL_FILE).read_bytes()[:1000]), "truncated"),
    (lambda p: (p / checkpoint.STATE_FILE).unlink(), "cannot be read"),
    (lambda p: (p / "manifest.json").unlink(), "no manifest"),
    (lambda p: (p / "manifest.json").write_text("{"), "manifest is not JSON"),
    (lambda p: (p / "manifest.json").write_text(
        json.dumps({**json.loads((p / "manifest.json").read_text()), "step": 99})),
     "signature does not verify"),
])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_good_one(setup, damage, reason):
    space, params, ident, root = setup
    good = checkpoint.save(root, make_snapshot(space, params, 1), ident, keep=3)
    bad = checkpoint.save(root, make_snapshot(space, params + 1, 2), ident, keep=3)
    damage(bad)
    found = checkpoint.find_latest(root, "fp1")
    assert found.path == good
    assert len(found.skipped) == 1 and reason in found.skipped[0]


def test_another_models_checkpoint_is_an_error(setup):
    space, params, ident, root = setup
    checkpoint.save(root, make_snapshot(space, params, 1, fingerprint="other"), ident, keep=3)
    with pytest.raises(checkpoint.CheckpointMismatch, match="another model"):
        checkpoint.find_latest(root, "fp1")
    arch = checkpoint.read_manifest(checkpoint.list_checkpoints(root)[0]).arch
    with pytest.raises(checkpoint.CheckpointMismatch, match="another tokenizer"):
        checkpoint.find_latest(root, "fp1", arch)  # the same shape: the data's ids differ
    with pytest.raises(checkpoint.CheckpointMismatch, match="another model"):
        checkpoint.find_latest(root, "fp1", {**arch, "n": -1})


def test_loading_refuses_a_shape_mismatch_before_writing(setup):
    space, params, ident, root = setup
    path = checkpoint.save(root, make_snapshot(space, params, 1), ident, keep=3)
    other = ParamSpace([("a.w", (30, 40)), ("a.b", (30,)), ("z", (3, 1, 5))])
    out = other.zeros()
    with pytest.raises(checkpoint.CheckpointError, match="expected"):
        checkpoint.load_tensors(path, checkpoint.MODEL_FILE, other.views(out))
    assert not out.any()


def test_a_header_shape_whose_size_overflows_int64_is_refused(setup):
    """numpy's int64 product wraps ([2**62, 4] -> 0 bytes) or raises OverflowError past the
    readers' except clauses (a joiner's fetch task died, the join stuck in FETCHING)."""
    import struct

    space, params, ident, root = setup
    path = checkpoint.save(root, make_snapshot(space, params, 1), ident, keep=3)
    for shape in ([2**62, 4], [2**64]):
        hdr = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
        (path / checkpoint.MODEL_FILE).write_bytes(struct.pack("<Q", len(hdr)) + hdr.encode())
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.load_tensors(path, checkpoint.MODEL_FILE, space.views(space.zeros()))


def test_a_header_of_the_wrong_types_or_too_deep_is_refused_not_a_traceback(setup):
    """A dtype that is a list or an object raised TypeError (unhashable) and a deeply nested
    header RecursionError, past every reader's except clause (review)."""
    import struct

    space, params, ident, root = setup
    path = checkpoint.save(root, make_snapshot(space, params, 1), ident, keep=3)
    for hdr in (json.dumps({"w": {"dtype": [], "shape": [1], "data_offsets": [0, 4]}}),
                json.dumps({"w": {"dtype": {}, "shape": [1], "data_offsets": [0, 4]}}),
                "[" * 100_000 + "]" * 100_000):
        (path / checkpoint.MODEL_FILE).write_bytes(struct.pack("<Q", len(hdr)) + hdr.encode())
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.load_tensors(path, checkpoint.MODEL_FILE, space.views(space.zeros()))


def test_pruning_keeps_the_checkpoint_just_written_below_a_damaged_newer_one(setup):
    space, params, ident, root = setup
    checkpoint.save(root, make_snapshot(space, params, 100), ident, keep=3)
    bad = checkpoint.save(root, make_snapshot(space, params, 200), ident, keep=3)
    model = bad / checkpoint.MODEL_FILE
    model.write_bytes(model.read_bytes()[:50])  # a bad disk
    found = checkpoint.find_latest(root, "fp1")
    assert found.path.name.endswith("s0000000100") and found.skipped
    written = checkpoint.save(root, make_snapshot(space, params, 150), ident, keep=1)
    assert written.exists()
    assert checkpoint.find_latest(root, "fp1").path == written


def test_a_crash_while_one_checkpoint_replaces_another_of_its_name_loses_neither(
        setup, monkeypatch):
    """The same (term, step) saved again: the old one is set aside, not deleted, until the
    new one is in place; a crash in between leaves it to be put back at the next start."""
    import os

    space, params, ident, root = setup
    first = checkpoint.save(root, make_snapshot(space, params, 4), ident, keep=1)
    real_rename = os.rename

    def crash_on_second(src, dst):
        if str(src).rpartition("/")[2].startswith(".tmp-ckpt-"):
            raise KeyboardInterrupt  # the process dies before the new one is in place
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(root, make_snapshot(space, params, 4), ident, keep=1)
    monkeypatch.setattr(os, "rename", real_rename)
    assert not first.exists()  # set aside
    stale = checkpoint.stale_temporaries(root)  # what the next start does first
    assert first.exists() and not any(p.name.startswith(".old-") for p in stale)
    assert checkpoint.find_latest(root, "fp1").path == first


def test_a_checkpoint_a_fetch_set_aside_before_a_crash_is_put_back_too(setup):
    """`checkpoint fetch --out <state>/checkpoints` replacing a checkpoint of the same id sets
    the old one aside as .old-<name>-<pid>; a crash before the new one took its place left
    that name, which the next start took for a stale temporary and deleted."""
    import os

    space, params, ident, root = setup
    first = checkpoint.save(root, make_snapshot(space, params, 4), ident, keep=1)
    aside = root / f"{checkpoint.store.OLD_PREFIX}{first.name}-{os.getpid()}"
    os.rename(first, aside)
    assert checkpoint.stale_temporaries(root) == [] and first.exists()
    assert checkpoint.find_latest(root, "fp1").path == first


def test_checkpoint_fetch_says_how_far_the_fetched_checkpoint_trained(setup):
    """`checkpoint fetch` names the step and samples it got, and warns when that is nothing:
    a leader's first checkpoint can be of the starting weights."""
    from p2ptrain.cli.swarmcmds import describe_fetched

    space, params, ident, root = setup
    fresh = checkpoint.read_manifest(checkpoint.save(root, make_snapshot(space, params, 0),
                                                     ident, keep=3))
    trained = checkpoint.read_manifest(checkpoint.save(root, make_snapshot(space, params, 300),
                                                       ident, keep=3))
    said = describe_fetched(fresh)
    assert said[0].startswith("checkpoint at step 0: 0 samples")
    assert len(said) == 2 and said[1].startswith("warning:") and "nothing trained" in said[1]
    said = describe_fetched(trained)
    assert said == [f"checkpoint at step 300: 3.0k samples trained by the swarm (leader "
                    f"{ident.node_id[:12]}, term 0)"]
