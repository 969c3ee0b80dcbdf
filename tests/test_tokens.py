"""Tokenized corpora (issue 15): `data prepare` with a BPE the test trains itself (no tokenizer
files shipped), token shards read through memmaps, hostile shards refused, a model trained on
them, a node with another tokenizer refused by name."""

from __future__ import annotations

import json
import math
import os
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from p2ptrain.data import DataError, Sampler, load_corpus
from p2ptrain.data.prepare import prepare
from p2ptrain.data.tokens import TokenDataError, TokenShards, open_prepared
from p2ptrain.proto.records import differing_keys
from tests.helpers import cli_env, run_cli

TEXT = resources.files("p2ptrain.data").joinpath("tinyshakespeare.txt").read_text()


def bpe(path: Path, text: str, vocab: int = 1200) -> Path:
    """A byte-level BPE trained on `text`, saved as tokenizer.json (~0.3 s)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    (root / "text").mkdir()
    (root / "text" / "a.txt").write_text(TEXT[: len(TEXT) // 2])
    (root / "text" / "b.txt").write_text(TEXT[len(TEXT) // 2 :])
    tokenizer = bpe(root / "tokenizer.json", TEXT)
    out = root / "corpus"
    summary = prepare([root / "text"], tokenizer, out, shard_tokens=50_000, progress=False,
                      say=lambda _t: None)
    return root, tokenizer, out, summary


def test_prepare_writes_uint16_shards_split_at_the_tail(shakespeare):
    root, tokenizer, out, summary = shakespeare
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 1200 and meta["dtype"] == "uint16"
    assert summary.shards == len(meta["train"]) + len(meta["heldout"]) > 2  # several shards
    assert summary.heldout_tokens == meta["tokens"] - round(meta["tokens"] * 0.9)
    ids = np.asarray(Tokenizer.from_file(str(tokenizer)).encode(
        TEXT[: len(TEXT) // 2], add_special_tokens=False).ids)
    prepared = open_prepared(out)
    assert np.array_equal(prepared.train[0 : ids.size], ids)  # files in order, across shards
    whole = np.concatenate([prepared.train[0 : prepared.train.size],
                            prepared.heldout[0 : prepared.heldout.size]])
    assert whole.size == meta["tokens"]
    assert prepared.train[5:5].size == 0 and prepared.train[10**12 :].size == 0
    for a, b in ((49_990, 50_020), (0, 7), (prepared.train.size - 5, prepared.train.size)):
        assert np.array_equal(prepared.train[a:b], whole[a:b])


def test_decode_then_encode_gives_back_the_sampled_ids(shakespeare):
    root, tokenizer, out, _ = shakespeare
    tok = Tokenizer.from_file(str(tokenizer))
    corpus = load_corpus(str(out), 0.1, 66)
    assert corpus.vocab_size == 1200 and corpus.tokenizer_id == open_prepared(out).tokenizer_id
    batch = Sampler(corpus.train, 65, seed=3).next_batch(16)
    for row in batch:
        ids = [int(i) for i in row]
        assert tok.encode(tok.decode(ids), add_special_tokens=False).ids == ids


def test_a_vocabulary_beyond_uint16_is_stored_as_uint32(tmp_path):
    words = {f"w{i}": i for i in range(70_000)}
    words["[UNK]"] = 70_000
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text(" ".join(f"w{i}" for i in range(65_000, 70_000)) + "\n")
    prepare([tmp_path / "t.txt"], tmp_path / "tokenizer.json", tmp_path / "c", progress=False)
    prepared = open_prepared(tmp_path / "c")
    assert prepared.train.dtype == np.dtype("<u4")
    assert int(prepared.train[0 : prepared.train.size].max()) > 65_535


def _corrupt(out: Path, edit) -> Path:
    meta = json.loads((out / "meta.json").read_text())
    edit(meta)
    (out / "meta.json").write_text(json.dumps(meta))
    return out


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["train"][0].update(file="../../etc/passwd"), "not a train shard name"),
    (lambda m: m["train"][0].update(tokens=m["train"][0]["tokens"] + 1), "truncated"),
    (lambda m: m.update(tokenizer_sha256="0" * 64), "not the one the shards were made with"),
    (lambda m: m.update(dtype="float32"), "cannot hold the vocabulary"),
    (lambda m: m.update(vocab_size=70_000), "cannot hold the vocabulary"),
    (lambda m: m.update(format="x"), "not a p2ptrain-tokens/1 corpus"),
    (lambda m: m.update(train=[]), "must list its shards"),
    (lambda m: m.update(vocab_size=65_536), "is not the tokenizer's 1200"),  # an 18M model
    (lambda m: m.update(vocab_size=600), "is not the tokenizer's 1200"),
    (lambda m: m.update(train=m["train"] + m["train"][:1]), "listed twice"),
])
def test_hostile_meta_is_refused_with_the_reason(shakespeare, tmp_path, edit, message):
    import shutil

    out = Path(shutil.copytree(shakespeare[2], tmp_path / "c"))
    with pytest.raises(DataError, match=message):
        load_corpus(str(_corrupt(out, edit)), 0.1, 66)


def test_ids_beyond_the_vocabulary_are_refused_when_read(shakespeare, tmp_path):
    import shutil

    out = Path(shutil.copytree(shakespeare[2], tmp_path / "c"))
    with open(out / "train-00000.bin", "r+b") as f:
        f.write(np.array([4000], "<u2").tobytes())
    shards = open_prepared(out).train
    assert isinstance(shards, TokenShards)
    with pytest.raises(TokenDataError, match="not below the vocabulary size 1200"):
        shards[0:10]


def test_prepare_refuses_an_existing_output_and_a_bad_tokenizer(shakespeare, tmp_path):
    root, tokenizer, out, _ = shakespeare
    with pytest.raises(TokenDataError, match="exists"):
        prepare([root / "text"], tokenizer, out, progress=False)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenDataError, match="not a tokenizers document"):
        prepare([root / "text"], tmp_path / "bad.json", tmp_path / "o", progress=False)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.processes
def test_a_model_trained_on_bpe_tokens_learns_and_samples_text(shakespeare, tmp_path):
    root, tokenizer, out, _ = shakespeare
    state = tmp_path / "state"
    r = run_cli("join", "--alone", "--data", str(out), "--steps", "150", "--batch", "16",
                "--log-format", "json",
                "--state-dir", str(state), env=cli_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    evals = [json.loads(line)["eval_loss"] for line in r.stdout.splitlines()
             if '"event": "eval"' in line]
    print(f"held-out loss {evals[0]:.3f} -> {evals[-1]:.3f}; ln V = {math.log(1200):.3f}")
    assert evals[-1] < math.log(1200) - 2.0  # clearly below chance
    s = run_cli("sample", "--checkpoint", str(state), "--prompt", "ROMEO:", "--length", "30",
                env=cli_env(), timeout=120)
    assert s.returncode == 0 and s.stdout.startswith("ROMEO:") and len(s.stdout) > 40, s


def test_a_different_tokenizer_is_a_differing_field_named_tokenizer(shakespeare, tmp_path):
    """Two corpora, same vocabulary size, different merges: the member-info fields differ in
    `tokenizer` alone, so a refusal names it (records.differing_keys)."""
    from p2ptrain.learner import Learner, TrainConfig
    from p2ptrain.models import build_model
    from p2ptrain.models.rwkv import RWKVConfig
    from p2ptrain.proto.gossip.config import GossipConfig
    from p2ptrain.startup import member_info

    other_tok = bpe(tmp_path / "other.json", TEXT[::-1])  # same size, other merges
    other = tmp_path / "other"
    prepare([shakespeare[0] / "text"], other_tok, other, progress=False)
    infos = []
    for path in (shakespeare[2], other):
        corpus = load_corpus(str(path), 0.1, 66)
        model = build_model("rwkv", RWKVConfig(vocab_size=corpus.vocab_size, n_layer=1,
                                               n_embd=16))
        learner = Learner(model, "a" * 32, TrainConfig(), corpus, 2, 1, 4)
        hw = type("HW", (), {"device_class": "desktop", "matmul_gflops": 1.0})()
        infos.append(member_info(learner, hw, "127.0.0.1:1", 0, False, GossipConfig()))
    assert infos[0].fingerprint != infos[1].fingerprint
    assert differing_keys(infos[0].fingerprint_fields, infos[1].fingerprint_fields) == \
        ["tokenizer"]


@pytest.mark.slow
@pytest.mark.processes
def test_a_node_whose_tokenizer_differs_is_refused_naming_the_tokenizer(shakespeare, tmp_path):
    from tests.swarmlab import SwarmLab, free_ports, wait_for

    other_tok = bpe(tmp_path / "other.json", TEXT[::-1])  # same vocabulary size
    other = tmp_path / "other"
    prepare([shakespeare[0] / "text"], other_tok, other, progress=False)
    with SwarmLab(tmp_path / "lab") as lab:
        ports = free_ports(2)
        a = lab.start("a", ports[0], [], "--data", str(shakespeare[2]))
        b = lab.start("b", ports[1], [a.addr], "--data", str(other))
        refused = wait_for("a refusal", lambda: [
            e for p in (a, b) for e in p.events() if e.get("event") == "refused"], 60)
        assert all(e["keys"] == ["tokenizer"] for e in refused), refused
        assert "tokenizer" in refused[0]["message"]
        assert a.status()["members"] == [] and b.status()["members"] == []
        lab.stop_all()


def test_a_killed_prepares_leftovers_are_removed_by_the_next(shakespeare, tmp_path):
    """A prepare killed (SIGKILL, power) leaves `.<out>.tmp-<pid>`: the pid is in the name,
    so no later run removed it (gigabytes for a real corpus)."""
    import subprocess

    root, tokenizer, _, _ = shakespeare
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    orphan = tmp_path / f".corpus.tmp-{dead.pid}"
    (orphan / "shards").mkdir(parents=True)
    (orphan / "shards" / "0.bin").write_bytes(b"x" * 1000)
    mine = tmp_path / f".corpus.tmp-{os.getpid()}x"  # not a pid: not ours to judge
    mine.mkdir()
    prepare([root / "text"], tokenizer, tmp_path / "corpus", shard_tokens=50_000,
            progress=False, say=lambda *_: None)
    assert not orphan.exists() and mine.exists() and (tmp_path / "corpus").is_dir()


def test_hidden_files_a_half_prepared_corpus_and_odd_text_are_handled(shakespeare, tmp_path):
    """A git checkout's .git/objects were trained on as text; a prepared corpus without its
    meta.json was read as text (the tokenizer's JSON); a file of one line was held whole;
    Latin-1 text became U+FFFD without a word."""
    from p2ptrain.data.corpus import text_files
    from p2ptrain.data.prepare import BLOCK_BYTES, _blocks

    repo = tmp_path / "repo"
    (repo / ".git" / "objects").mkdir(parents=True)
    (repo / ".git" / "objects" / "7dcb3a").write_bytes(b"x\x9c\x00binary")
    (repo / ".hidden.txt").write_text("no")
    (repo / "a.txt").write_text(TEXT[:1000])
    assert text_files(repo) == [repo / "a.txt"]
    _, tokenizer, out, _ = shakespeare
    half = tmp_path / "half"
    half.mkdir()
    (half / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    with pytest.raises(DataError, match="looks like a prepared corpus"):
        load_corpus(str(half), 0.1, 66)
    line = tmp_path / "line.txt"
    line.write_bytes(b"x" * (3 * BLOCK_BYTES + 5))
    sizes = [len(b) for b in _blocks(line)]
    assert max(sizes) <= BLOCK_BYTES and sum(sizes) == 3 * BLOCK_BYTES + 5
    latin = tmp_path / "latin.txt"
    latin.write_bytes("First Citizen: Before we proceed\n".encode("latin-1") + b"caf\xe9\n")
    said: list[str] = []
    prepare([latin], tokenizer, tmp_path / "c2", progress=False, say=said.append)
    assert any("not all UTF-8" in s for s in said), said


def test_ids_of_a_vocabulary_with_gaps_keep_their_values(tmp_path):
    """The dtype and vocabulary came from the count of entries: ids past it were written
    past the vocabulary, or wrapped into another token's id (training went on, on garbage)."""
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "e": 65537}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    (tmp_path / "t.txt").write_text("a e a e\n" * 50)
    prepare([tmp_path / "t.txt"], path, tmp_path / "out", progress=False, say=lambda _t: None)
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["vocab_size"] == 65538 and meta["dtype"] == "uint32"
    prepared = open_prepared(tmp_path / "out")
    assert set(np.unique(prepared.train[0 : prepared.train.size])) == {0, 65537}


