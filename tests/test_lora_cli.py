"""LoRA mode through the real command: a base trained on one text, adapters trained on a
second text lower its held-out loss there; the base file's bytes never change; the adapters'
checkpoint is small and names its base; `checkpoint merge` gives a full checkpoint whose
logits equal base + adapters and which `sample` and `export` take; wrong inputs are refused
by name."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from p2ptrain import checkpoint, data
from p2ptrain.lora.setup import model_of_arch
from p2ptrain.models import model_from_arch
from tests.helpers import run_cli

TOML = ('[model]\nname = "rwkv"\n[model.rwkv]\nn_layer = 2\nn_embd = 32\nctx_len = 16\n'
        "[train]\nbatch = 8\nwarmup_samples = 8\nlr = 0.01\n[eval]\nwindows = 32\n"
        "every_seconds = 1000\n[checkpoint]\nevery_seconds = 0\n")


def evals(stdout: str) -> list[float]:
    out = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if doc.get("event") == "eval":
                out.append(doc["eval_loss"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base trained on text A; adapters trained on text B on top of it."""
    tmp = tmp_path_factory.mktemp("lora")
    (tmp / "run.toml").write_text(TOML)
    text_a = tmp / "a.txt"
    text_a.write_bytes((Path(data.__file__).parent / "tinyshakespeare.txt").read_bytes()
                       [:200_000])
    rng = random.Random(4)
    words = ["red", "green", "blue", "cyan", "black", "white", "seven", "eight", "nine",
             "zebra", "quartz"]
    (tmp / "b.txt").write_text(" ".join(rng.choice(words) for _ in range(30_000)))
    common = ("--config", str(tmp / "run.toml"), "--log-format", "json", "--seed", "3")
    r = run_cli("join", *common, "--data", str(text_a), "--state-dir", str(tmp / "full"),
                "--steps", "60")
    assert r.returncode == 0, r.stderr
    r = run_cli("join", *common, "--mode", "lora", "--base", str(tmp / "full"),
                "--lora-rank", "4", "--data", str(tmp / "b.txt"), "--state-dir",
                str(tmp / "lora"), "--steps", "40")
    assert r.returncode == 0, r.stderr
    return tmp, r


def test_adapters_lower_the_held_out_loss_of_the_second_text(runs):
    tmp, r = runs
    losses = evals(r.stdout)
    assert len(losses) == 2, r.stdout[-2000:]
    start, end = losses
    assert end < start - 0.3, (start, end)  # the base never saw text B
    assert "LoRA r4 adapters" in r.stdout


def test_the_checkpoint_holds_adapters_and_names_the_base(runs):
    tmp, _ = runs
    (base_dir,) = [p for p in (tmp / "lora" / "bases").iterdir() if p.is_dir()]
    ckpt = checkpoint.list_checkpoints(tmp / "lora" / "checkpoints")[0]
    manifest = checkpoint.read_manifest(ckpt)
    assert manifest.arch["lora"]["base"] == base_dir.name
    assert manifest.arch["lora"]["rank"] == 4
    full = model_from_arch(checkpoint.read_manifest(
        checkpoint.list_checkpoints(tmp / "full" / "checkpoints")[0]).arch)
    adapters = model_of_arch(manifest.arch, [tmp / "lora" / "bases"])
    assert adapters.space.n_params == 20 * 4 * 32 * 2  # 20 r C per block
    # adapters only: under a quarter of the full model's float32 bytes
    assert (ckpt / "model.safetensors").stat().st_size < full.space.n_params


def test_the_base_file_never_changes(runs, tmp_path):
    tmp, _ = runs
    (base_dir,) = [p for p in (tmp / "lora" / "bases").iterdir() if p.is_dir()]
    before = hashlib.sha256((base_dir / "base.safetensors").read_bytes()).hexdigest()
    r = run_cli("join", "--config", str(tmp / "run.toml"), "--mode", "lora", "--base",
                base_dir.name, "--lora-rank", "4", "--data", str(tmp / "b.txt"),
                "--state-dir", str(tmp / "lora"), "--steps", "44")  # resumes; base by id
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    assert hashlib.sha256((base_dir / "base.safetensors").read_bytes()).hexdigest() == before
    assert base_dir.name == hashlib.sha256(json.dumps(
        json.loads((base_dir / "base.json").read_text()), sort_keys=True,
        separators=(",", ":")).encode()).hexdigest()[:16]  # named by its manifest


