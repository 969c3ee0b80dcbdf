"""Calibration of the simulator against real nodes (issue 17): the same small swarm run both
ways, and the figures side by side.

    python -m tests.bench.calibrate [--config default|gradients|both] [--seconds 60]
                                    [--repeats 1] [--target-loss 2.05] [--json OUT]
                                    [--no-overhead]

Real: four `p2ptrain join` processes, one per network namespace on a bridge (tests/netlab.py),
a swarm key of their own, mDNS off. Links are shaped with `tc tbf` (the namespace's eth0
egress is the uplink, the host-side veth egress the downlink) and loss added with iptables
`statistic` (this kernel has no netem, so no delay can be added):

    host  site  profile    up / down Mbit/s   loss   reachable
    h0    lab   wired      unshaped            -      yes (the others' seed)
    h1    lab   WiFi       30 / 30             -      yes
    h2    lab   WiFi       30 / 30             -      yes
    h3    farm  Starlink   15 / 100            1%     outbound-only (inbound SYNs dropped: CGNAT)

Simulated: the same four machines in `sims` (gossip.py: the real protocol `Node`s, the same
model, batch, learning rate, timing preset and gossip settings), every latency set to the
TCP round trip measured between the namespaces before the nodes start, the links as above
(each host a wired NIC at its profile's rate; the farm behind a Starlink uplink with the
same rates, the loss and CGNAT, no reconfiguration bursts since the lab has none), and each
machine's step time the mean compute time its real node reported in this very run
(`/v1/status` steps: 4 processes share 2 cores, so this is the shared-CPU time, not a
quiet-machine figure) plus its host overhead, also observed in this run: the wall time per
step beyond the gradient (update, mixing, codecs, event loop, HTTP), given to the device as
`overhead` (`--no-overhead`: the gradient's time only, as the simulator charged before).

Figures, both measured from the swarm's first step: swarm samples/s (whole run, and steady
state from 10 s), message bytes sent per node per second (median over nodes; the real
side also gives eth0's bytes, with TCP/IP and HTTP overhead), time until the mean held-out
loss of the replicas reaches the target, and per node: step time, steps, samples/s, bytes/s.
Every namespace, veth, bridge and process is removed on exit, also on failure or Ctrl-C.
This file measures; it changes neither the node nor the simulator.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.netlab import NetLab
from tests.swarmlab import SwarmLab, get_json

PORT = 7100
OBSERVER_HOST = 254
MODEL = {"n_layer": 2, "n_embd": 64, "ctx_len": 32}  # 141k parameters: 0.56 MB fp32
BATCH = 32
LR = 4e-3
WARMUP = 3200
EVAL_WINDOWS = 32
CHECKPOINT_SECONDS = 10.0
STEADY_FROM = 10.0  # s after the first step: the steady-state window starts
# host -> (site, profile, up Mbit/s, down Mbit/s, packet loss, outbound-only); None: unshaped
HOSTS = [("lab", "wired", None, None, 0.0, False),
         ("lab", "wifi", 30.0, 30.0, 0.0, False),
         ("lab", "wifi", 30.0, 30.0, 0.0, False),
         ("farm", "starlink", 15.0, 100.0, 0.01, True)]
UNSHAPED_MBPS = 10_000.0  # what the simulator gives an unshaped veth
CONFIGS = {  # [gossip] of the node and the simulator's method knobs
    "default": {},  # averaging only: 10% of coordinates in fp16 every 5 steps
    "gradients": {"fanout": 1, "codec": "fp16"},  # plus every gradient to one peer, fp16
}


def swarm_toml(gossip: dict) -> str:
    lines = ["[model]", 'name = "rwkv"', "[model.rwkv]"]
    lines += [f"{k} = {v}" for k, v in MODEL.items()]
    lines += ["[train]", f"batch = {BATCH}", f"lr = {LR}", f"warmup_samples = {WARMUP}",
              "total_samples = 100000000", "[eval]", f"windows = {EVAL_WINDOWS}",
              "every_seconds = 1", "[net]", 'timing = "local"', "[checkpoint]",
              f"every_seconds = {CHECKPOINT_SECONDS}", "[gossip]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in gossip.items()]
    return "\n".join(lines) + "\n"


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


# -- the lab ----------------------------------------------------------------------------------


def build(net: NetLab) -> str:
    """Observer address, default routes, tbf shaping, loss and the CGNAT firewall."""
    observer = str(net.subnet.network_address + OBSERVER_HOST)
    sh("ip", "addr", "add", f"{observer}/{net.subnet.prefixlen}", "dev", net.bridge)
    for i, (_site, _prof, up, down, loss, nat) in enumerate(HOSTS):
        ns = net.ns(i)
        sh("ip", "-n", ns, "route", "add", "default", "dev", "eth0")
        if up is not None:
            sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
               f"{up:g}mbit", "burst", "32kb", "latency", "50ms")
            sh("tc", "qdisc", "add", "dev", net.veth_host(i), "root", "tbf", "rate",
               f"{down:g}mbit", "burst", "32kb", "latency", "50ms")
        ipt = ["ip", "netns", "exec", ns, "iptables"]
        if loss:
            sh(*ipt, "-A", "INPUT", "!", "-s", observer, "-m", "statistic", "--mode", "random",
               "--probability", f"{loss}", "-j", "DROP")
            sh(*ipt, "-A", "OUTPUT", "!", "-d", observer, "-m", "statistic", "--mode",
               "random", "--probability", f"{loss}", "-j", "DROP")
        if nat:
            sh(*ipt, "-A", "INPUT", "-p", "tcp", "--syn", "-s", observer, "-j", "ACCEPT")
            sh(*ipt, "-A", "INPUT", "-p", "tcp", "--syn", "-j", "DROP")
    return observer


ECHO = ("import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind(('0.0.0.0',7199));s.listen()\nc,_=s.accept()\n"
        "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
        "while (d:=c.recv(64)):\n    c.sendall(d)\n")
PINGER = ("import socket,sys,time,statistics\n"
          "c=socket.create_connection((sys.argv[1],7199),timeout=5)\n"
          "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\nr=[]\n"
          "for _ in range(400):\n    t=time.perf_counter();c.sendall(b'x');c.recv(64)\n"
          "    r.append(time.perf_counter()-t)\nprint(statistics.median(r))\n")


def measure_rtt(net: NetLab, src: int, dst: int) -> float:
    """Median TCP round trip (s) of one byte from host src to host dst (idle links)."""
    echo = net.popen(dst, [sys.executable, "-c", ECHO])
    try:
        for _ in range(50):
            done = net.run(src, [sys.executable, "-c", PINGER, net.addr(dst)], check=False)
            if done.returncode == 0:
                return float(done.stdout.strip())
            time.sleep(0.1)
        raise RuntimeError(f"no echo from host {dst}: {done.stderr[-500:]}")
    finally:
        echo.kill()
        echo.wait()


def tx_bytes(net: NetLab, i: int) -> int:
    out = net.run(i, ["ip", "-s", "-j", "link", "show", "dev", "eth0"]).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def run_real(gossip: dict, seconds: float, tmp: Path) -> dict:
    """The four real nodes for `seconds` after the first step; their figures."""
    with NetLab(len(HOSTS), prefix="cal") as net, \
            SwarmLab(tmp, swarm_toml(gossip), name="calib") as lab:
        observer = build(net)
        rtt = {"lab": measure_rtt(net, 0, 1), "farm": measure_rtt(net, 3, 0)}
        seed = f"{net.addr(0)}:{PORT}"
        procs = []
        for i, (_site, _prof, _up, _down, _loss, nat) in enumerate(HOSTS):
            args = ["--duration", str(seconds + 60)] + (["--outbound-only"] if nat else [])
            proc = lab.start(f"n{i}", PORT, [] if i == 0 else [seed], *args,
                             env=lab.env(P2PTRAIN_NODE_JOIN_TIMEOUT="5"),
                             prefix=["ip", "netns", "exec", net.ns(i)], bind="0.0.0.0")
            proc.addr = f"{net.addr(i)}:{PORT}"
            procs.append(proc)
        polls: list[tuple[float, list[dict]]] = []
        wire0: list[int] | None = None
        origin = None
        deadline = time.monotonic() + 60
        while True:
            for p in procs:
                if not p.alive():
                    raise RuntimeError(f"{p.addr} exited:\n{p.output()[-3000:]}")
            try:
                docs = [get_json(p.addr, timeout=2) for p in procs]
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            now = time.monotonic()
            if origin is None and any(d.get("samples", 0) > 0 for d in docs):
                origin = polls[-1][0] if polls else now  # the last poll before any step
                wire0 = [tx_bytes(net, i) for i in range(len(procs))]
            if origin is None and now > deadline:
                raise RuntimeError("no node took a step within 60 s")
            if origin is not None:
                polls.append((now, docs))
                if now - origin >= seconds:
                    break
            else:
                polls = [(now, docs)]
            time.sleep(0.5)
        wire = [tx_bytes(net, i) - wire0[i] for i in range(len(procs))]
        lab.stop_all()
    del observer
    return {"rtt": rtt, "origin": origin, "polls": polls, "wire": wire}


def real_figures(run: dict, target: float) -> dict:
    origin, polls = run["origin"], run["polls"]
    t_end, last = polls[-1][0] - origin, polls[-1][1]
    first = polls[0][1]
    steady = next((p for p in polls if p[0] - origin >= STEADY_FROM), polls[0])
    curve, reached = [], None
    for t, docs in polls:
        losses = [d["eval_loss"] for d in docs if d.get("eval_loss") is not None]
        if len(losses) == len(docs):
            mean = sum(losses) / len(losses)
            curve.append((t - origin, mean))
            if reached is None and mean <= target:
                reached = t - origin
    nodes = []
    for k, (d0, d1) in enumerate(zip(first, last, strict=True)):
        steps = d1["steps"]
        compute = steps["seconds"] / max(1, steps["count"])
        taken = d1["step"] - d0["step"]
        nodes.append({"step_seconds": compute, "steps": taken,
                      "overhead": max(0.0, t_end / max(1, taken) / compute - 1.0),
                      "upload_bytes_per_s": (d1["upload_bytes"] - d0["upload_bytes"]) / t_end,
                      "samples_per_s": (d1["samples"] - d0["samples"]) / t_end,
                      "bytes_per_s": (d1["bytes_out"] - d0["bytes_out"]) / t_end,
                      "wire_bytes_per_s": run["wire"][k] / t_end,
                      "gossip": d1.get("gossip", {}), "runtime": d1.get("runtime", {})})
    total = sum(d["samples"] for d in last) - sum(d["samples"] for d in first)
    steady_total = sum(d["samples"] for d in last) - sum(d["samples"] for d in steady[1])
    return {"seconds": t_end, "samples_per_s": total / t_end,
            "steady_samples_per_s": steady_total / (polls[-1][0] - steady[0]),
            "bytes_per_node_s": statistics.median(n["bytes_per_s"] for n in nodes),
            "wire_bytes_per_node_s": statistics.median(n["wire_bytes_per_s"] for n in nodes),
            "time_to_target": reached, "final_loss": curve[-1][1] if curve else None,
            "nodes": nodes, "curve": curve, "rtt": run["rtt"]}


# -- the simulator ----------------------------------------------------------------------------


def scenario_doc(gossip: dict, rtt: dict[str, float], step_seconds: list[float],
                 seconds: float, target: float, overheads: list[float] | None = None) -> dict:
    """The sims scenario of this lab: the measured RTT as latency, the measured step times."""
    from sims.charge import ModelSize, build_model_from

    fps = ModelSize.of(build_model_from("rwkv", dict(MODEL))).flops_per_sample
    one_way_ms = rtt["lab"] / 2 * 1e3
    farm_extra_ms = max(0.0, rtt["farm"] - rtt["lab"]) / 2 * 1e3
    leg_ms = one_way_ms / 2  # every path crosses two legs (source NIC, destination NIC)
    fast = {"kind": "fibre", "up_mbps": UNSHAPED_MBPS, "down_mbps": UNSHAPED_MBPS,
            "latency_ms": 0.0, "jitter_ms": 0.0}
    farm_host = next(h for h in HOSTS if h[0] == "farm")
    starlink = {"kind": "starlink", "up_mbps": farm_host[2], "down_mbps": farm_host[3],
                "latency_ms": farm_extra_ms / 2, "jitter_ms": 0.0, "cgnat": farm_host[5],
                "loss": farm_host[4], "reconfig_period": 0.0, "burst_loss": 0.0,
                "burst_seconds": 0.0, "burst_latency_ms": 0.0}
    devices, nodes = {}, []
    overheads = overheads or [0.0] * len(HOSTS)
    for i, ((site, _prof, up, _down, _loss, _nat), step, over) in enumerate(
            zip(HOSTS, step_seconds, overheads, strict=True)):
        rate = UNSHAPED_MBPS if up is None or site == "farm" else up
        devices[f"h{i}"] = {"profile": "server", "matmul_gflops": BATCH * fps / step / 1e9,
                            "efficiency": 1.0, "wired_mbps": rate, "overhead": over}
        nodes.append({"device": f"h{i}", "count": 1, "site": site, "medium": "wired"})
    return {
        "name": "calibrate", "seed": 1, "duration": seconds, "target_loss": target,
        "eval_every": 0.25, "eval_windows": EVAL_WINDOWS,
        "model": {"model": "rwkv", **MODEL},
        "train": {"batch": BATCH, "lr": LR, "warmup_samples": WARMUP,
                  "total_samples": 100_000_000},
        "protocol": {"preset": "local", "checkpoint_interval": CHECKPOINT_SECONDS},
        "sites": [{"name": "lab", "uplink": fast, "wired_latency_ms": leg_ms},
                  {"name": "farm", "uplink": starlink, "wired_latency_ms": leg_ms}],
        "devices": devices, "nodes": nodes,
        "methods": [{"name": "gossip", "kind": "gossip", "min_peers": 1, "join_timeout": 5.0,
                     **gossip}]}


def run_sim(doc: dict, seed: int) -> dict:
    from sims.fleet import Training, World
    from sims.gossip import GossipSim
    from sims.scenario import parse

    scenario = parse(doc)
    world = World(scenario, seed, Training(scenario))
    sim = GossipSim(world, scenario.methods[0])
    samples_at: list[tuple[float, list[int]]] = []

    def sample() -> None:
        samples_at.append((world.engine.now, [m.node.learner.samples if m.node else 0
                                              for m in sim.machines]))
        world.engine.after(0.05, sample)

    world.engine.at(0.0, sample)
    result = sim.run()
    origin = next(t for t, s in samples_at if sum(s) > 0) - 0.05  # the last sample before
    end = result["simulated_seconds"]
    t_end = end - origin
    steady = next(s for t, s in samples_at if t - origin >= STEADY_FROM)
    steady_t = next(t for t, s in samples_at if t - origin >= STEADY_FROM)
    final = [m.node.learner.samples for m in sim.machines]
    sent = [world.network.traffic.sent[m.index] for m in world.members]
    reached = next((t - origin for t, mean, *_ in result["curve"]
                    if mean is not None and mean <= doc["target_loss"] and t >= origin), None)
    emitted = [sum(sim.machines[m.index].node.bytes_out.values()) for m in world.members]
    nodes = [{"step_seconds": world.compute_seconds(m), "steps": sim.machines[m.index].node
              .learner.step, "samples_per_s": final[m.index] / t_end,
              "bytes_per_s": emitted[m.index] / t_end, "sent_bytes_per_s": sent[m.index] / t_end}
             for m in world.members]
    return {"seconds": t_end, "samples_per_s": sum(final) / t_end,
            "steady_samples_per_s": (sum(final) - sum(steady)) / (end - steady_t),
            "bytes_per_node_s": statistics.median(n["bytes_per_s"] for n in nodes),
            "sent_bytes_per_node_s": statistics.median(n["sent_bytes_per_s"] for n in nodes),
            "time_to_target": reached, "final_loss": result["final_loss"], "nodes": nodes,
            "gossip_stats": result.get("gossip_stats"),
            "dropped": result.get("dropped_messages")}


# -- the comparison ---------------------------------------------------------------------------


def ratio(sim, real) -> str:
    return "–" if not sim or not real else f"{sim / real:.2f}"


def table(name: str, real: dict, sim: dict) -> str:
    def t(x):
        return "not reached" if x is None else f"{x:.1f} s"
    rows = [("swarm samples/s (whole run)", real["samples_per_s"], sim["samples_per_s"], "{:.0f}"),
            ("swarm samples/s (steady, from 10 s)", real["steady_samples_per_s"],
             sim["steady_samples_per_s"], "{:.0f}"),
            ("message bytes/node/s emitted (median)", real["bytes_per_node_s"],
             sim["bytes_per_node_s"], "{:.4g}"),
            ("bytes/node/s on the link (real: eth0, with TCP/HTTP)",
             real["wire_bytes_per_node_s"], sim["sent_bytes_per_node_s"], "{:.4g}")]
    out = [f"**{name}** (real: {real['seconds']:.0f} s from the first step; RTT lab "
           f"{real['rtt']['lab'] * 1e3:.3f} ms, farm {real['rtt']['farm'] * 1e3:.3f} ms)", "",
           "| figure | real | simulated | sim/real |", "|---|---:|---:|---:|"]
    for label, r, s, fmt in rows:
        out.append(f"| {label} | {fmt.format(r)} | {fmt.format(s)} | {ratio(s, r)} |")
    out.append(f"| time to target | {t(real['time_to_target'])} | {t(sim['time_to_target'])} | "
               f"{ratio(sim['time_to_target'], real['time_to_target'])} |")
    out += ["", "| host | gradient s (+ host overhead) | samples/s real / sim | emitted B/s "
            "real / sim | link B/s real eth0 / sim |", "|---|---:|---:|---:|---:|"]
    for i, (r, s) in enumerate(zip(real["nodes"], sim["nodes"], strict=True)):
        out.append(f"| h{i} {HOSTS[i][1]} | {r['step_seconds'] * 1e3:.1f} ms "
                   f"(+{r['overhead']:.0%}) | {r['samples_per_s']:.0f} / "
                   f"{s['samples_per_s']:.0f} ({ratio(s['samples_per_s'], r['samples_per_s'])})"
                   f" | {r['bytes_per_s']:.4g} / {s['bytes_per_s']:.4g} "
                   f"({ratio(s['bytes_per_s'], r['bytes_per_s'])}) | "
                   f"{r['wire_bytes_per_s']:.4g} / {s['sent_bytes_per_s']:.4g} "
                   f"({ratio(s['sent_bytes_per_s'], r['wire_bytes_per_s'])}) |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=[*CONFIGS, "both"], default="both")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--target-loss", type=float, default=2.05)
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--no-overhead", dest="overhead", action="store_false",
                    help="charge the simulated steps the gradient's time only (the old model)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup runs on SIGTERM too
    names = list(CONFIGS) if args.config == "both" else [args.config]
    doc = []
    for rep in range(args.repeats):
        for name in names:
            with open("/proc/loadavg") as f:
                load = f.read().split()[:3]
            with tempfile.TemporaryDirectory(prefix="calib-") as tmp:
                run = run_real(CONFIGS[name], args.seconds, Path(tmp))
            real = real_figures(run, args.target_loss)
            steps = [n["step_seconds"] for n in real["nodes"]]
            overheads = [n["overhead"] for n in real["nodes"]] if args.overhead else None
            scn = scenario_doc(CONFIGS[name], run["rtt"], steps, real["seconds"],
                               args.target_loss, overheads)
            sim = run_sim(scn, seed=1 + rep)
            print(f"\n## {name}, repeat {rep + 1} (load average before: {' '.join(load)}; "
                  f"simulated step = measured gradient time"
                  f"{' + measured host overhead' if args.overhead else ' only'})\n")
            print(table(name, real, sim), flush=True)
            doc.append({"config": name, "repeat": rep, "load": load, "real": real, "sim": sim,
                        "scenario": scn})
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
