"""Resuming from checkpoints that verify (hashes, the signature) but hold what must not be
loaded -- as a leader holding the swarm key can sign one into `checkpoint fetch --out
<state>/checkpoints` -- and JSON numbers that Python's json refuses with a bare ValueError."""

from __future__ import annotations

import io
import json
import shutil
import struct

import numpy as np
import pytest

from p2ptrain import checkpoint
from p2ptrain.checkpoint.safetensors_io import SafetensorsError, read_header
from p2ptrain.checkpoint.store import STATE_META_KEY
from p2ptrain.identity import load_or_create
from tests.helpers import run_cli

pytestmark = [pytest.mark.processes]

BIG = "1" + "0" * 5000  # more digits than Python's int parser takes (4,300)


def test_a_number_of_5000_digits_in_a_header_or_the_resume_data_is_their_own_error():
    """json raised a plain ValueError (not JSONDecodeError): a traceback from `sample`,
    `join` resuming, --init-from and the join-time judge of a fetched checkpoint."""
    text = ('{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"x":' + BIG + "}").encode()
    text += b" " * (-len(text) % 8)
    with pytest.raises(SafetensorsError, match="not JSON"):
        read_header(io.BytesIO(struct.pack("<Q", len(text)) + text + b"\0" * 4))
    with pytest.raises(checkpoint.CheckpointError, match="no resume data"):
        checkpoint.state_meta({STATE_META_KEY: '{"step": ' + BIG + "}"})


def _trained(tmp_path):
    state, conf = tmp_path / "s", tmp_path / "c.toml"
    conf.write_text("[checkpoint]\nevery_steps = 5\n")
    common = ("join", "--alone", "--batch", "4", "--config", str(conf), "--state-dir",
              str(state))
    r = run_cli(*common, "--steps", "10")
    assert r.returncode == 0, r.stderr
    return state, common


def _signed_copy(state, step: int, damage: str) -> str:
    """A checkpoint of step `step`, a copy of the newest with `damage`, signed by the node."""
    root = state / "checkpoints"
    good = checkpoint.find_latest(root, checkpoint.read_manifest(
        checkpoint.list_checkpoints(root)[0]).fingerprint)
    m = good.manifest
    model = dict(_tensors(good.path / checkpoint.MODEL_FILE))
    st = dict(_tensors(good.path / checkpoint.STATE_FILE))
    meta = checkpoint.state_meta(checkpoint.load_tensors(good.path, checkpoint.STATE_FILE, {}))
    if damage == "nan_weights":
        name = next(iter(model))
        model[name] = model[name].copy()
        model[name].flat[0] = np.nan
    else:  # the resume data's step: json writes float("inf") as Infinity, int() overflows
        meta["step"] = float("inf")
    snap = checkpoint.Snapshot(step=step, term=m.term, swarm_count=dict(m.swarm_count),
                               fingerprint=m.fingerprint, arch=dict(m.arch),
                               model_tensors=list(model.items()),
                               state_tensors=list(st.items()), state_meta=meta)
    return checkpoint.save(root, snap, load_or_create(state), keep=10).name


def _tensors(path):
    from safetensors.numpy import load_file

    return load_file(str(path)).items()


@pytest.mark.parametrize("damage", ["nan_weights", "infinite_step"])
def test_resume_passes_over_a_signed_checkpoint_that_does_not_load(tmp_path, damage):
    """It stopped with 'cannot resume' (non-finite weights) or a traceback (OverflowError:
    an infinite step), older good checkpoints beside it."""
    state, common = _trained(tmp_path)
    bad = _signed_copy(state, 11, damage)
    r = run_cli(*common, "--steps", "12")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert f"skipping checkpoint: {bad}" in r.stderr, r.stderr
    assert "resumed from ckpt-t000000-s0000000010" in r.stdout, r.stdout


def test_when_no_checkpoint_loads_the_start_says_so_rather_than_start_over(tmp_path):
    state, common = _trained(tmp_path)
    for path in checkpoint.list_checkpoints(state / "checkpoints"):
        data = checkpoint.state_meta(checkpoint.load_tensors(path, checkpoint.STATE_FILE, {}))
        assert data["step"] in (5, 10)
    bad = _signed_copy(state, 11, "nan_weights")
    for path in checkpoint.list_checkpoints(state / "checkpoints"):
        if path.name != bad:
            shutil.rmtree(path)
    r = run_cli(*common, "--steps", "12")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"no checkpoint in {state / 'checkpoints'} loads (the newest: {bad})" in r.stderr
    assert json.loads((state / "checkpoints" / bad / "manifest.json").read_text())["step"] == 11


def test_a_node_resuming_at_the_highest_term_still_writes_its_checkpoints(tmp_path):
    """A term file of 2^52 - 1 and a checkpoint of term 2^52: the node leads 2^52 (one above
    the highest it may resume below) and its checkpoints carry it. A first bound refused
    manifests of term 2^52 -- every checkpoint of such a run unwritten; before it, a
    floor of 2^52 led at 2^52 + 1, which no manifest carries."""
    from tests.swarmlab import SwarmLab, free_ports, wait_for

    with SwarmLab(tmp_path / "lab") as lab:
        first = lab.start("a", free_ports(1)[0], [])
        wait_for("a first checkpoint", lambda: [
            e for e in first.events() if e.get("event") == "checkpoint"], 90)
        assert lab.stop_all() == [0]
        state = first.state_dir
        root = state / "checkpoints"
        newest = checkpoint.list_checkpoints(root)[0]
        m = checkpoint.read_manifest(newest)
        meta = checkpoint.state_meta(checkpoint.load_tensors(newest, checkpoint.STATE_FILE, {}))
        snap = checkpoint.Snapshot(
            step=m.step, term=2**52, swarm_count=dict(m.swarm_count), fingerprint=m.fingerprint,
            arch=dict(m.arch), model_tensors=list(_tensors(newest / checkpoint.MODEL_FILE)),
            state_tensors=list(_tensors(newest / checkpoint.STATE_FILE)), state_meta=meta)
        checkpoint.save(root, snap, load_or_create(state), keep=10)
        (state / "term").write_text(str(2**52 - 1))
        again = lab.start("a2", free_ports(1)[0], [], state=state)
        written = wait_for("a checkpoint of term 2^52", lambda: [
            e for e in again.events() if e.get("event") == "checkpoint"
            and checkpoint.read_manifest(checkpoint.list_checkpoints(root)[0]).term == 2**52],
            90)
        assert written and not [e for e in again.events()
                                if e.get("event") == "checkpoint_failed"], again.output()[-2000:]
        assert lab.stop_all()[-1] == 0