def test_a_shard_truncated_during_a_run_is_an_error_not_a_crash(shakespeare, tmp_path):
    """Shards were memory-mapped: one copied over (truncated) during a run killed the node
    with SIGBUS, no message, no checkpoint."""
    import shutil

    out = Path(shutil.copytree(shakespeare[2], tmp_path / "c"))
    shards = open_prepared(out).train
    first = shards[0:64].copy()
    with open(out / "train-00000.bin", "r+b") as f:
        f.truncate(100)
    assert np.array_equal(shards[0:50], first[:50])  # what is still there reads
    with pytest.raises(TokenDataError, match="shorter than meta.json says"):
        shards[0:64]


@pytest.mark.parametrize("setting", [
    {"truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                    "stride": 0}},
    {"truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst",
                    "stride": 5}},  # a setting the library panics on (235,633 lines)
    {"padding": {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                 "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"}},
])
def test_a_tokenizers_truncation_and_padding_are_not_applied_to_a_corpus(
        shakespeare, tmp_path, setting):
    """A Hugging Face tokenizer.json may carry them (for a model's inputs): every line was cut
    to 4 tokens (77% of the text gone) or padded to 64 (76% pad ids), exit 0."""
    root, tokenizer, out, summary = shakespeare
    doc = json.loads(tokenizer.read_text())
    doc.update(setting)
    (tmp_path / "tok.json").write_text(json.dumps(doc))
    got = prepare([root / "text"], tmp_path / "tok.json", tmp_path / "c", shard_tokens=50_000,
                  progress=False, say=lambda _t: None)
    assert (got.train_tokens, got.heldout_tokens) == (summary.train_tokens,
                                                      summary.heldout_tokens)


