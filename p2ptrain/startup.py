"""What every node does before its first step, alone or networked: the lock on its state
directory (statelock.py: one process per directory), its identity, the model,
the corpus, the batch size (from the hardware when not given), the learner, and the newest
valid local checkpoint to resume from (partial writes removed, damaged ones skipped).

Also the test hook that kills the process mid-checkpoint (`P2PTRAIN_FAULT`). It reads files
and the hardware; it never opens a socket and keeps no state of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from p2ptrain import checkpoint
from p2ptrain.calibration import calibrate
from p2ptrain.checkpoint.manifest import MAX_TERM
from p2ptrain.data import Corpus, load_corpus
from p2ptrain.data.tokens import TOKENIZER_FILE, sha256_file
from p2ptrain.errors import UserError
from p2ptrain.fsutil import dangling
from p2ptrain.hw import explain_batch
from p2ptrain.identity import Identity, load_or_create
from p2ptrain.learner import Learner
from p2ptrain.models import Model, build_model, hf
from p2ptrain.proto import MemberInfo, fingerprint_of
from p2ptrain.proto.gossip.config import (
    AUTO,
    AUTO_FULL_FLOPS,
    GossipConfig,
    flops_per_coordinate,
)
from p2ptrain.report import Reporter
from p2ptrain.settings import Settings
from p2ptrain.statelock import lock_state_dir


@dataclass
class Prepared:
    """A node ready to train."""

    identity: Identity
    learner: Learner
    ckroot: Path  # <state dir>/checkpoints
    hw: Any  # the detected hardware (None when nothing needed it)
    term: int = 0  # term of the checkpoint it resumed from: its checkpoints never go below it


def fault_hook(spec: str | None, reporter: Reporter):
    """Test hook (P2PTRAIN_FAULT=kill-mid-checkpoint:N): SIGKILL this process halfway through
    writing the weights of its Nth checkpoint, to prove a torn write never loads. Returns a
    function of the checkpoint's ordinal giving its progress callback (or None)."""
    if not spec or not spec.startswith("kill-mid-checkpoint:"):
        return lambda n: None
    target = int(spec.split(":", 1)[1])

    def for_checkpoint(n: int):
        if n != target:
            return None

        def progress(_name: str, done: int, total: int) -> None:
            if done >= total // 2:
                reporter.warn(f"fault injection: killing myself mid-checkpoint {n}")
                os.kill(os.getpid(), signal.SIGKILL)

        return progress

    return for_checkpoint


def env_fault_hook(reporter: Reporter):
    return fault_hook(os.environ.get("P2PTRAIN_FAULT"), reporter)


