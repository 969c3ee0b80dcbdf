#!/usr/bin/env bash
# Take a fresh machine (Debian 12, Raspberry Pi OS 64-bit, Ubuntu 22.04+, a laptop) to a
# working p2ptrain install in a virtual environment (Debian and Pi OS refuse system-wide pip).
#
#   bootstrap/setup.sh            install p2ptrain into ./.venv
#   bootstrap/setup.sh --test     the same, plus the test tools (pytest, hypothesis, ruff, ...),
#                                 CPU torch 2.13.0 and transformers (extra [hf]) and, as root,
#                                 system packages the tests use (iproute2, iptables, shellcheck,
#                                 docker.io, debootstrap, chromium), saying which first
#   bootstrap/setup.sh --venv DIR use another environment directory
#
# Then run: .venv/bin/p2ptrain join
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo/.venv"
extras=""

usage() { sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --test) extras="[test]" ;;
    --venv) shift; venv=${1:?--venv needs a directory} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "setup.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else die "need root to run: $* (install sudo or run as root)"
  fi
}

case "$(uname -m)" in
  armv6l|armv7l|i386|i686)
    die "this is a 32-bit system ($(uname -m)); numpy has no wheels for it. On a Raspberry Pi,
       install Raspberry Pi OS (64-bit) and run this again." ;;
esac

python=""
for candidate in python3.13 python3.12 python3.11 python3; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    python=$(command -v "$candidate"); break
  fi
done
if [ -z "$python" ]; then
  found=$(python3 --version 2>/dev/null || echo "no python3")
  die "p2ptrain needs Python 3.11 or newer; this machine has: $found.
       Debian 12 / Raspberry Pi OS (bookworm) / Ubuntu 24.04 ship 3.11+: upgrade the OS, or
       on Ubuntu 22.04: sudo apt install python3.11 python3.11-venv, then run this again."
fi
say "using $python ($("$python" --version 2>&1))"

make_venv() { "$python" -m venv "$venv" >/dev/null 2>&1; }
if [ -x "$venv/bin/python" ] &&
   ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  # a .venv an older Python left (Ubuntu 22.04's 3.10): pip would refuse p2ptrain in it
  say "$venv holds $("$venv/bin/python" --version 2>&1), older than 3.11: making it anew"
  "$python" -m venv --clear "$venv" >/dev/null 2>&1 ||
    die "cannot recreate $venv with $python; remove it and run this again"
fi
if [ ! -x "$venv/bin/python" ]; then
  if ! make_venv; then
    rm -rf "$venv"
    ver=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    command -v apt-get >/dev/null 2>&1 ||
      die "$python cannot create a virtual environment and there is no apt-get; install venv support for Python $ver"
    say "python venv support is missing: installing python3-venv"
    as_root apt-get update -qq
    as_root apt-get install -y -qq "python${ver}-venv" ||
      as_root apt-get install -y -qq python3-venv
    make_venv || die "cannot create a virtual environment in $venv"
  fi
  say "created virtual environment $venv"
fi

if [ -n "$extras" ] && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  # the multi-host tests build hosts from network namespaces: ip, iptables (as root only;
  # without root they skip, with a reason); the docker/ tests lint shell scripts: shellcheck;
  # the real-engine test (tests/test_docker_engine.py) starts Debian's Docker engine itself
  # (docker.io: dockerd, containerd, runc and the docker CLI; no service is started) and
  # builds its base image offline from the Debian mirror: debootstrap; the dashboard test
  # (tests/test_dashboard.py) loads the page in headless chromium
  missing=""
  command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
  command -v iptables >/dev/null 2>&1 || missing="$missing iptables"
  command -v shellcheck >/dev/null 2>&1 || missing="$missing shellcheck"
  command -v dockerd >/dev/null 2>&1 || missing="$missing docker.io"
  command -v debootstrap >/dev/null 2>&1 || missing="$missing debootstrap"
  command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 ||
    missing="$missing chromium"
  if [ -n "$missing" ]; then
    say "installing test tools:$missing"
    # shellcheck disable=SC2086  # word splitting of the package list is intended
    if ! { apt-get update -qq && apt-get install -y -qq $missing >/dev/null; }; then
      say "warning: could not install$missing; the tests that need them will say so"
    fi
  fi
fi

pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip
if [ "$extras" = "[test]" ]; then
  # The tests include the Hugging Face interop (extra [hf]: torch, transformers). torch goes
  # first, by exact version: 2.13.0 is the CPU build; installed before the extra, it satisfies
  # the extra's pin, so pip never resolves a multi-GB CUDA build of its own.
  say "installing torch 2.13.0 (CPU build) for the Hugging Face interop tests"
  "${pip[@]}" torch==2.13.0
  extras="[test,hf]"
fi
say "installing p2ptrain$extras (numpy, aiohttp, zeroconf, cryptography, xxhash, prometheus-client, tqdm, tokenizers)"
"${pip[@]}" -e "$repo$extras"
version=$("$venv/bin/p2ptrain" --version) ||
  die "p2ptrain was installed into $venv but does not start (see the error above)"
say "done: $version. Start training with: '$venv/bin/p2ptrain' join"
