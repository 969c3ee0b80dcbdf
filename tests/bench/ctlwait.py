"""How long a small message waits behind a bulk upload on a shaped link (issue 17): the figure
behind the simulator's control lane (`sims.network.CONTROL_WAIT`).

    python -m tests.bench.ctlwait [--rate-mbit 30] [--upload-mib 40]   # needs root

Two network namespaces on a bridge (tests/netlab.py); the second host's links are shaped as
the calibration lab's WiFi profile (`tc tbf rate 30mbit burst 32kb latency 50ms`, both
ways). From that host, 1-byte TCP echoes to the first (every 20 ms, TCP_NODELAY) are timed
idle and then while a bulk upload of `--upload-mib` MiB runs to the first host on another
connection. Prints the round trips' median, 90th percentile and maximum in both cases, and
the upload's time: a FIFO of whole messages would hold an echo behind the whole upload, a
real link behind its queue's depth. Everything it creates is removed on exit.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys

from tests.netlab import NetLab, require_netns

ECHO = ("import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind(('0.0.0.0',7199));s.listen()\n"
        "while True:\n    c,_=s.accept()\n"
        "    c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
        "    while (d:=c.recv(64)):\n        c.sendall(d)\n")
SINK = ("import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind(('0.0.0.0',7198));s.listen()\n"
        "while True:\n    c,_=s.accept()\n    while c.recv(1<<16): pass\n    c.close()\n")
# connects (retrying until the server listens, 10 s at most), then times echoes for argv[2] s
PINGER = ("import socket,sys,time,statistics\nend=time.monotonic()+10\n"
          "while True:\n    try:\n"
          "        c=socket.create_connection((sys.argv[1],7199),timeout=5)\n"
          "        break\n    except OSError:\n        if time.monotonic()>end: raise\n"
          "        time.sleep(0.05)\n"
          "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\nr=[]\n"
          "stop=time.perf_counter()+float(sys.argv[2])\n"
          "while time.perf_counter()<stop:\n    t=time.perf_counter();c.sendall(b'x');c.recv(64)\n"
          "    r.append(time.perf_counter()-t);time.sleep(0.02)\n"
          "r.sort();print(len(r),statistics.median(r),r[int(0.9*(len(r)-1))],r[-1])\n")
UPLOAD = ("import socket,sys,time\nend=time.monotonic()+10\n"
          "while True:\n    try:\n        c=socket.create_connection((sys.argv[1],7198))\n"
          "        break\n    except OSError:\n        if time.monotonic()>end: raise\n"
          "        time.sleep(0.05)\n"
          "b=b'x'*(1<<20)\nt=time.perf_counter()\nfor _ in range(int(sys.argv[2])): c.sendall(b)\n"
          "c.shutdown(socket.SHUT_WR);c.recv(1);print(time.perf_counter()-t)\n")


def echoes(net: NetLab, seconds: float) -> str:
    out = net.run(1, [sys.executable, "-c", PINGER, net.addr(0), f"{seconds:g}"],
                  capture_output=True, text=True, check=True)
    n, median, p90, worst = out.stdout.split()
    return (f"{int(n)} echoes: median {float(median) * 1e3:.2f} ms, 90th percentile "
            f"{float(p90) * 1e3:.2f} ms, at most {float(worst) * 1e3:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=30.0)
    ap.add_argument("--upload-mib", type=int, default=40)
    args = ap.parse_args(argv)
    require_netns()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup runs on SIGTERM too
    with NetLab(2, "cw") as net:
        for i in range(2):
            net.run(i, ["ip", "route", "add", "default", "dev", "eth0"], check=True)
        shape = ["tbf", "rate", f"{args.rate_mbit:g}mbit", "burst", "32kb", "latency", "50ms"]
        net.run(1, ["tc", "qdisc", "add", "dev", "eth0", "root", *shape], check=True)
        subprocess.run(["tc", "qdisc", "add", "dev", net.veth_host(1), "root", *shape],
                       check=True)
        net.popen(0, [sys.executable, "-c", ECHO])
        net.popen(0, [sys.executable, "-c", SINK])
        print(f"idle: {echoes(net, 3.0)}")
        upload = net.popen(1, [sys.executable, "-c", UPLOAD, net.addr(0), str(args.upload_mib)],
                           stdout=subprocess.PIPE, text=True)
        busy = echoes(net, 6.0)
        took, _ = upload.communicate(timeout=600)
        print(f"during a {args.upload_mib} MiB upload at {args.rate_mbit:g} Mbit/s "
              f"(it took {float(took):.1f} s): {busy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