def test_a_tokenizer_whose_ids_reach_far_past_its_entries_is_refused(tmp_path):
    """One id moved to 2e9 made a vocabulary of 2,000,000,001 (a 238 GiB embedding)."""
    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "e": 2_000_000_000},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("a e a e\n")
    with pytest.raises(TokenDataError, match="reach 2,000,000,000 for 3 entries"):
        prepare([tmp_path / "t.txt"], tmp_path / "tokenizer.json", tmp_path / "c",
                progress=False)
    assert not (tmp_path / "c").exists()


def test_prepare_says_how_far_it_is_in_a_pipe(shakespeare, tmp_path, monkeypatch):
    """Into a pipe or a log there is no bar: a 45 MB file was 16 s of silence, then one line.
    A line now and then says how far it is (every 5 s; every block here)."""
    from p2ptrain.data import prepare as prepare_module

    monkeypatch.setattr(prepare_module, "PROGRESS_EVERY", 0.0)
    monkeypatch.setattr(prepare_module, "BLOCK_BYTES", 64 * 1024)
    root, tokenizer, _, _ = shakespeare
    said: list[str] = []
    prepare([root / "text"], tokenizer, tmp_path / "c", progress=False, say=said.append)
    lines = [s for s in said if s.startswith("tokenizing:")]
    assert len(lines) >= 3 and "(100%)" in lines[-1], said
