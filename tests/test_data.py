import os
from pathlib import Path

import numpy as np
import pytest

from p2ptrain.data import DataError, Sampler, eval_windows, load_corpus
from p2ptrain.data.sampler import shard_seed


def test_builtin_corpus_holds_out_the_last_tenth():
    c = load_corpus(None, 0.1, 10)
    assert c.name == "tinyshakespeare"
    total = c.train.size + c.heldout.size
    assert total == 1_115_394
    assert c.heldout.size == total - round(total * 0.9)
    assert bytes(c.train[:10]) == b"First Citi"


def test_directory_and_npy_sources(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_bytes(b"b" * 50)
    (tmp_path / "d" / "a.txt").write_bytes(b"a" * 50)
    c = load_corpus(str(tmp_path / "d"), 0.2, 5)
    assert bytes(c.train[:3]) == b"aaa" and bytes(c.heldout[-3:]) == b"bbb"
    np.save(tmp_path / "t.npy", np.arange(100) % 256)
    c = load_corpus(str(tmp_path / "t.npy"), 0.1, 5)
    assert c.train.tolist() == list(range(90))


@pytest.mark.parametrize("setup,match", [
    (lambda p: p / "missing.txt", "does not exist"),
    (lambda p: (p / "e.txt").write_bytes(b"") and p / "e.txt" or p / "e.txt", "empty"),
    (lambda p: (p / "s.txt").write_bytes(b"xy") and p / "s.txt" or p / "s.txt", "too small"),
    (lambda p: (p / "f").write_bytes(b"x") and p / "f" / "inside" or p / "f" / "inside",
     "cannot be read|does not exist"),
    (lambda p: (p / "emptydir").mkdir() or p / "emptydir", "no text files"),
    (lambda p: np.save(p / "f.npy", np.array([1.5, 2.5])) or p / "f.npy", "integer"),
    (lambda p: np.save(p / "g.npy", np.array([1, 999])) or p / "g.npy", "0..255"),
    (lambda p: (p / "h.npy").write_bytes(b"not numpy") and p / "h.npy" or p / "h.npy",
     "not a valid .npy"),
    (lambda p: (p / "e.npy").write_bytes(b"") or p / "e.npy", "not a valid .npy"),  # EOFError
    (lambda p: np.savez(p / "z.npz", a=np.arange(99)) or (p / "z.npz").rename(p / "z.npy")
     or p / "z.npy", "an .npz archive"),  # AttributeError: 'NpzFile' ... 'ndim'
    (lambda p: os.mkfifo(p / "fifo.txt") or p / "fifo.txt", "not a regular file"),  # a hang
    (lambda p: Path("/dev/zero"), "not a regular file"),  # memory filled
])
def test_bad_sources_raise_one_clear_error(tmp_path, setup, match):
    with pytest.raises(DataError, match=match):
        load_corpus(str(setup(tmp_path)), 0.1, 10)


def test_sampler_resumes_exactly_and_differs_between_nodes():
    tokens = np.arange(1000, dtype=np.int64) % 256
    a = Sampler(tokens, 9, seed=shard_seed("node-a", 0))
    first = [a.next_batch(7) for _ in range(40)]  # crosses epoch boundaries
    assert a.epoch >= 1
    b = Sampler(tokens, 9, seed=shard_seed("node-a", 0))
    for _ in range(20):
        b.next_batch(7)
    pos = b.position()
    c = Sampler(tokens, 9, pos["seed"], pos["epoch"], pos["index"])
    resumed = [c.next_batch(7) for _ in range(20)]
    assert all((x == y).all() for x, y in zip(first[20:], resumed, strict=True))
    other = Sampler(tokens, 9, seed=shard_seed("node-b", 0)).next_batch(7)
    assert not (other == first[0]).all()


def test_an_epoch_visits_every_window_once():
    tokens = np.arange(200, dtype=np.int64)
    s = Sampler(tokens, 11, seed=3)
    n = s._starts.size
    starts = s.next_batch(n)[:, 0]
    assert len(set(starts.tolist())) == n
    assert np.all(np.diff(np.sort(starts)) == 10)


def test_eval_windows_are_fixed_and_in_range():
    tokens = np.arange(500) % 256
    w1, w2 = eval_windows(tokens, 17, 8), eval_windows(tokens, 17, 8)
    assert w1.shape == (8, 17) and (w1 == w2).all()
    assert w1[0, 0] == 0 and w1[-1, -1] == tokens[-1]
