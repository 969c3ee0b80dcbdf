"""Baseline (a): the seed's central coordinator -- an asynchronous parameter server.

The coordinator runs on the fastest wired machine that accepts connections and holds the
only copy of the weights, with AdamW. Every machine (the coordinator's own included, over
loopback) runs a worker that loops: take the weights it pulled, compute a gradient on its
batch (real numpy on the proxy; the device's modelled time for the charged model), encode it
with the configured codec (the same codecs and error feedback as gossip) and push it; the
coordinator's reply to the push carries the current weights (push and pull in one round
trip, as the runtime's responses do). Bytes on the wire: the exact encoded size of the
gradient under the codec and of the weights under the pull codec (`fp32`, `fp16` or `bf16`),
for the charged model, plus a small header.

The coordinator applies each gradient as it arrives -- or, with `accumulate_samples`, sums
batch-weighted gradients until that many samples are in and then takes one step -- and drops
gradients computed on weights more than `max_staleness` updates old. Its update costs
`update_seconds_per_param` x parameters of its CPU (a FIFO, like a link). It checkpoints every
`checkpoint_interval` of the protocol config; when it dies (a leader kill, or its machine's
failure) training stops; if it comes back it restarts from that checkpoint. A message lost
on the way (a lossy link) is sent again after TCP's retransmission timeout; a worker whose
request is refused (the coordinator is down) or cut off by a partition asks again `retry`
seconds later. Pure: virtual time, seeds only.
"""

from __future__ import annotations

import numpy as np

from p2ptrain.codecs import ErrorFeedback, make_codec, parse_message
from p2ptrain.optim import clip_global_norm
from p2ptrain.proto import PlainEncoder
from sims.charge import vector_bytes
from sims.engine import stream_seed
from sims.fleet import World, proto_config
from sims.links import Resource
from sims.metrics import Recorder
from sims.network import RETRANSMIT_SECONDS
from sims.scenario import Method

HEADER_BYTES = 256  # request line, MAC and framing around a push or a pull
KNOBS = {"codec", "codec_params", "error_feedback", "pull", "max_staleness",
         "accumulate_samples", "retry", "update_seconds_per_param"}


class Worker:
    __slots__ = ("generation", "index", "learner", "encoder", "version", "request")

    def __init__(self, index: int):
        self.index = index
        self.generation = 0
        self.learner = None
        self.encoder = None
        self.version = 0  # coordinator version of the weights it computes on
        self.request = 0  # id of the request awaiting an answer