def test_merge_gives_the_same_logits_and_samples(runs, tmp_path):
    tmp, _ = runs
    merged = tmp_path / "merged"
    r = run_cli("checkpoint", "merge", "--adapters", str(tmp / "lora"), "--out", str(merged))
    assert r.returncode == 0, r.stderr
    ckpt = checkpoint.list_checkpoints(tmp / "lora" / "checkpoints")[0]
    lora = model_of_arch(checkpoint.read_manifest(ckpt).arch, [tmp / "lora" / "bases"])
    adapters = lora.space.zeros()
    checkpoint.load_tensors(ckpt, checkpoint.MODEL_FILE, lora.space.views(adapters))
    manifest = checkpoint.read_manifest(merged)
    full = model_from_arch(manifest.arch)
    weights = full.space.zeros()
    checkpoint.load_tensors(merged, checkpoint.MODEL_FILE, full.space.views(weights))
    ids = np.random.default_rng(0).integers(0, 256, (2, 16))
    # merged float32 weights round differently from base + B A: logits of magnitude ~4-8
    # (a float32 unit ~5e-7) differed by up to 1.1e-5 in one run of many, depending on the
    # trained adapters (node ids pick the shards); the greedy samples below must match exactly
    assert np.abs(full.logits(weights, ids) - lora.logits(adapters, ids)).max() <= 5e-5
    greedy = ("--length", "60", "--temperature", "0", "--prompt", "red ")
    a = run_cli("sample", "--checkpoint", str(tmp / "lora"), *greedy)
    b = run_cli("sample", "--checkpoint", str(merged), *greedy)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert a.stdout == b.stdout and len(a.stdout) > 60
    r = run_cli("export", "--checkpoint", str(tmp / "lora"), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "merge them into their base first" in r.stderr
    r = run_cli("export", "--checkpoint", str(merged), "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr


def test_missing_or_mismatched_bases_are_refused_by_name(runs, tmp_path):
    tmp, _ = runs
    r = run_cli("join", "--config", str(tmp / "run.toml"), "--mode", "lora", "--base",
                "0123456789abcdef", "--state-dir", str(tmp_path / "s"), "--steps", "1")
    assert r.returncode == 2 and "base 0123456789abcdef is not in" in r.stderr
    (base_dir,) = [p for p in (tmp / "lora" / "bases").iterdir() if p.is_dir()]
    r = run_cli("sample", "--checkpoint", str(tmp / "lora" / "checkpoints"), "--base",
                str(tmp_path))  # a wrong --base still falls back to the state dir's bases
    assert r.returncode == 0, r.stderr
    moved = tmp_path / "elsewhere"
    ckpt = checkpoint.list_checkpoints(tmp / "lora" / "checkpoints")[0]
    shutil.copytree(ckpt, moved / "checkpoints" / ckpt.name)
    r = run_cli("sample", "--checkpoint", str(moved))
    if not (Path("~/.p2ptrain/bases").expanduser() / base_dir.name).exists():
        assert r.returncode == 2 and f"base {base_dir.name}" in r.stderr and "--base" in r.stderr
    r = run_cli("sample", "--checkpoint", str(moved), "--base", str(base_dir))
    assert r.returncode == 0, r.stderr


def test_damaged_or_made_up_inputs_are_clear_errors(runs, tmp_path):
    """Each used to be a traceback, a silent fallback or a silently wrong output (review)."""
    tmp, _ = runs
    (tmp_path / "a-file").write_text("x")
    r = run_cli("checkpoint", "merge", "--adapters", str(tmp / "lora"), "--out",
                str(tmp_path / "a-file" / "merged"))  # the out's parent is a file
    assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("sample", "--checkpoint", str(tmp / "lora"), "--base", str(tmp_path / "no"))
    assert r.returncode == 2 and "no such directory" in r.stderr
    r = run_cli("sample", "--checkpoint", str(tmp / "full"), "--base", str(tmp_path))
    assert r.returncode == 2 and "--base is for LoRA checkpoints" in r.stderr
    # the newest checkpoint damaged: the next older is used, and said so
    state = tmp_path / "state"
    shutil.copytree(tmp / "full", state)
    newest = checkpoint.list_checkpoints(state / "checkpoints")[0]
    model = newest / checkpoint.MODEL_FILE
    model.write_bytes(model.read_bytes()[:-100])
    r = run_cli("sample", "--checkpoint", str(state), "--length", "4")
    assert f"warning: skipped {newest.name}" in r.stderr


def test_a_checkpoint_whose_arch_its_file_cannot_hold_is_refused_before_allocating(runs,
                                                                                    tmp_path):
    from p2ptrain.identity import load_or_create

    tmp, _ = runs
    src = checkpoint.list_checkpoints(tmp / "full" / "checkpoints")[0]
    manifest = checkpoint.read_manifest(src)
    arch = {**manifest.arch, "n_layer": 200, "n_embd": 10**6}  # ~9 PiB of float32
    model = model_from_arch(manifest.arch)
    tensors = {}
    checkpoint.load_tensors(src, checkpoint.MODEL_FILE, {
        s.name: tensors.setdefault(s.name, np.zeros(s.shape, np.float32))
        for s in model.space})
    snap = checkpoint.Snapshot(
        step=1, term=1, swarm_count={}, fingerprint="fp", arch=arch,
        model_tensors=list(tensors.items()), state_tensors=[], state_meta={"step": 1})
    forged = checkpoint.save(tmp_path / "ck", snap, load_or_create(tmp_path / "id"), keep=1)
    for argv in (("sample", "--checkpoint", str(forged)),
                 ("export", "--checkpoint", str(forged), "--out", str(tmp_path / "hf"))):
        r = run_cli(*argv)
        assert r.returncode == 2 and "more than its" in r.stderr, r.stderr


def test_a_base_holding_a_nan_is_refused_by_name(runs, tmp_path):
    from p2ptrain.lora.basefile import BASE_FILE, BaseError, read_base
    from p2ptrain.models.rwkv import RWKV

    tmp, _ = runs
    (base_dir,) = [p for p in (tmp / "lora" / "bases").iterdir() if p.is_dir()]
    bad = tmp_path / base_dir.name
    shutil.copytree(base_dir, bad)
    base = read_base(bad)
    frozen = base.frozen(RWKV(base.config(16, 16)))
    name = next(n for n in frozen.tensors if frozen.tensors[n].size > 100)
    raw = bytearray((bad / BASE_FILE).read_bytes())
    offset = frozen.tensors[name].ctypes.data - frozen._map.ctypes.data
    raw[offset : offset + 2] = np.array([0x7FC0], np.uint16).tobytes()  # a bf16 NaN
    del frozen
    (bad / BASE_FILE).write_bytes(bytes(raw))
    with pytest.raises(BaseError, match=f"{name} holds NaN or infinite values"):
        read_base(bad).frozen(RWKV(base.config(16, 16)))
