"""The `p2ptrain` command line: argument parsing and error reporting for every subcommand.

Each option flag maps to a configuration key (p2ptrain/config.py), so flags, `P2PTRAIN_*`
variables and the TOML file stay in step. Subcommand modules are imported only when used, so
`--help` is quick. Problems a user can fix print one line and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from p2ptrain import __version__

EXIT_USAGE = 2


def _limit_blas_threads() -> None:
    """Inside a CPU-limited container, BLAS would start one thread per *host* core and thrash:
    size its pool to the cgroup quota before numpy loads, unless the user set it."""
    if any(v in os.environ for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        return
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            cores = max(1, int(int(quota) / int(period)))
            os.environ["OPENBLAS_NUM_THREADS"] = str(cores)
    except (OSError, ValueError):
        pass


def _add_option_flags(parser: argparse.ArgumentParser, keys: list[str]) -> None:
    from p2ptrain.config import OPTIONS

    for key in keys:
        o = OPTIONS[key]
        shown = [c if c else "'' (none)" for c in o.choices or ()]
        extra = f" (one of: {', '.join(shown)})" if shown else ""
        text = f"{o.help}{extra} [env {o.env}; default {o.default!r}]"
        if o.kind is bool:
            parser.add_argument(o.flag, dest=f"opt:{key}", default=None, action="store_const",
                                const="true", help=text)
        elif key == "net.peers":
            parser.add_argument(o.flag, dest=f"opt:{key}", default=None, action="append",
                                metavar="HOST:PORT", help=f"{text}; repeatable")
        else:
            parser.add_argument(o.flag, dest=f"opt:{key}", default=None,
                                metavar=key.split(".")[-1].upper(), help=text)


def _positive(text: str) -> float:
    """A finite number of seconds > 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number > 0")
    return value


def _add_no_mdns(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-mdns", dest="opt:net.mdns", action="store_const", const="false",
                        default=None, help="do not use mDNS; find peers by --peer only "
                        "[env P2PTRAIN_NET_MDNS=false]")


SWARM_KEYS = ["swarm.token", "swarm.token_file"]
NET_KEYS = ["net.port", "net.bind", "net.advertise", "net.peers", "net.outbound_only",
            "net.max_upload_mbps", "node.priority", "node.alone"]