class CoordinatorSim:
    """One parameter-server run; `run()` returns the result row."""

    def __init__(self, world: World, method: Method):
        unknown = sorted(set(method.params) - KNOBS)
        if unknown:
            raise ValueError(f"coordinator method: unknown knob(s) {', '.join(unknown)}")
        p = method.params
        self.world, self.engine, self.network = world, world.engine, world.network
        self.training = world.training
        self.recorder = Recorder(method.name, method.kind, p, world.scenario.target_loss)
        self.codec = make_codec(p.get("codec", "topk"), **p.get("codec_params",
                                                                {"fraction": 0.01}))
        self.error_feedback = bool(p.get("error_feedback", True)) and self.codec.biased
        self.pull = make_codec({"fp32": "none"}.get(p.get("pull", "fp32"), p.get("pull", "fp32")))
        self.max_staleness = p.get("max_staleness")
        self.accumulate = int(p.get("accumulate_samples", 0))
        self.retry = float(p.get("retry", 5.0))
        n = world.charged.params
        self.push_bytes = vector_bytes(self.codec, n) + HEADER_BYTES
        self.pull_bytes = vector_bytes(self.pull, n) + HEADER_BYTES
        self.host = world.fastest()
        per_param = float(p.get("update_seconds_per_param", 1 / 3e9))
        self.cpu = Resource("coordinator:cpu", 1.0 / per_param if per_param > 0 else 1.0, "cpu")
        self.update_seconds = per_param * n
        self.checkpoint_every = proto_config(world.scenario).checkpoint_interval
        self.ps = self.training.learner(self.host.node_id, 1)
        self.ps_alive = True
        self.ps_generation = 0
        self.version = 0
        self.samples = 0  # samples applied (the schedule's count)
        self.acc = np.zeros_like(self.ps.params)
        self.acc_samples = 0
        self.scratch = np.zeros_like(self.ps.params)
        self.saved = self._snapshot()
        self.dropped_stale = 0
        self.workers = [Worker(m.index) for m in world.members]

    # -- the coordinator ------------------------------------------------------------------

    def _snapshot(self) -> tuple:
        opt = self.ps.opt
        # what a checkpoint carries: the weights, or with train.ema their average
        return (self.ps.checkpoint_weights.copy(), opt.m.copy(), opt.v.copy(), opt.t,
                self.version, self.samples)

    def _checkpoint(self, generation: int) -> None:
        if self.ps_alive and generation == self.ps_generation:
            self.saved = self._snapshot()
            self.engine.after(self.checkpoint_every, self._checkpoint, generation)

    def kill(self, back_after: float | None) -> None:
        if not self.ps_alive:
            return
        self.ps_alive = False
        self.ps_generation += 1
        self.recorder.extra.setdefault("coordinator_deaths", []).append(self.engine.now)
        if back_after is not None:
            self.engine.after(back_after, self.revive)

    def revive(self) -> None:
        if self.ps_alive:
            return
        params, m, v, t, self.version, self.samples = self.saved
        opt = self.ps.opt
        np.copyto(self.ps.params, params)
        self.ps.restart_average()  # as a node's restore
        np.copyto(opt.m, m)
        np.copyto(opt.v, v)
        opt.t = t
        self.acc.fill(0.0)
        self.acc_samples = 0
        self.ps_alive = True
        self.engine.after(self.checkpoint_every, self._checkpoint, self.ps_generation)

    def _receive_push(self, w: Worker, gen: int, req: int, msgs, version: int,
                      batch: int) -> None:
        if not self.ps_alive:
            self._refused(w, gen)
            return
        if self.max_staleness is not None and self.version - version > self.max_staleness:
            self.dropped_stale += 1
        else:
            self.scratch.fill(0.0)
            for msg in msgs:
                parse_message(msg).decode_into(self.scratch)
            self.acc += batch * self.scratch
            self.acc_samples += batch
            if self.acc_samples >= max(self.accumulate, 1):
                self._apply()
        done = self.engine.now
        if self.update_seconds > 0:
            _, done = self.cpu.serve(done, self.world.charged.params)
        self.engine.at(done, self._reply, w, gen, req)

    def _apply(self) -> None:
        grad = self.acc
        grad *= 1.0 / self.acc_samples
        clip_global_norm(grad, self.ps.grad_clip)
        self.ps.opt.step(self.ps.params, grad, self.ps.schedule.lr(self.samples))
        self.ps.update_average()  # train.ema
        self.version += 1
        self.samples += self.acc_samples
        self.recorder.applied_samples = self.samples
        grad.fill(0.0)
        self.acc_samples = 0

    def _reply(self, w: Worker, gen: int, req: int) -> None:
        """Send the current weights to worker w (the answer to its push or pull)."""
        if not self.ps_alive:
            self._refused(w, gen)
            return
        weights = self.ps.params.copy() if self.pull.name == "none" else (
            self.pull.decode(self.pull.encode(self.ps.params), self.ps.params.shape[0]))
        version = self.version
        self._send(self.host.index, w.index, self.pull_bytes, "weights",
                   lambda: self._weights(w, gen, req, weights, version),
                   lambda: self._refused(w, gen), reply=True)

    # -- workers --------------------------------------------------------------------------

    def _send(self, src: int, dst: int, size: int, kind: str, deliver, failed,
              reply: bool = False) -> None:
        self.recorder.sent(kind, size)
        if src == dst:  # loopback on the coordinator's own machine
            self.engine.after(0.0, deliver)
            return
        def lost() -> None:  # TCP resends what a lossy link lost: a delay, not a failure
            self.engine.after(RETRANSMIT_SECONDS, self._send, src, dst, size, kind, deliver,
                              failed, reply)

        if not self.network.send(src, dst, size, deliver, reply=reply,
                                 bulk=size > HEADER_BYTES, on_lost=lost, on_cut=failed):
            failed()

    def _refused(self, w: Worker, gen: int) -> None:
        """The worker's exchange failed (refused or lost): it asks again later."""
        if gen == w.generation:
            self.recorder.extra["retries"] = self.recorder.extra.get("retries", 0) + 1
            self.engine.after(self.retry, self._pull, w, gen)

    def start_worker(self, w: Worker) -> None:
        m = self.world.members[w.index]
        w.generation += 1
        w.learner = self.training.learner(m.node_id, m.batch)
        w.encoder = (ErrorFeedback(self.codec, w.learner.params.shape[0])
                     if self.error_feedback else PlainEncoder(self.codec))
        self._pull(w, w.generation)

    def stop_worker(self, w: Worker) -> None:
        w.generation += 1
        w.learner = None
        if w.index == self.host.index:
            self.kill(None)

    def _pull(self, w: Worker, gen: int) -> None:
        if gen != w.generation:
            return
        w.request += 1
        req = w.request
        self._send(w.index, self.host.index, HEADER_BYTES, "pull",
                   lambda: self._reply(w, gen, req), lambda: self._refused(w, gen))

    def _weights(self, w: Worker, gen: int, req: int, weights: np.ndarray, version: int) -> None:
        if gen != w.generation or req != w.request:
            return
        learner = w.learner
        np.copyto(learner.params, weights)
        w.version = version
        loss = learner.compute_gradient()
        m = self.world.members[w.index]
        self.recorder.samples += m.batch
        rng = self.engine.rng(f"compute/{w.index}")
        seconds = self.world.compute_seconds(m, rng)
        self.engine.after(seconds, self._computed, w, gen, loss)

    def _computed(self, w: Worker, gen: int, loss: float) -> None:
        if gen != w.generation:
            return
        learner = w.learner
        self.recorder.steps += 1
        if not np.isfinite(loss):
            self._pull(w, gen)
            return
        seed = stream_seed(self.world.seed, f"push/{w.index}/{self.recorder.steps}")
        msgs = [bytes(b) for b in w.encoder.encode_vector(
            learner.grad, sender_id=bytes.fromhex(learner.node_id), swarm_samples=self.samples,
            weight=float(learner.batch), seed=seed)]
        w.request += 1
        req, version, batch = w.request, w.version, learner.batch
        self._send(w.index, self.host.index, self.push_bytes, "gradient",
                   lambda: self._receive_push(w, gen, req, msgs, version, batch),
                   lambda: self._refused(w, gen))

    # -- running --------------------------------------------------------------------------

    def deliverable_loss(self) -> float:
        """The held-out loss of what the server's checkpoints carry (its weights, or with
        `train.ema` their average); while it is down, of the weights it last saved."""
        params = self.ps.checkpoint_weights if self.ps_alive else self.saved[0]
        return self.training.heldout_loss(params)

    def evaluate(self) -> None:
        self.recorder.point(self.engine.now, [self.deliverable_loss()])
        if self.samples >= self.training.settings.total_samples:
            self.recorder.ended_at = self.engine.now
            self.engine.stop()
            return
        self.engine.after(self.world.scenario.eval_every, self.evaluate)

    def run(self) -> dict:
        world, engine, scenario = self.world, self.engine, self.world.scenario
        for w in self.workers:
            self.start_worker(w)
        engine.after(self.checkpoint_every, self._checkpoint, self.ps_generation)
        world.schedule_churn(lambda i: self.stop_worker(self.workers[i]),
                             lambda i: self._back(self.workers[i]), self.kill)
        engine.at(0.0, self.evaluate)
        engine.run_until(scenario.duration)
        curve = self.recorder.curve
        if self.recorder.ended_at is None and (not curve or curve[-1][0] != engine.now):
            self.recorder.point(engine.now, [self.deliverable_loss()])
        host = self.network.endpoints[self.host.index]
        self.recorder.extra.update({
            "coordinator": {"index": self.host.index, "device": self.host.device.name,
                            "site": self.host.site, "medium": self.host.medium},
            "coordinator_link": _host_link(self.network, host, engine.now),
            "coordinator_cpu_utilisation": self.cpu.utilisation(engine.now),
            "stale_dropped": self.dropped_stale, "updates": self.version})
        return self.recorder.result(world, engine.now)

    def _back(self, w: Worker) -> None:
        if w.index == self.host.index:
            self.revive()
        self.start_worker(w)


def _host_link(network, host, until: float) -> dict:
    """Utilisation of the coordinator's own link (its NIC sides, or its site's air)."""
    if host.tx is not None:
        return {"tx": host.tx.utilisation(until), "rx": host.rx.utilisation(until)}
    return {"air": network.air[host.site.name].utilisation(until)}