def prepare(settings: Settings, reporter: Reporter, alone: bool = True) -> Prepared:
    """Identity, learner (resumed from the newest valid local checkpoint) and checkpoint root
    of the node whose state directory the settings name."""
    state_dir = Path(settings.host.state_dir).expanduser()
    lock_state_dir(state_dir)  # held for the life of the process: one node per directory
    identity = load_or_create(state_dir)
    reporter.node_id = identity.node_id  # every log line names the node from here on
    corpus = load_corpus(settings.data.path, settings.data.holdout_fraction,
                         settings.model.ctx_len + 2)
    model, hf_dir = model_for(settings, corpus, reporter)
    train = settings.train
    batch, accum = train.batch, train.accum or 1
    found = calibrate(state_dir) if batch == 0 or not alone else None
    hw = found.hardware if found is not None else None
    for warning in found.warnings if found is not None else ():
        reporter.warn(warning, event="calibration")
    if batch == 0:
        choice = explain_batch(hw, model.flops_per_token() * model.ctx_len,
                               model.activation_bytes_per_sample(), train.target_step_seconds)
        batch, accum = choice.batch, train.accum or choice.accum
        micro = f" in {accum} micro-batches" if accum > 1 else ""
        floor = (f" ({hw.device_class} floor; the measured speed gave {choice.measured_batch})"
                 if choice.floor_applied else "")
        reporter.info(f"hardware: {hw.device_class}, {hw.cpus:g} cores, "
                      f"{hw.memory_bytes / 2**30:.1f} GiB usable, {hw.matmul_gflops:.0f} GFLOP/s "
                      f"matmul ({found.source}) -> batch {batch}{micro}{floor}",
                      event="hardware", batch=batch, accum=accum, **hw.as_dict(),
                      matmul=found.as_dict(), choice=choice.as_dict())
    if batch % accum:
        raise UserError(f"batch {batch} is not a multiple of train.accum {accum}")
    learner = Learner(model, identity.node_id, train, corpus, batch, accum,
                      settings.eval.windows)
    what = f"{model.name} ({model.space.n_params / 1e6:.2f}M parameters)"
    if model.mode == "lora":
        what = (f"LoRA r{model.lora.rank} adapters ({model.space.n_params / 1e6:.2f}M "
                f"parameters) on the frozen {model.base.dtype_name()} {model.name} base "
                f"{model.base_id} ({model.full_space.n_params / 1e6:.1f}M)")
    reporter.info(
        f"node {identity.node_id[:12]} (incarnation {identity.incarnation}) training "
        f"{what} on {corpus.name} "
        f"({corpus.train.size:,} training / {corpus.heldout.size:,} held-out "
        f"{'bytes' if corpus.tokenizer_json is None else 'tokens'})"
        + (", alone" if alone else ""), event="start", node_id=identity.node_id,
        model=model.name, params=model.space.n_params, batch=batch)
    if not alone:
        reporter.info(averaging_text(settings, model), event="averaging_plan")
        if not settings.net.mdns and not settings.net.seeds():
            reporter.warn("mDNS is off and no --peer is given: this node finds no peer itself "
                          "(it trains alone until one names it)", event="no_discovery")
    if train.ema > 0:
        reporter.info(f"checkpoints carry an average of the weights over about the last "
                      f"{1 / (1 - train.ema):,.0f} steps (train.ema = {train.ema:g}), "
                      f"{4 * model.space.n_params / 2**20:,.0f} MiB more", event="ema")

    ckroot = state_dir / "checkpoints"
    if why := dangling(ckroot):  # else a fresh start, and every write failing
        raise UserError(f"cannot use {ckroot}: {why}")
    if ckroot.exists() and not ckroot.is_dir():  # found at the first write, the run's end
        raise UserError(f"{ckroot} is a file, not the node's checkpoint directory: move it "
                        f"away (or use another --state-dir)")
    for stale in checkpoint.stale_temporaries(ckroot):
        reporter.warn(f"removing partial checkpoint {stale.name} left by an interrupted write")
        shutil.rmtree(stale, ignore_errors=True)
    found = _resume(learner, ckroot, reporter)
    if found.path is not None:
        reporter.info(f"resumed from {found.path.name}: step {learner.step}, "
                      f"{learner.swarm_samples:,} samples", event="resumed",
                      checkpoint=str(found.path), step=learner.step)
    elif hf_dir is not None:
        initialize_from_hf(learner, hf_dir)
        reporter.info(f"weights from {hf_dir}", event="init_from", path=str(hf_dir))
    # (a node leads one term above: at most 2^52, what its manifests and peers take)
    term = min(found.manifest.term, MAX_TERM - 1) if found.manifest is not None else 0
    return Prepared(identity, learner, ckroot, hw, term)


def _resume(learner: Learner, ckroot: Path, reporter: Reporter) -> checkpoint.Found:
    """Restore the newest checkpoint that verifies and loads. One that verifies (its hashes
    and the leader's signature) but does not load -- non-finite weights, resume data out of
    range, as a leader holding the swarm key could sign it into `checkpoint fetch --out` --
    is passed over with a warning, as one that fails its hashes is: the node stopped, with
    older good checkpoints beside it."""
    unloadable: list[Path] = []
    said: set[str] = set()
    while True:
        try:
            found = checkpoint.find_latest(ckroot, learner.fingerprint, learner.model.arch(),
                                           passing_over=unloadable)
        except checkpoint.CheckpointMismatch as exc:
            raise UserError(str(exc)) from None
        for reason in found.skipped:
            if reason not in said:
                said.add(reason)
                reporter.warn(f"skipping checkpoint: {reason}")
        if found.path is None:
            if unloadable:  # the only ones there do not load: say so rather than start over
                raise UserError(f"cannot resume: no checkpoint in {ckroot} loads (the newest: "
                                f"{unloadable[0].name}); move them aside to start afresh")
            return found
        try:
            learner.restore(found.path, found.manifest)
            return found
        except checkpoint.CheckpointError as exc:
            reporter.warn(f"skipping checkpoint: {exc}", event="resume_skipped",
                          checkpoint=str(found.path))
            unloadable.append(found.path)


