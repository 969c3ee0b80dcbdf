"""The real `p2ptrain` command in subprocesses: training, resuming, bad input, sample, show."""

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import REPO, cli_env, run_cli
from tests.swarmlab import wait_for

pytestmark = [pytest.mark.processes]


def events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_join_trains_checkpoints_and_resumes(tmp_path, small_mlp_config):
    state = tmp_path / "state"
    args = ["join", "--config", str(small_mlp_config), "--state-dir", str(state),
            "--log-format", "json", "--steps", "30"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    ev = events(first.stdout)
    assert any(e["event"] == "start" for e in ev) and ev[-1]["event"] == "stopped"
    assert ev[-1]["step"] == 30 and ev[-1]["eval_loss"] < 5.0
    assert any(e["event"] == "checkpoint" and e["final"] for e in ev)
    second = run_cli(*args)
    assert second.returncode == 0, second.stderr
    ev2 = events(second.stdout)
    assert any(e["event"] == "resumed" and e["step"] == 30 for e in ev2)
    assert ev2[-1]["step"] == 60


@pytest.mark.parametrize("args,env,message", [
    (["join", "--data", "/definitely/missing.txt"], {},
     "data path /definitely/missing.txt does not exist"),
    (["join", "--batch", "many"], {}, "train.batch = 'many' is not valid"),
    (["join", "--model", "gpt9"], {}, "one of rwkv, mlp"),
    (["join"], {"P2PTRAIN_BACH": "3"}, "unknown variable P2PTRAIN_BACH"),
    (["join", "--config", "/nope.toml"], {}, "config file /nope.toml does not exist"),
    (["sample", "--checkpoint", "/nope"], {}, "does not exist"),
])
def test_bad_input_is_one_line_without_traceback(tmp_path, args, env, message):
    state = ["--state-dir", str(tmp_path)] if args[0] == "join" else []
    r = run_cli(*args, *state, env=cli_env(**env), timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in r.stderr


def test_empty_corpus_and_config_typo(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    r = run_cli("join", "--data", str(empty), "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 2 and "is empty" in r.stderr and "Traceback" not in r.stderr
    typo = tmp_path / "typo.toml"
    typo.write_text("[train]\nlearning_rate = 0.1\n")
    r = run_cli("join", "--config", str(typo), "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 2 and "unknown key 'train.learning_rate'" in r.stderr


def test_checkpoint_of_another_model_shape_is_refused(tmp_path, small_mlp_config):
    state = tmp_path / "state"
    assert run_cli("join", "--config", str(small_mlp_config), "--state-dir", str(state),
                   "--steps", "2").returncode == 0
    r = run_cli("join", "--config", str(small_mlp_config), "--state-dir", str(state),
                "--steps", "2", env=cli_env(P2PTRAIN_MODEL_MLP_N_HIDDEN="48"))
    assert r.returncode == 2 and "another model" in r.stderr and "n_hidden=32" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_sample_prints_generated_text(tmp_path, small_mlp_config):
    state = tmp_path / "state"
    assert run_cli("join", "--config", str(small_mlp_config), "--state-dir", str(state),
                   "--steps", "5").returncode == 0
    r = subprocess.run([sys.executable, "-m", "p2ptrain", "sample", "--checkpoint", str(state),
                        "--prompt", "ROMEO:", "--length", "50", "--raw"], capture_output=True,
                       env=cli_env(), cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b"ROMEO:") and len(r.stdout) == len("ROMEO:") + 50 + 1
    # without --raw: text a terminal shows as text, whatever bytes a barely trained model
    # emits (invalid UTF-8, ESC and other control characters)
    r = subprocess.run([sys.executable, "-m", "p2ptrain", "sample", "--checkpoint", str(state),
                        "--length", "400", "--temperature", "3"], capture_output=True,
                       env=cli_env(), cwd=REPO, timeout=120)
    text = r.stdout.decode("utf-8")  # valid UTF-8
    assert r.returncode == 0 and all(ch in "\n\t" or ch.isprintable() for ch in text)


def test_printable_escapes_what_could_drive_a_terminal():
    from p2ptrain.sample import Printable

    p = Printable()
    out = p.feed(b"ab\x1b[31mc\xc3") + p.feed(b"\xa9\xff\x07\tz\n", final=True)
    assert out == "ab\\x1b[31mc\u00e9\ufffd\\x07\tz\n"


def test_config_show_takes_the_join_flags_and_masks_the_token():
    r = run_cli("config", "show", "--peer", "10.0.0.9:7100", "--outbound-only", "--port",
                "7200", "--token", "p2pt1.x.secretsecret", "--max-upload-mbps", "2")
    assert r.returncode == 0, r.stderr
    for line in ('peers = "10.0.0.9:7100"', "outbound_only = true", "port = 7200",
                 "max_upload_mbps = 2.0", 'token = "<secret>"'):
        assert line in r.stdout, line
    assert "secretsecret" not in r.stdout


def test_config_show_hw_and_bench_json(tmp_path):
    r = run_cli("config", "show", "--batch", "12", env=cli_env(P2PTRAIN_LR="0.01"))
    assert r.returncode == 0
    assert "batch = 12" in r.stdout and "# flag --batch" in r.stdout
    assert "# env P2PTRAIN_LR" in r.stdout
    r = run_cli("hw", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["cpus"] >= 1 and doc["batch"] >= 1 and doc["matmul_gflops"] > 0
    from p2ptrain import memplan  # the largest trainable size, from the memory model

    assert doc["largest_trainable"] == memplan.largest_here(doc["memory_bytes"])
    assert doc["largest_trainable"]["alone"]["params"] > 1e6
    text = run_cli("hw").stdout
    assert "largest trainable here" in text and "as a swarm node" in text
    r = run_cli("bench", "--model", "mlp", "--seconds", "0.5", "--size", "8", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["tokens_per_s"] > 0 and doc["ratio"] > 0  # timings: no bound


def test_sigterm_stops_cleanly_with_a_final_checkpoint(tmp_path, small_mlp_config):
    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2ptrain", "join", "--config", str(small_mlp_config),
         "--state-dir", str(state), "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        env=cli_env(P2PTRAIN_LOG_EVERY_SECONDS="0.1"))
    try:
        deadline = time.monotonic() + 120
        seen = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(json.loads(line))
            if seen[-1]["event"] == "progress":
                break
        assert seen and seen[-1]["event"] == "progress", seen
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    ev = events(out)
    assert any(e["event"] == "checkpoint" and e["final"] for e in ev)
    assert ev[-1]["event"] == "stopped" and ev[-1]["reason"] == "SIGTERM"


def test_checkpoint_fetch_from_a_dead_port_says_so(tmp_path):
    assert run_cli("init", "--out", str(tmp_path / "sw"), timeout=60).returncode == 0
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_cli("checkpoint", "fetch", "--peer", f"127.0.0.1:{port}", "--config",
                str(tmp_path / "sw" / "swarm.toml"), "--timeout", "1", "--out",
                str(tmp_path / "out"), timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"nothing listens at 127.0.0.1:{port} (connection refused)" in r.stderr, r.stderr


def test_checkpoint_fetch_without_a_token_says_it_looked_for_the_demo_swarm(tmp_path):
    r = run_cli("checkpoint", "fetch", "--timeout", "1", "--out", str(tmp_path / "out"),
                env=cli_env(P2PTRAIN_NET_MDNS="false"), timeout=60)  # no mDNS: nothing leaves
    assert r.returncode == 2 and "no --token or --config" in r.stderr, r.stderr
    assert "give your swarm's token or config" in r.stderr


def test_checkpoint_fetch_checks_what_it_can_before_the_network(tmp_path):
    """--no-mdns and no --peer said "no leader found by mDNS within 4s" at once; an --out that
    is a file failed with a raw errno, blamed on the leader, after the fetch had started."""
    assert run_cli("init", "--out", str(tmp_path / "sw"), timeout=60).returncode == 0
    config = str(tmp_path / "sw" / "swarm.toml")
    r = run_cli("checkpoint", "fetch", "--config", config, "--no-mdns", "--timeout", "30",
                "--out", str(tmp_path / "out"), timeout=60)
    assert r.returncode == 2 and "--no-mdns leaves nothing" in r.stderr, r.stderr
    (tmp_path / "file").write_text("x")
    r = run_cli("checkpoint", "fetch", "--config", config, "--peer", "127.0.0.1:9", "--out",
                str(tmp_path / "file"), "--timeout", "30", timeout=60)
    assert r.returncode == 2 and "a file is there" in r.stderr, r.stderr
    assert "127.0.0.1:9" not in r.stderr


def test_init_leaves_lora_mode_defaults_unset_so_a_later_mode_gets_its_own(tmp_path):
    """swarm.toml from `init` must not pin full training's ema and fast share: a swarm
    switched to LoRA mode later (flag or file) gets LoRA mode's defaults, and a value the
    user set is written as set."""
    import tomllib

    assert run_cli("init", "--out", str(tmp_path / "sw"), timeout=60).returncode == 0
    conf = tmp_path / "sw" / "swarm.toml"
    assert "ema" not in tomllib.loads(conf.read_text())["train"]
    conf = str(conf)

    def shown(*extra):
        r = run_cli("config", "show", "--config", *extra, timeout=60)
        assert r.returncode == 0, r.stderr
        t = tomllib.loads(r.stdout)
        return t["train"]["ema"], t["gossip"]["average_fast_share"]

    assert shown(conf) == (0.0, 0.5)
    assert shown(conf, "--mode", "lora") == (0.99, 1.0)
    mine = tmp_path / "mine.toml"
    mine.write_text("[train]\nema = 0.95\n")
    assert run_cli("init", "--config", str(mine), "--out", str(tmp_path / "sw2"),
                   timeout=60).returncode == 0
    conf2 = tmp_path / "sw2" / "swarm.toml"
    assert tomllib.loads(conf2.read_text())["train"]["ema"] == 0.95
    conf2 = str(conf2)
    assert shown(conf2, "--mode", "lora") == (0.95, 1.0)


def test_config_show_takes_every_join_flag_no_mdns_too():
    r = run_cli("config", "show", "--no-mdns", timeout=60)
    assert r.returncode == 0, r.stderr
    assert any(line.startswith("mdns = false") and line.endswith("# flag --no-mdns")
               for line in r.stdout.splitlines()), r.stdout


@contextlib.contextmanager
def _answering(www: Path, status: str):
    """A plain HTTP server on loopback whose GET /v1/status answers `status`; its address."""
    (www / "v1").mkdir(parents=True)
    (www / "v1" / "status").write_text(status)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                               "--directory", str(www), str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for("the status server to listen", listening, timeout=30)
        yield f"127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("status", ["<html>not json</html>", '{"leader": "a", "members": 7}',
                                    '{"leader": ["a"], "node_id": "a", "holds": "x"}'])
def test_checkpoint_fetch_from_a_host_answering_nonsense_says_so(tmp_path, status):
    """/v1/status needs no key, so anything on the LAN may answer it: a clear error, no
    traceback."""
    assert run_cli("init", "--out", str(tmp_path / "sw"), timeout=60).returncode == 0
    with _answering(tmp_path / "www", status) as addr:
        r = run_cli("checkpoint", "fetch", "--peer", addr, "--config",
                    str(tmp_path / "sw" / "swarm.toml"), "--timeout", "2", "--out",
                    str(tmp_path / "out"), timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "no leader of swarm" in r.stderr, r.stderr


def test_status_of_a_host_answering_odd_json_shows_what_it_can(tmp_path):
    """`status` printed a traceback for a document without a node id, a member that is not
    an object, or a holding that is not one (KeyError, AttributeError, TypeError)."""
    odd = '{"node_id": 7, "holds": 5, "members": [5, {"node_id": "\\u001b[31mx", "rtt_ms": "s"}]}'
    with _answering(tmp_path / "www", odd) as addr:
        r = run_cli("status", "--peer", addr, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "?[31mx" in r.stdout and "\x1b" not in r.stdout, r.stdout


def test_init_takes_the_name_from_its_config_names_what_it_leaves_out_and_errs_in_a_line(
        tmp_path):
    start = tmp_path / "start.toml"
    start.write_text('[swarm]\nname = "fromfile"\n[train]\nbatch = 8\nlr = 0.01\n')
    r = run_cli("init", "--config", str(start), "--out", str(tmp_path / "s"))
    assert r.returncode == 0, r.stderr
    assert "swarm 'fromfile'" in r.stdout  # used to be 'p2ptrain', the file's name ignored
    assert "train.batch" in r.stderr and "per node" in r.stderr  # said, not silently dropped
    assert "lr = 0.01" in (tmp_path / "s" / "swarm.toml").read_text()
    (tmp_path / "afile").write_text("x")
    r = run_cli("init", "--out", str(tmp_path / "afile"))
    assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr


def test_token_files_with_a_byte_order_mark_or_not_text(tmp_path):
    r = run_cli("init", "--out", str(tmp_path / "s"))
    token = next(w for w in r.stdout.split() if w.startswith("p2pt"))
    (tmp_path / "bom").write_bytes(b"\xef\xbb\xbf" + token.encode() + b"\r\n")
    (tmp_path / "bad").write_bytes(b"\xff\xfe\x00")
    peer = ("--peer", "127.0.0.1:1", "--timeout", "1", "--out", str(tmp_path / "o"))
    r = run_cli("checkpoint", "fetch", "--token-file", str(tmp_path / "bom"), *peer)
    assert "nothing listens" in r.stderr, r.stderr  # the token was read; no node there
    r = run_cli("checkpoint", "fetch", "--token-file", str(tmp_path / "bad"), *peer)
    assert r.returncode == 2 and "is not text" in r.stderr
    (tmp_path / "empty").write_text("\n")  # an empty Docker secret: not the demo swarm
    r = run_cli("join", "--token-file", str(tmp_path / "empty"), "--bind", "127.0.0.1",
                "--state-dir", str(tmp_path / "st"), "--steps", "1", timeout=120,
                env=cli_env(P2PTRAIN_ALONE="false", P2PTRAIN_NET_MDNS="false"))
    assert r.returncode == 2 and "is empty" in r.stderr, r.stderr[-500:]
    for how in (("--token", ""), ("--token", "  ")):  # `--token "$UNSET"`: likewise
        r = run_cli("join", *how, "--bind", "127.0.0.1", "--state-dir", str(tmp_path / "st"),
                    "--steps", "1", timeout=120,
                    env=cli_env(P2PTRAIN_ALONE="false", P2PTRAIN_NET_MDNS="false"))
        assert r.returncode == 2 and "token (flag --token) is empty" in r.stderr, r.stderr
    r = run_cli("checkpoint", "fetch", *peer, env=cli_env(P2PTRAIN_TOKEN=""))
    assert r.returncode == 2 and "token (env P2PTRAIN_TOKEN) is empty" in r.stderr, r.stderr
    # but an empty variable beside a configured key (compose's `${P2PTRAIN_TOKEN}` unset) is
    # no token given: the config's key is used
    r = run_cli("checkpoint", "fetch", "--config", str(tmp_path / "s" / "swarm.toml"), *peer,
                env=cli_env(P2PTRAIN_TOKEN=""))
    assert "nothing listens" in r.stderr, r.stderr


def test_a_reader_that_leaves_early_is_no_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "p2ptrain", "config", "show"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(),
                            cwd=REPO)
    proc.stdout.read(10)
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    proc.wait(60)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_model_too_big_for_memory_is_a_clear_error(tmp_path):
    """Under a 3 GB address-space limit the 1.5B preset cannot be allocated: a numpy
    MemoryError traceback, before; now one line pointing at `p2ptrain hw`."""
    r = subprocess.run(["prlimit", "--as=3000000000", sys.executable, "-m", "p2ptrain", "join",
                        "--alone", "--preset", "rwkv-1b5", "--steps", "1", "--state-dir",
                        str(tmp_path / "s")], capture_output=True, text=True, env=cli_env(),
                       cwd=REPO, timeout=300)
    assert r.returncode == 1 and "out of memory" in r.stderr and "p2ptrain hw" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("temperature", ["nan", "-1"])
def test_sample_refuses_a_temperature_that_is_no_finite_number(temperature):
    r = run_cli("sample", "--temperature", temperature, "--length", "5")
    assert r.returncode == 2 and "--temperature" in r.stderr and "Traceback" not in r.stderr


def test_a_port_in_use_or_a_port_in_bind_says_what_to_do(tmp_path):
    import socket

    from p2ptrain.net.neterrors import listen_error

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("join", "--bind", "127.0.0.1", "--port", str(port), "--steps", "1",
                    "--state-dir", str(tmp_path / "st"),
                    env=cli_env(P2PTRAIN_ALONE="false", P2PTRAIN_NET_MDNS="false"))
    assert r.returncode == 2 and "choose another --port" in r.stderr, r.stderr[-500:]
    said = listen_error(OSError(99, "Cannot assign requested address"), "127.0.0.1:7100", 7100)
    assert "the port is --port" in said


def test_ctrl_c_while_the_cli_starts_is_one_line(monkeypatch, capsys):
    """Ctrl-C in the first half second (while the parser's modules load) printed a
    traceback: the interrupt came before the `try` that reports it."""
    from p2ptrain.cli import main as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["hw"]) == 130
    assert capsys.readouterr().err == "p2ptrain: interrupted\n"


@pytest.mark.parametrize("argv, usage, hint", [
    (["join", "--prot", "7101"], "usage: p2ptrain join", "did you mean --port?"),
    (["checkpoint", "fetch", "--weigths-only"], "usage: p2ptrain checkpoint fetch",
     "did you mean --weights-only?"),
    (["status", "extra"], "usage: p2ptrain status", "unrecognized arguments: extra\n"),
])
def test_a_mistyped_flag_is_told_by_its_subcommand(argv, usage, hint, capsys):
    """It printed the top-level usage (`p2ptrain [-h] [--version] COMMAND ...`) and no hint."""
    from p2ptrain.cli import main as cli

    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith(usage) and hint in err, err


def test_sample_refuses_weights_that_are_not_finite(tmp_path):
    """A checkpoint (signed by whoever wrote it) with a NaN head gave a traceback in the
    sampler, or with --temperature 0 twenty NUL bytes and exit 0; `export` refused it."""
    from p2ptrain import checkpoint
    from p2ptrain.identity import load_or_create
    from tests.test_learner import make

    ident = load_or_create(tmp_path / "id")
    learner = make(ident.node_id)
    learner.params[-10:] = np.nan
    path = checkpoint.save(tmp_path / "ck", learner.snapshot(term=0), ident, keep=1)
    for temperature in ("1", "0"):
        r = run_cli("sample", "--checkpoint", str(path), "--length", "20", "--temperature",
                    temperature)
        assert r.returncode == 2 and r.stderr == (
            f"p2ptrain: error: {path.name}: its weights hold NaN or infinite values\n"), r.stderr


def test_sample_refuses_a_carried_tokenizer_larger_than_the_vocabulary(tmp_path):
    """A byte model (256 ids) carrying a 400-token tokenizer: an IndexError traceback."""
    from tokenizers import Tokenizer, models

    from p2ptrain import checkpoint
    from p2ptrain.identity import load_or_create
    from tests.test_learner import make

    ident = load_or_create(tmp_path / "id")
    learner = make(ident.node_id)
    words = {f"w{i}": i for i in range(400)}
    learner.tokenizer_json = Tokenizer(models.WordLevel(words, unk_token="w0")).to_str()
    path = checkpoint.save(tmp_path / "ck", learner.snapshot(term=0), ident, keep=1)
    r = run_cli("sample", "--checkpoint", str(path), "--length", "5")
    assert r.returncode == 2 and "the tokenizer it carries has 400 ids; the model's " \
        "vocabulary is 256" in r.stderr, r.stderr
