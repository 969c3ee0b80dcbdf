"""Building one run's world from a scenario: the machines, the network, the proxy model's
training pieces, and the failure schedule every method of the scenario shares.

`World(scenario, seed)` gives a fresh engine and network (every method of a scenario runs in
its own world, with the same seed, so each sees the same machines, batches, node ids and
failure times). A `Member` is one machine: its device profile, site, medium, node id and
address, whether it is outbound-only (its site is behind carrier-grade NAT), and the batch
the hardware detection would choose for the charged model (`[train] batch`, when set, as a
node's own setting does). `Training` holds the proxy model,
the corpus and the held-out windows, and makes learners. `failure_schedule` draws one
machine's (fail, back) times from exponential distributions. Pure apart from reading the
built-in corpus once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from dataclasses import dataclass

import numpy as np

from p2ptrain.data import eval_windows, load_corpus
from p2ptrain.learner import EVAL_BATCH, Learner
from p2ptrain.models import fingerprint
from p2ptrain.proto import PRESETS, MemberInfo, ProtoConfig, fingerprint_of
from p2ptrain.settings import TrainConfig
from sims.charge import ByteCharge, ModelSize, build_model_from
from sims.devices import GIB, Device
from sims.engine import Engine, stream_seed
from sims.network import Network
from sims.scenario import Scenario


@dataclass(frozen=True)
class Member:
    """One machine of the fleet."""

    index: int
    device: Device
    site: str
    medium: str
    node_id: str  # 32 hex characters
    addr: str  # host:port
    outbound_only: bool
    batch: int  # samples per step, as the hardware detection chooses for the charged model
    accum: int  # micro-batches the charged model would need in memory


def failure_schedule(rng: random.Random, mttf: float, mttr: float,
                     horizon: float) -> list[tuple[float, float]]:
    """(fail, back) intervals of one machine up to `horizon`: up for an exponential time of
    mean `mttf`, then down for an exponential time of mean `mttr`, and so on."""
    out: list[tuple[float, float]] = []
    t = 0.0
    while True:
        fail = t + rng.expovariate(1.0 / mttf)
        if fail >= horizon:
            return out
        back = fail + rng.expovariate(1.0 / mttr)
        out.append((fail, back))
        t = back


def proto_config(scenario: Scenario) -> ProtoConfig:
    raw = dict(scenario.protocol)
    preset = PRESETS[raw.pop("preset", "wan")]
    return preset.with_(**raw) if raw else preset


def train_settings(scenario: Scenario) -> TrainConfig:
    """p2ptrain's [train] section (the same keys as a node's TOML) with the scenario's
    overrides."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(scenario.train) - known)
    if unknown:
        raise ValueError(f"[train]: unknown key(s) {', '.join(unknown)}")
    return TrainConfig(**scenario.train)


@functools.cache
def _corpus(window: int):
    return load_corpus(None, 0.1, window)


class Training:
    """The proxy model and its data: learners and held-out evaluation."""

    def __init__(self, scenario: Scenario):
        spec = dict(scenario.model)
        self.model = build_model_from(spec.pop("model", "rwkv"), spec)
        self.size = ModelSize.of(self.model)
        self.settings = train_settings(scenario)
        self.corpus = _corpus(self.model.ctx_len + 2)
        self.heldout = eval_windows(self.corpus.heldout, self.model.ctx_len + 1,
                                    scenario.eval_windows)
        self.fingerprint = fingerprint(self.model)

    def learner(self, node_id: str, batch: int) -> Learner:
        return Learner(self.model, node_id, self.settings, self.corpus, batch, 1, 1)

    def heldout_loss(self, params: np.ndarray) -> float:
        """Mean held-out loss (nats/char) of a parameter vector."""
        total, n = 0.0, 0
        for start in range(0, len(self.heldout), EVAL_BATCH):
            chunk = self.heldout[start : start + EVAL_BATCH]
            total += self.model.loss(params, chunk) * len(chunk)
            n += len(chunk)
        return total / n


def charged_size(scenario: Scenario, proxy: ModelSize | None) -> ModelSize:
    if scenario.charge is not None:
        return ModelSize.from_spec(scenario.charge)
    if proxy is None:
        raise ValueError("a traffic-only scenario needs a [charge] table (the model's size)")
    return proxy