def averaging_text(settings: Settings, model: Model) -> str:
    """What this node's parameter averaging sends, `gossip.averaging = "auto"` resolved."""
    gossip, n = settings.gossip, model.space.n_params
    if gossip.average_every == 0:
        return "parameter averaging: off (gossip.average_every = 0)"
    per = flops_per_coordinate(model, n)
    plan = gossip.averaging_plan(n, per)
    covers = ("every coordinate" if plan.fraction >= 1.0
              else f"a seeded {plan.fraction:.0%} of the coordinates")
    if plan.slow_fraction is not None:
        covers += (f" between two of the swarm's fastest members, {plan.slow_fraction:.1%} "
                   "otherwise")
    elif gossip.subset_fraction_slow:
        covers += " (gossip.subset_fraction_slow is for the subset modes: unused)"
    why = (f" (auto: {per:,.0f} FLOPs per sample and travelling coordinate, "
           f"{'at least' if plan.fraction >= 1.0 else 'under'} {AUTO_FULL_FLOPS:,.0f})"
           if gossip.averaging == AUTO else "")
    fast, share = gossip.average_every_fast, gossip.average_fast_share
    few = "" if share >= 1 else f" and they are at most {share:.0%} of the members"
    also = ("" if not fast else f", and with one of the swarm's fastest every {fast} "
            f"step{'s' if fast > 1 else ''} while this node is one of them{few}")
    return (f"parameter averaging: {covers} in {plan.values} with one peer every "
            f"{gossip.average_every} steps{also}{why}")


def model_for(settings: Settings, corpus: Corpus, reporter: Reporter | None = None
              ) -> tuple[Model, Path | None]:
    """The model to train on `corpus`: the configured shape (a preset included) or that of
    the Hugging Face directory `model.init_from`, with the data's vocabulary; and that
    directory. The data must have been prepared with that directory's tokenizer."""
    if settings.train.mode == "lora":
        return lora_model_for(settings, corpus, reporter), None
    if not settings.init_from:
        return build_model(settings.model_name, replace(settings.model,
                                                        vocab_size=corpus.vocab_size)), None
    hf_dir = Path(settings.init_from).expanduser()
    if settings.model_name != "rwkv":
        raise UserError(f"--init-from takes an RWKV-4 model; model.name is {settings.model_name}")
    try:
        config = hf.config_from_hf(hf.read_config(hf_dir))
    except hf.HFFormatError as exc:
        raise UserError(f"--init-from {hf_dir}: {exc}") from None
    if config.vocab_size != corpus.vocab_size:
        raise UserError(f"--init-from {hf_dir}: the model has a vocabulary of "
                        f"{config.vocab_size:,} tokens, the data {corpus.name} of "
                        f"{corpus.vocab_size:,}; prepare the data with its tokenizer: p2ptrain "
                        f"data prepare FILES --tokenizer {hf_dir / TOKENIZER_FILE} --out DIR")
    tokenizer = hf_dir / TOKENIZER_FILE
    if (tokenizer.is_file() and sha256_file(tokenizer)[:16] != corpus.tokenizer_id
            and not (corpus.tokenizer_id == "bytes"  # a byte model we exported, on bytes
                     and hf.is_byte_tokenizer(tokenizer.read_bytes()[:1 << 20],
                                              config.vocab_size))):
        raise UserError(f"--init-from {hf_dir}: the data {corpus.name} was prepared with "
                        f"another tokenizer (tokenizer {corpus.tokenizer_id}, the model's "
                        f"{sha256_file(tokenizer)[:16]}); prepare it with --tokenizer "
                        f"{tokenizer}")
    config = replace(config, ctx_len=settings.model.ctx_len,
                     wkv_chunk=settings.model.wkv_chunk)  # training window: ours
    return build_model("rwkv", config), hf_dir


