"""How much the simulator's proxy gains from pooling samples (issue 17: can the seed-regime
tables show a fleet ahead of one server at all?).

    python -m tests.bench.proxybatch [--scenario seed-1b-lora] [--target 2.2] [--seed 1]
                                     [--batches 1,4,16] [--lrs 4e-3,8e-3,16e-3]
                                     [--replicas 3,8] [--every 1,10] [--max-steps 4000]

The scenario's proxy model (sims/fleet.py `Training`: the model, corpus, held-out windows and
[train] settings a simulated node uses), trained here in one process with p2ptrain's own
Learner, no simulator:

1. one learner at each batch and learning rate: steps (and samples) until the held-out loss
   is at or below the target, checked every 25 steps -- a batch that needs B times fewer
   steps than batch 1 pools its samples for free, one that needs more samples has passed the
   proxy's critical batch;
2. R replicas at batch 1 (the same start, their own data) whose parameters are replaced by
   their mean every k steps: steps until the mean reaches the target. R replicas averaged
   every step at the fleet's step rate is the ceiling of what parameter averaging can do.
3. `--fleet`: the scenario's machines (those whose step time is at most `--slowest`
   seconds: the charged model's step times and batches, as sims.run.fleet_summary gives
   them) train in simulated seconds with no communication cost; every `--period` seconds
   either all replicas are replaced by their mean weighted by the samples each took in the
   period ("all": a perfect all-reduce of parameters) or a random matching pairs them up
   and each pair moves by `pull_share` of their sample rates, pull at most 0.9 ("pairs": the
   gossip default's exchange until 2026-12-02, without its bandwidth). Time to the target
   of the mean ("all") or of a fastest machine's replica ("pairs": the leader is a
   server), checked every 20 simulated seconds, as the scenario's evaluation. Mode "grads"
   is the ideal of data parallelism instead: one parameter vector, each machine's gradient
   computed on it as it was at the first tick after the machine's previous step ended (at
   most one period late), and every `--period` seconds one AdamW step with the
   batch-weighted mean of the gradients completed since (none: no step), crediting their
   samples to the schedule; with `--topk F` the gradients of all but the fastest device
   class are top-k F with error feedback (what a compressed push from them carries), the
   fastest class's whole. `--swarm-count` runs the all/pairs replicas' schedules on the
   samples of all of them, as a swarm's count does (without it each counts its own).

It prints one line per run; nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from p2ptrain.codecs.sparse import TopK
from p2ptrain.learner import Learner
from p2ptrain.proto.gossip.averaging import pull_share
from sims.fleet import Training
from sims.run import fleet_summary
from sims.scenario import load

CHECK_EVERY = 25  # steps between held-out evaluations
FLEET_CHECK = 20.0  # simulated seconds between evaluations of a fleet run
PULL_MAX = 0.9  # "pairs" pull as the default did until 2026-12-02 (rates to the power 1)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def steps_alone(training: Training, batch: int, lr: float, target: float,
                max_steps: int) -> tuple[int | None, float]:
    """(steps to the target or None, the last held-out loss) of one learner."""
    settings = dataclasses.replace(training.settings, lr=lr)
    learner = Learner(training.model, "a1", settings, training.corpus, batch, 1, 1)
    loss = float("inf")
    for step in range(1, max_steps + 1):
        learner.train_step()
        if step % CHECK_EVERY == 0:
            loss = training.heldout_loss(learner.params)
            if loss <= target:
                return step, loss
    return None, loss


def steps_averaged(training: Training, replicas: int, every: int, lr: float, target: float,
                   max_steps: int) -> tuple[int | None, float]:
    """(steps to the target or None, the last loss) of `replicas` batch-1 learners whose
    parameters are replaced by their mean every `every` steps (the mean is evaluated)."""
    settings = dataclasses.replace(training.settings, lr=lr)
    learners = [Learner(training.model, f"a{i + 1}", settings, training.corpus, 1, 1, 1)
                for i in range(replicas)]
    for other in learners[1:]:
        np.copyto(other.params, learners[0].params)
    mean = np.empty_like(learners[0].params)
    loss = float("inf")
    for step in range(1, max_steps + 1):
        for learner in learners:
            learner.train_step()
        if step % every == 0 or step % CHECK_EVERY == 0:
            np.copyto(mean, learners[0].params)
            for learner in learners[1:]:
                mean += learner.params
            mean /= replicas
            if step % every == 0:
                for learner in learners:
                    np.copyto(learner.params, mean)
        if step % CHECK_EVERY == 0:
            loss = training.heldout_loss(mean)
            if loss <= target:
                return step, loss
    return None, loss


def fleet_time(training: Training, step_seconds: list[float], period: float, mode: str,
               lr: float, target: float, horizon: float, seed: int,
               batches: list[int] | None = None, check: float = FLEET_CHECK,
               ema: float = 0.0, swarm_count: bool = False) -> tuple[float | None, float]:
    """(simulated seconds to the target or None, the last loss) of one replica per entry of
    `step_seconds` (fastest first; `batches`: each one's batch, 1 if not given), mixed every
    `period` seconds by `mode` ("all" / "pairs"), evaluated every `check` seconds; with
    `ema` (`train.ema`) what is evaluated is the first replica's average of its weights.
    With `swarm_count` every replica's learning-rate schedule runs on the samples of all of
    them (merged every period, as a swarm's count is); without, on its own samples only (a
    longer warm-up: how the entries of 2026-12-02/03 were measured)."""
    settings = dataclasses.replace(training.settings, lr=lr, ema=ema)
    batches = batches or [1] * len(step_seconds)
    learners = [Learner(training.model, f"f{i + 1}", settings, training.corpus, b, 1, 1)
                for i, b in enumerate(batches)]
    for other in learners[1:]:
        np.copyto(other.params, learners[0].params)
    rng = np.random.default_rng(seed)
    due = list(step_seconds)  # when each replica's next step completes
    mean = np.empty_like(learners[0].params)
    now, next_check, loss = 0.0, check, float("inf")
    while now < horizon:
        now += period
        steps = np.zeros(len(learners))
        for i, learner in enumerate(learners):
            while due[i] <= now:
                learner.train_step()
                steps[i] += 1
                due[i] += step_seconds[i]
        if swarm_count:
            for learner in learners:
                for other in learners:
                    learner.count.merge(other.count.as_dict())
        if mode == "all" and steps.sum() > 0:
            mean.fill(0.0)
            samples = steps * np.asarray(batches)
            for w, learner in zip(samples / samples.sum(), learners, strict=True):
                if w:
                    mean += np.float32(w) * learner.params
            for learner in learners:
                np.copyto(learner.params, mean)
        elif mode == "pairs":
            order = rng.permutation(len(learners))
            for a, b in zip(order[::2], order[1::2], strict=False):
                ra, rb = batches[a] / step_seconds[a], batches[b] / step_seconds[b]
                pa, pb = pull_share(ra, rb, PULL_MAX), pull_share(rb, ra, PULL_MAX)
                diff = learners[b].params - learners[a].params
                learners[a].params += np.float32(pa) * diff
                learners[b].params -= np.float32(pb) * diff
            np.copyto(mean, learners[0].params)
        if now >= next_check:
            next_check += check
            loss = training.heldout_loss(learners[0].checkpoint_weights if ema > 0 else mean)
            if loss <= target:
                return now, loss
    return None, loss


def _top_k(values: np.ndarray, fraction: float) -> np.ndarray:
    """`values` with all but the coordinates the `topk` codec keeps (its largest `fraction`
    by magnitude) zeroed, in place."""
    kept = TopK(fraction=fraction, exact=True).select(values)
    sent = values[kept]
    values.fill(0.0)
    values[kept] = sent
    return values


def pooled_time(training: Training, step_seconds: list[float], batches: list[int],
                period: float, lr: float, target: float, horizon: float,
                check: float = FLEET_CHECK, ema: float = 0.0, topk: float = 1.0,
                seed: int = 1) -> tuple[float | None, float]:
    """Mode "grads" (see the module docstring): (simulated seconds to the target or None,
    the last loss) of one parameter vector stepped every `period` seconds with the gradients
    the machines (`step_seconds`, fastest first, and `batches`) completed; with `topk` < 1
    the machines slower than the first one send their gradients top-k with error feedback.
    `seed` names the machines, so it draws their data (the samples each one trains on)."""
    settings = dataclasses.replace(training.settings, lr=lr, ema=ema)
    shared = Learner(training.model, "p0", settings, training.corpus, batches[0], 1, 1)
    workers = [Learner(training.model, f"s{seed}p{i + 1}", settings, training.corpus, b, 1, 1)
               for i, b in enumerate(batches)]
    residual = [np.zeros_like(shared.params) for _ in workers]

    def begin(i: int, at: float) -> tuple[float, np.ndarray, float]:
        np.copyto(workers[i].params, shared.params)
        loss = workers[i].compute_gradient()
        grad = workers[i].grad.copy()
        if topk < 1.0 and step_seconds[i] > step_seconds[0]:
            grad += residual[i]
            sent = _top_k(grad.copy(), topk)
            np.subtract(grad, sent, out=residual[i])
            grad = sent
        return at + step_seconds[i], grad, loss

    flight = [begin(i, 0.0) for i in range(len(workers))]  # each step: (ends, grad, loss)
    now, next_check, loss = 0.0, check, float("inf")
    while now < horizon:
        now += period
        finished = [i for i, (ends, _, _) in enumerate(flight) if ends <= now]
        if finished:
            weight = sum(batches[i] for i in finished)
            shared.grad.fill(0.0)
            for i in finished:
                shared.grad += np.float32(batches[i] / weight) * flight[i][1]
            shared.batch = weight  # the step credits the pooled samples (the LR schedule's count)
            shared.apply_gradient(shared.grad, float(np.mean([flight[i][2] for i in finished])))
            for i in finished:  # the next step starts on the updated vector
                flight[i] = begin(i, flight[i][0])
        if now >= next_check:
            next_check += check
            loss = training.heldout_loss(shared.checkpoint_weights)
            if loss <= target:
                return now, loss
    return None, loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="seed-1b-lora")
    parser.add_argument("--target", type=float, default=None,
                        help="held-out loss to reach (default: the scenario's target)")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--lrs", default="4e-3,8e-3,16e-3")
    parser.add_argument("--replicas", default="3,8", help="replica counts to average")
    parser.add_argument("--every", default="1,10", help="steps between averagings")
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--fleet", action="store_true",
                        help="only the fleet runs (3.): the scenario's machines, mixed ideally")
    parser.add_argument("--slowest", default="1,3,5",
                        help="fleet runs: the machines whose step takes at most this (s)")
    parser.add_argument("--period", default="4.45,1", help="fleet runs: seconds between mixes")
    parser.add_argument("--modes", default="all,pairs",
                        help="fleet runs: all, pairs and/or grads (data parallelism)")
    parser.add_argument("--horizon", type=float, default=1500.0,
                        help="fleet runs: simulated seconds at most")
    parser.add_argument("--seed", type=int, default=1,
                        help="fleet runs: the matchings' seed (grads runs: the machines' data)")
    parser.add_argument("--check", type=float, default=FLEET_CHECK,
                        help="fleet runs: simulated seconds between evaluations")
    parser.add_argument("--first", type=int, default=0,
                        help="fleet runs: only the N fastest machines of those chosen (0: all)")
    parser.add_argument("--ema", type=float, default=0.0,
                        help="fleet runs: train.ema of every replica; the first replica's "
                             "average is evaluated (0: off, the mean or its weights)")
    parser.add_argument("--topk", type=float, default=1.0,
                        help="grads runs: the share of each gradient the machines slower "
                             "than the fastest send, top-k with error feedback (1: whole)")
    parser.add_argument("--swarm-count", action="store_true",
                        help="all/pairs runs: every replica's LR schedule counts the samples "
                             "of all (as a swarm's count does; grads runs always do)")
    args = parser.parse_args(argv)
    if not (args.check > 0 and args.first >= 0 and 0 < args.topk <= 1):
        parser.error("--check must be > 0, --first >= 0 and --topk in (0, 1]")
    if not set(args.modes.split(",")) <= {"all", "pairs", "grads"}:
        parser.error(f"--modes: all, pairs and/or grads, not {args.modes!r}")
    scenario = load(args.scenario)
    target = args.target if args.target is not None else scenario.target_loss
    training = Training(scenario)
    print(f"proxy of {args.scenario}: {training.model.space.n_params:,} parameters, target "
          f"{target}, evaluated every {CHECK_EVERY} steps on {len(training.heldout)} windows")
    if args.fleet:
        groups = sorted(fleet_summary(scenario, args.seed)["groups"],
                        key=lambda g: g["step_seconds"])
        for slowest in _floats(args.slowest):
            chosen = [g for g in groups if g["step_seconds"] <= slowest]
            times = [g["step_seconds"] for g in chosen for _ in range(g["count"])]
            batches = [g["batch"] for g in chosen for _ in range(g["count"])]
            if args.first > 0:
                times, batches = times[: args.first], batches[: args.first]
            names = ", ".join(f"{g['count']} {g['device']} (b{g['batch']}, "
                              f"{g['step_seconds']:g} s)" for g in chosen)
            for period in _floats(args.period):
                for mode in args.modes.split(","):
                    for lr in _floats(args.lrs):
                        t0 = time.perf_counter()
                        if mode == "grads":
                            when, loss = pooled_time(training, times, batches, period, lr,
                                                     target, args.horizon, args.check,
                                                     args.ema, args.topk, args.seed)
                        else:
                            when, loss = fleet_time(training, times, period, mode, lr,
                                                    target, args.horizon, args.seed, batches,
                                                    args.check, args.ema, args.swarm_count)
                        print(f"fleet {mode:5s} every {period:g} s lr {lr:g} of "
                              f"{len(times)}: {names}: "
                              f"{when if when is None else f'{when:.0f} s'} (last loss "
                              f"{loss:.3f}, {time.perf_counter() - t0:.0f} s)", flush=True)
        return
    for batch in _ints(args.batches):
        for lr in _floats(args.lrs):
            t0 = time.perf_counter()
            steps, loss = steps_alone(training, batch, lr, target, args.max_steps)
            samples = "-" if steps is None else f"{steps * batch:,}"
            print(f"alone      batch {batch:3d} lr {lr:g}: steps {steps} samples {samples} "
                  f"(last loss {loss:.3f}, {time.perf_counter() - t0:.0f} s)", flush=True)
    for replicas in _ints(args.replicas):
        for every in _ints(args.every):
            for lr in _floats(args.lrs):
                t0 = time.perf_counter()
                steps, loss = steps_averaged(training, replicas, every, lr, target,
                                             args.max_steps)
                print(f"averaged   {replicas} replicas every {every:2d} lr {lr:g}: steps "
                      f"{steps} (last loss {loss:.3f}, {time.perf_counter() - t0:.0f} s)",
                      flush=True)


if __name__ == "__main__":
    main()
