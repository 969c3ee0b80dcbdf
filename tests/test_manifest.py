"""The one manifest module: strict rules, compatibility with what the previous release wrote,
and one parser for the store, the server and the fetcher."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from p2ptrain import checkpoint
from p2ptrain.checkpoint import manifest as mf
from p2ptrain.identity import load_or_create
from p2ptrain.net.fetch import FetchError, check_answer
from p2ptrain.net.shelf import Shelf

DATA = Path(__file__).parent / "data"
PREV = DATA / "prev-release" / "ckpt-t000004-s0000000021"  # written by e8b8c16's store.save
PREV_BIG = DATA / "prev-release-bigchunks" / "ckpt-t000004-s0000000022"  # 32 MiB chunks


def test_a_checkpoint_the_previous_release_wrote_still_loads():
    manifest = checkpoint.read_manifest(PREV)
    assert (manifest.term, manifest.step, manifest.swarm_samples) == (4, 21, 210)
    assert manifest.id == PREV.name and manifest.arch == {"model": "test", "n": 3}
    found = checkpoint.find_latest(PREV.parent, "prev-release")
    assert found.path == PREV and found.manifest == manifest
    assert Shelf(lambda: [PREV.parent]).latest().manifest == manifest  # and is served


def test_one_the_stricter_rules_refuse_is_refused_saying_why(tmp_path):
    with pytest.raises(checkpoint.ManifestError, match=r"chunk size 33554432, outside "
                                                       r"\[4096, 16777216\]"):
        checkpoint.read_manifest(PREV_BIG)
    root = tmp_path / "checkpoints"
    shutil.copytree(PREV_BIG, root / PREV_BIG.name)
    shutil.copytree(PREV, root / PREV.name)
    found = checkpoint.find_latest(root, "prev-release")  # the newer is skipped, named
    assert found.path == root / PREV.name
    assert len(found.skipped) == 1 and "chunk size 33554432" in found.skipped[0]


def test_store_server_and_fetcher_parse_alike():
    doc = checkpoint.read_manifest(PREV).to_json()
    assert mf.parse(doc).digest == checkpoint.read_manifest(PREV).digest
    ckid, parsed, have = check_answer({"id": PREV.name, "manifest": doc, "have": None})
    assert parsed == mf.parse(doc) and have is None
    doc["files"][mf.MODEL_FILE]["size"] = 0  # refused by all three in the same words
    with pytest.raises(mf.ManifestError, match="impossible size"):
        mf.parse(doc)
    with pytest.raises(FetchError, match="impossible size"):
        check_answer({"id": PREV.name, "manifest": doc})


@pytest.mark.parametrize("have,ok", [
    (None, True), ({mf.MODEL_FILE: [[0, 1]], mf.STATE_FILE: []}, True),
    ({mf.MODEL_FILE: [[0, 2]], mf.STATE_FILE: []}, False),  # past the last chunk
    ({mf.MODEL_FILE: [[1, 1]], mf.STATE_FILE: []}, False),  # an empty run
    ({mf.MODEL_FILE: [[0, 1]]}, False), ({mf.MODEL_FILE: "all", mf.STATE_FILE: []}, False),
    ({mf.MODEL_FILE: [[0, True]], mf.STATE_FILE: []}, False), ([], False),
])
def test_a_holders_have_list_is_checked(have, ok):
    doc = checkpoint.read_manifest(PREV).to_json()
    answer = {"id": PREV.name, "manifest": doc, "have": have}
    if ok:
        check_answer(answer)
    else:
        with pytest.raises(FetchError, match="have"):
            check_answer(answer)


def test_the_digest_names_the_exact_signed_manifest(tmp_path):
    a = checkpoint.read_manifest(PREV)
    assert mf.parse(a.to_json()).digest == a.digest and len(a.digest) == 16
    ident = load_or_create(tmp_path / "id")
    again = mf.sign(ident, step=a.step, term=a.term, fingerprint=a.fingerprint, arch=a.arch,
                    swarm_count=a.swarm_count, files=a.files)
    assert again.digest != a.digest  # same content, another signer


def test_a_term_beyond_the_protocols_bound_is_refused_and_a_damaged_term_file_ignored(
        tmp_path):
    """A `term` file damaged to 2^60 made the node lead in a term no peer accepts, write it
    into a checkpoint and stop with an internal error at every start, also once the file
    was deleted (it resumed that checkpoint)."""
    from p2ptrain.net.saving import read_term

    doc = checkpoint.read_manifest(PREV).to_json()
    with pytest.raises(checkpoint.ManifestError, match="below 2.53"):
        mf.parse(dict(doc, term=2**60))
    with pytest.raises(checkpoint.ManifestError, match="beyond the protocol's 2.52"):
        mf.parse(dict(doc, term=2**52 + 1))
    with pytest.raises(checkpoint.ManifestError, match="signature"):  # in range: read on
        mf.parse(dict(doc, term=2**52))  # (a node leading 2^52 writes it)
    path = tmp_path / "term"
    for text, want in (("2305843009213693952\n", 0), ("-3", 0), ("\xff", 0), ("41\n", 41),
                       (str(2**52), 0), (str(2**52 - 1), 2**52 - 1)):
        path.write_text(text, encoding="latin-1")
        assert read_term(path) == want, text
    path.unlink()
    os.mkfifo(path)  # a FIFO planted there hung the start
    assert read_term(path) == 0


def test_an_incarnation_file_out_of_range_says_what_to_do(tmp_path):
    from p2ptrain.identity import IdentityError

    load_or_create(tmp_path)
    for text in ("1152921504606846976", "-7", "x"):
        (tmp_path / "incarnation").write_text(text)
        with pytest.raises(IdentityError, match="identity.key to join as a new node"):
            load_or_create(tmp_path)
    (tmp_path / "incarnation").unlink()
    os.mkfifo(tmp_path / "incarnation")  # it hung the start
    with pytest.raises(IdentityError, match="incarnation is not a regular file; remove it"):
        load_or_create(tmp_path)


def test_an_identity_key_that_cannot_be_read_is_one_line(tmp_path):
    """A traceback (PermissionError) after `sudo p2ptrain join` once, then without sudo."""
    from p2ptrain.identity import IdentityError

    (tmp_path / "identity.key").mkdir()
    with pytest.raises(IdentityError, match="cannot read .*identity.key"):
        load_or_create(tmp_path)


@pytest.mark.parametrize("field", ["step", "swarm_samples"])
def test_a_step_or_count_the_protocol_cannot_carry_is_refused(field):
    """A leader holding the swarm key signed a manifest of step 2^60 (the manifest allowed
    up to 2^63, the protocol's holdings 2^53): a joiner fetched it, advertised it as its
    holding, and its own protocol core refused that -- an internal error, at every start
    (fetched/ keeps the newest checkpoint)."""
    doc = checkpoint.read_manifest(PREV).to_json()
    big = 2**53
    changed = dict(doc, **{field: big})
    if field == "swarm_samples":  # the sum of the counts: a count past the bound too
        changed["swarm_count"] = {"a" * 32: big}
    else:
        changed["step"] = big
    with pytest.raises(checkpoint.ManifestError, match="below 2.53|swarm_count"):
        mf.parse(changed)
    with pytest.raises(checkpoint.ManifestError, match="signature"):  # in range: read on
        mf.parse(dict(doc, step=big - 1))