def lora_model_for(settings: Settings, corpus: Corpus, reporter: Reporter | None = None
                   ) -> Model:
    """LoRA mode: adapters on the base `lora.base` (or `model.init_from`) names, which must
    have the data's vocabulary and tokenizer. The base is checked chunk by chunk (a line
    every 5 s while that takes long: 2.6 GB from a Pi's SD card takes about half a minute)."""
    from p2ptrain.lora.basefile import BaseError
    from p2ptrain.lora.setup import lora_model, resolve_base

    if settings.model_name != "rwkv":
        raise UserError(f"train.mode lora adapts an rwkv base; model.name is "
                        f"{settings.model_name}")
    source = settings.lora.base or settings.init_from
    said = [time.monotonic()]

    def progress(done: int, total: int) -> None:
        if reporter is not None and time.monotonic() - said[0] >= 5.0:
            said[0] = time.monotonic()
            reporter.info(f"checking the base: {done / 1e9:.2f} of {total / 1e9:.2f} GB",
                          event="base_check", done=done, total=total)

    try:
        base = resolve_base(source, settings.host.state_dir, settings.lora.base_dtype,
                            progress)
    except BaseError as exc:
        raise UserError(f"lora base: {exc}") from None
    shape = base.shape
    if shape["vocab_size"] != corpus.vocab_size or base.tokenizer_id != corpus.tokenizer_id:
        raise UserError(f"lora base {base.id} has a vocabulary of {shape['vocab_size']:,} "
                        f"tokens (tokenizer {base.tokenizer_id}), the data {corpus.name} "
                        f"{corpus.vocab_size:,} (tokenizer {corpus.tokenizer_id}); prepare the "
                        f"data with the base's tokenizer")
    try:
        return lora_model(base, settings.lora.adapters(), settings.model.ctx_len,
                          settings.model.wkv_chunk)
    except (BaseError, ValueError) as exc:
        raise UserError(f"lora: {exc}") from None


def initialize_from_hf(learner: Learner, hf_dir: Path) -> None:
    """Load an HF RWKV-4 directory's weights into the learner (fp32, fp16 or bf16 tensors)."""
    try:
        hf.load_hf(hf_dir, learner.model.config.wkv_chunk, into=learner.params)
    except hf.HFFormatError as exc:
        raise UserError(f"--init-from {hf_dir}: {exc}") from None


def member_info(learner: Learner, hw: Any, addr: str, priority: int,
                outbound_only: bool, gossip: GossipConfig) -> MemberInfo:
    """How this node describes itself to the swarm (fixed for one incarnation): the fields
    that must match between members (architecture, layout, vocabulary, mode, the shape of an
    averaging exchange, the gradient codec and outer steps) included, and the fingerprint of
    them all."""
    model = learner.model
    n = model.space.n_params
    plan = gossip.averaging_plan(n, flops_per_coordinate(model, n))
    codec = gossip.make_codec()  # a push in another codec, or pseudo-gradients among
    # gradients, is refused chunk by chunk at step rate: such members are refused as members
    gradients = f"{codec.name} {json.dumps(codec.params(), sort_keys=True)}" + (
        f" outer {gossip.outer_every}" if gossip.outer_every > 0 else "")
    fields = {"arch": json.dumps(model.arch(), sort_keys=True),
              "layout": model.space.fingerprint(), "vocab": str(model.vocab_size),
              "tokenizer": learner.tokenizer_id, "mode": model.mode,
              "averaging": plan.wire_shape(), "gradients": gradients}
    if model.mode == "lora":
        fields["base"] = model.base_id
    fingerprint = fingerprint_of({**fields, "model": learner.fingerprint})
    # capability to 3 decimals (as the simulator's devices advertise it): it only breaks
    # election ties, and every header carries it -- 7 characters, not a float's 18
    return MemberInfo(learner.node_id, addr, hw.device_class, round(float(hw.matmul_gflops), 3),
                      priority, fingerprint, fields, outbound_only)