JOIN_KEYS = ["model.name", "model.preset", "model.init_from", "train.mode", "lora.base",
             "lora.rank", "data.path", "node.state_dir",
             "train.batch", "train.lr", "train.seed", "train.steps", "train.duration",
             "log.format"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="p2ptrain",
        description="Peer-to-peer training for fleets of mismatched machines: nodes find "
        "each other by mDNS, average parameters by gossip (compressed: int8 by default; "
        "compressed gradient pushes too, if switched on), and elect a leader that writes and "
        "serves checkpoints.",
        epilog="Configuration: flags override P2PTRAIN_* environment variables, which override "
        "the TOML file (--config or P2PTRAIN_CONFIG), which overrides the defaults. "
        "See `p2ptrain config show`.",
    )
    p.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    join = sub.add_parser("join", help="join a swarm and train (the main job)", description=(
        "Join a swarm and train the model with its members. With no arguments: the public "
        "demo swarm on this LAN (found by mDNS), the built-in RWKV model on the built-in Tiny "
        "Shakespeare, batch size chosen from the hardware, checkpoints in "
        "~/.p2ptrain/checkpoints, resuming from the newest valid one. A real fleet: "
        "`p2ptrain init` once, then `join --token TOKEN` on every machine. Ctrl-C stops "
        "cleanly (a second Ctrl-C at once)."))
    join.add_argument("--config", help="TOML configuration file [env P2PTRAIN_CONFIG]")
    _add_option_flags(join, SWARM_KEYS + NET_KEYS + JOIN_KEYS)
    _add_no_mdns(join)

    init = sub.add_parser("init", help="create a swarm: its configuration, key and join token",
                          description="Write the swarm's configuration (swarm.toml, edit it "
                          "before the first join) and a 256-bit key (swarm.key, mode 0600) "
                          "into --out, and print the join token and join commands.")
    init.add_argument("--name", default=None,
                      help="swarm name (letters, digits, - _; default: --config's "
                           "swarm.name, else p2ptrain)")
    init.add_argument("--out", default=None, help="directory to write (default ./swarm-NAME)")
    init.add_argument("--config", help="TOML file with the settings the swarm should start from")
    _add_option_flags(init, ["model.name"])

    status = sub.add_parser("status", help="show a node's view of the swarm", description=(
        "Members (id, address, device class, state, step, loss, samples, bytes in/out, "
        "RTT), the leader and term, and the swarm's sample count, as one node sees them."))
    status.add_argument("--peer", default=None, metavar="HOST:PORT",
                        help="the node to ask (default 127.0.0.1:7100)")
    status.add_argument("--json", action="store_true", help="one JSON document on stdout")

    ckpt = sub.add_parser("checkpoint", help="checkpoint tools")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    fetch = ckpt_sub.add_parser("fetch", help="download the leader's latest checkpoint",
                                description="Find the swarm's leader (by mDNS, or through "
                                "--peer), download its latest checkpoint from the leader and "
                                "every member that holds it, all at once, verify the leader's "
                                "signature and every chunk, resume after an interruption, and "
                                "write the checkpoint directory into --out atomically. A bar "
                                "with rate and ETA on a terminal, a line every 5 s otherwise.")
    fetch.add_argument("--peer", default=None, help="a node of the swarm, HOST:PORT")
    fetch.add_argument("--config", help="the swarm's configuration file (instead of --token)")
    fetch.add_argument("--out", default=".", help="directory to write the checkpoint into")
    fetch.add_argument("--timeout", type=_positive, default=30.0,
                       help="seconds to look for the leader (default 30)")
    fetch.add_argument("--weights-only", action="store_true",
                       help="fetch model.safetensors only, not the optimiser state (enough to "
                       "sample, export or fine-tune; not to resume the run)")
    fetch.add_argument("--leader-only", action="store_true",
                       help="fetch from the leader alone, not from every holder")
    _add_option_flags(fetch, SWARM_KEYS)
    _add_no_mdns(fetch)

    from p2ptrain.cli.loracmds import BASE_HELP, add_merge_parser

    add_merge_parser(ckpt_sub)

    sample = sub.add_parser("sample", help="generate text from a checkpoint", description=(
        "Print text generated by the model in a checkpoint directory (or a state directory: "
        "its newest valid checkpoint)."))
    sample.add_argument("--checkpoint", required=True, metavar="PATH",
                        help="a checkpoint directory, or a state directory (its newest)")
    sample.add_argument("--base", default=None, metavar="PATH", help=BASE_HELP)
    sample.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    sample.add_argument("--length", type=int, default=400,
                        help="tokens to generate -- bytes for a byte-level model (default 400)")
    sample.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature; lower is more conservative (default 0.8)")
    sample.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    sample.add_argument("--raw", action="store_true",
                        help="write the generated bytes as they are (default: as safe text: "
                        "invalid UTF-8 replaced, control characters escaped)")

    hw = sub.add_parser("hw", help="show detected hardware and the batch size it gives",
                        description="Show what this machine has (cores, memory, float32 "
                        "matmul speed, architecture) and the batch size and step time the "
                        "model would train at here.")
    hw.add_argument("--json", action="store_true", help="one JSON document on stdout")
    hw.add_argument("--config", help="TOML configuration file (model and target step time)")
    _add_option_flags(hw, ["model.name", "model.preset"])

    bench = sub.add_parser("bench", help="measure training and codec speed", description=(
        "Without a target: training tokens/s of the model, its achieved FLOP/s, and this "
        "machine's float32 1024x1024 matmul FLOP/s at the same thread count, with their ratio. "
        "`bench codecs`: codec encode/decode throughput against memcpy."))
    bench.add_argument("target", nargs="?", choices=["model", "codecs"], default="model")
    bench.add_argument("--size", type=int, default=None,
                       help="codecs: vector length (default 100M); model: batch size (default 32)")
    bench.add_argument("--seconds", type=_positive, default=10.0,
                       help="model: time to measure (default 10)")
    bench.add_argument("--repeats", type=int, default=3,
                       help="codecs: runs per codec; the median is reported")
    bench.add_argument("--json", action="store_true", help="one JSON document on stdout")
    _add_option_flags(bench, ["model.name"])

    config = sub.add_parser("config", help="show the effective configuration")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the effective configuration as TOML, "
                                 "with where each value came from", description=(
                                     "The configuration `join` would run with, as TOML: each "
                                     "value with where it came from (flag, environment, file "
                                     "or default). A flag overrides the environment, which "
                                     "overrides the file, which overrides the default."))
    show.add_argument("--config", help="TOML configuration file [env P2PTRAIN_CONFIG]")
    _add_option_flags(show, SWARM_KEYS + NET_KEYS + JOIN_KEYS)
    _add_no_mdns(show)

    from p2ptrain.cli.datacmds import add_data_parser
    from p2ptrain.cli.keycmds import add_key_parser
    from p2ptrain.cli.modelcmds import add_export_parser

    add_export_parser(sub)
    add_data_parser(sub)
    add_key_parser(sub)
    return p


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  extra: list[str]) -> None:
    """Exit 2 naming the arguments the chosen (sub)command does not take, with its usage and
    the flag it most likely meant."""
    import difflib

    chosen = parser
    while True:  # down the subcommands the arguments chose
        subs = [a for a in chosen._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None:
            break
        chosen = subs[0].choices[name]
    flags = [f for a in chosen._actions for f in a.option_strings]
    near = difflib.get_close_matches(extra[0].split("=")[0], flags, n=1)
    chosen.error(f"unrecognized arguments: {' '.join(extra)}"
                 + (f" (did you mean {near[0]}?)" if near else ""))


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # (also while the parser is built: imports take a moment)
        print("p2ptrain: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    _limit_blas_threads()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser (its usage, a close flag), not the top one
        _unrecognized(parser, args, extra)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from p2ptrain.cli import commands

    # numpy's floating-point warnings (a run blowing up): a dozen source lines each before
    # the one line that says what happened -- the divergence check reports it
    warnings.filterwarnings("ignore", r"(overflow|invalid value|divide by zero|underflow) "
                            r"encountered", RuntimeWarning)
    try:
        return commands.dispatch(args)
    except commands.USER_ERRORS as exc:
        print(f"p2ptrain: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError as exc:  # numpy's too-big allocation says how much it wanted
        hint = ("a smaller --size" if getattr(args, "command", None) == "bench" else
                "`p2ptrain hw` shows the largest model this machine holds: choose a smaller "
                "model, --batch or train.accum")
        print(f"p2ptrain: error: out of memory ({str(exc) or 'an allocation failed'}); {hint}",
              file=sys.stderr)
        return 1
    except BrokenPipeError:  # `p2ptrain config show | head`: the reader left, as for `cat`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        return 128 + 13


if __name__ == "__main__":
    sys.exit(main())