class World:
    """Engine, network and machines of one run; see the module docstring."""

    def __init__(self, scenario: Scenario, seed: int, training: Training | None = None,
                 charged: ModelSize | None = None, groups=None):
        self.scenario = scenario
        self.seed = seed
        self.engine = Engine(seed)
        self.training = training
        self.charged = charged or charged_size(scenario, training.size if training else None)
        self.bytes = ByteCharge(training.size.params if training else self.charged.params,
                                self.charged.params)
        self.network = Network(self.engine, scenario.sites)
        target = (training.settings.target_step_seconds if training
                  else float(scenario.train.get("target_step_seconds", 0.25)))
        # [train] batch/accum set by hand win over the hardware's choice, as on a real node
        fixed_batch = int(scenario.train.get("batch", 0))
        fixed_accum = int(scenario.train.get("accum", 0))
        ids = random.Random(stream_seed(seed, "node-ids"))
        nat = {s.name: s.uplink.cgnat for s in scenario.sites}
        site_index = {s.name: k for k, s in enumerate(scenario.sites)}
        self.members: list[Member] = []
        for group in groups if groups is not None else scenario.nodes:
            device = scenario.devices[group.device]
            need = self.charged.resident_bytes
            if not device.holds(need):
                raise ValueError(f"a {self.charged.name} model ({need / GIB:.3g} GiB to train) "
                                 f"does not fit in a {device.name}'s {device.memory_gib:g} GiB")
            batch, accum = device.batch(self.charged.flops_per_sample,
                                        self.charged.activation_bytes, target)
            batch, accum = fixed_batch or batch, fixed_accum or accum
            for _ in range(group.count):
                i = len(self.members)
                addr = f"10.{site_index[group.site]}.{i >> 8 & 255}.{i & 255}:7100"
                self.members.append(Member(i, device, group.site, group.medium,
                                           f"{ids.getrandbits(128):032x}", addr,
                                           nat[group.site], batch, accum))
                self.network.attach(i, group.site, group.medium,
                                    device.nic_bytes_per_second(group.medium))
        self.addr_index = {m.addr: m.index for m in self.members}

    def member_info(self, m: Member) -> MemberInfo:
        fields = {"model": "sim", "layout": self.training.fingerprint if self.training else "-",
                  "vocab": "256", "mode": "full"}
        return MemberInfo(node_id=m.node_id, addr=m.addr, device_class=m.device.name,
                          capability=m.device.capability, priority=0,
                          fingerprint=fingerprint_of(fields), fingerprint_fields=fields,
                          outbound_only=m.outbound_only)

    def failures(self) -> dict[int, list[tuple[float, float]]]:
        """Every machine's (fail, back) times for this run (empty without churn)."""
        churn = self.scenario.churn
        if not churn.failures:
            return {m.index: [] for m in self.members}
        out = {}
        for m in self.members:
            rng = random.Random(stream_seed(self.seed, f"churn/{m.index}"))
            out[m.index] = failure_schedule(rng, m.device.mttf * churn.mttf_scale,
                                            m.device.mttr * churn.mttr_scale,
                                            self.scenario.duration)
        return out

    def schedule_churn(self, fail, back, kill=None) -> None:
        """Put the scenario's churn on the engine: `fail(i)` and `back(i)` at every machine's
        failure and return, `kill(return_after)` at the leader kill (if the method has a
        leader), and the partitions with their heals."""
        engine, churn = self.engine, self.scenario.churn
        for i, spans in self.failures().items():
            for fail_at, back_at in spans:
                engine.at(fail_at, fail, i)
                engine.at(back_at, back, i)
        if kill is not None and churn.leader_kill is not None:
            engine.at(churn.leader_kill, kill, churn.leader_return)
        for p in churn.partitions:
            engine.at(p.at, self.network.partition, self.site_groups(p.groups))
            engine.at(p.heal, self.network.heal)

    def site_groups(self, sides: tuple[tuple[str, ...], ...]) -> list[list[int]]:
        """Partition groups (node indexes) from sides given as site names."""
        return [[m.index for m in self.members if m.site in side] for side in sides]

    def compute_seconds(self, m: Member, rng=None) -> float:
        """Member m's time for one step of the charged model (jittered when given an rng)."""
        return m.device.step_seconds(m.batch, self.charged.flops_per_sample, rng)

    def fastest(self, wired_first: bool = True) -> Member:
        """The machine with the most FLOP/s (wired preferred): host of the coordinator."""
        return max(self.members, key=lambda m: (not m.outbound_only, m.device.flops,
                                                wired_first and m.medium == "wired",
                                                -m.index))
