#!/usr/bin/env bash
# Build, ship and run p2ptrain on a Docker Swarm (docker/README.md walks through a fleet).
#
#   deploy.sh build [ARG...]        build the image for linux/amd64 and linux/arm64 (buildx;
#                                   ARGs go to docker buildx build)
#   deploy.sh push                  build both platforms and push them to $REGISTRY
#   deploy.sh init [NAME]           make this Docker a swarm manager (docker swarm init) if
#                                   it is in no swarm yet, create a p2ptrain swarm
#                                   (p2ptrain init) and the Docker secret p2ptrain_token
#                                   from its join token
#   deploy.sh init --compose [NAME] only the p2ptrain swarm and its token file, for
#                                   compose.yml on one machine (no Docker Swarm, no secret)
#   deploy.sh join TOKEN MANAGER    make this machine a Docker Swarm worker (TOKEN: from
#                                   `docker swarm join-token worker` on the manager)
#   deploy.sh label NODE CLASS      let NODE train; CLASS: rpi, laptop, desktop or server
#   deploy.sh unlabel NODE          take NODE out of training
#   deploy.sh deploy [ARG...]       deploy (or update) the stack (ARGs go to docker stack
#                                   deploy, e.g. --resolve-image never for a local image)
#   deploy.sh status [HOST:PORT]    the stack's tasks, then one node's view of the swarm
#   deploy.sh logs [SERVICE] [ARG...]  the service's last 200 lines (SERVICE: node); -f
#                                   follows them (ARGs go to docker service logs)
#   deploy.sh fetch [DIR [HOST:PORT]]  download the leader's latest checkpoint into DIR (.)
#   deploy.sh rm                    remove the stack (volumes, secret and labels stay)
#
#   deploy.sh scale [SERVICE] N     explains how to run on N machines: label them
#
# Environment: REGISTRY (e.g. registry.example.org:5000/team), TAG (latest), IMAGE (default
# $REGISTRY/p2ptrain:$TAG; the stack files read it as P2PT_IMAGE), STACK (p2ptrain),
# OVERLAY=1 (use stack-overlay.yml: no host networking, DNS seeds), SWARM_DIR (docker/swarm:
# swarm key and token), ADVERTISE_ADDR (for `init`: the address other machines reach this
# manager at, when docker swarm init cannot choose one), DRY_RUN=1 (print the docker
# commands instead of running them). DOCKER_HOST and the other docker CLI variables apply.
#
# `scale` scales nothing: p2ptrain runs as a *global* service, one task on every node
# labelled p2ptrain=true, and global services cannot be scaled. Choose the machines with
# labels.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
prog=$(basename "$0")

REGISTRY=${REGISTRY:-}
TAG=${TAG:-latest}
IMAGE=${IMAGE:-${REGISTRY:+${REGISTRY%/}/}p2ptrain:$TAG}
STACK=${STACK:-p2ptrain}
OVERLAY=${OVERLAY:-0}
SWARM_DIR=${SWARM_DIR:-$here/swarm}
DRY_RUN=${DRY_RUN:-0}
SECRET=p2ptrain_token
PLATFORMS=linux/amd64,linux/arm64
CLASSES="rpi laptop desktop server"

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }
die() { printf '%s: error: %s\n' "$prog" "$*" >&2; exit 2; }
say() { printf '%s: %s\n' "$prog" "$*" >&2; }

# Run a command, or with DRY_RUN=1 print it instead: one line, quoted only where the shell
# needs it, so that it can be pasted.
run() {
  if [ "$DRY_RUN" = 1 ]; then
    local arg line=""
    for arg in "$@"; do
      case "$arg" in
        '' | *[!A-Za-z0-9_./:=,@%+-]*) printf -v arg '%q' "$arg" ;;
      esac
      line="$line${line:+ }$arg"
    done
    printf '%s\n' "$line"
  else
    "$@"
  fi
}

need_docker() {
  [ "$DRY_RUN" = 1 ] || command -v docker >/dev/null 2>&1 ||
    die "docker is not installed here (see docker/README.md)"
}

# An absolute path for a bind mount; the path need not exist yet.
absolute() {
  case "$1" in
    /*) printf '%s\n' "$1" ;;
    .) printf '%s\n' "$PWD" ;;
    *) printf '%s\n' "$PWD/${1#./}" ;;
  esac
}

stack_file() {
  if [ "$OVERLAY" = 1 ]; then echo "$here/stack-overlay.yml"; else echo "$here/stack.yml"; fi
}

# Where one-off containers (status, fetch) run, and which node they ask by default.
tool_network() {
  if [ "$OVERLAY" = 1 ]; then echo "${STACK}_mesh"; else echo host; fi
}

cmd_build() {
  run docker buildx build --platform "$PLATFORMS" -f "$here/Dockerfile" -t "$IMAGE" "$@" "$repo"
}

cmd_push() {
  [ -n "$REGISTRY" ] || [ "$IMAGE" != "p2ptrain:$TAG" ] ||
    die "push needs REGISTRY (e.g. REGISTRY=registry.example.org:5000/team $prog push)"
  cmd_build --push
}

# This Docker's swarm state: inactive, pending, active, error or locked (docker info).
swarm_state() { docker info --format '{{.Swarm.LocalNodeState}}' 2>/dev/null || true; }

# Make this Docker a swarm manager unless it is in a swarm already (as a manager or a
# worker). DRY_RUN prints the command without asking Docker.
swarm_init() {
  local state=inactive
  [ "$DRY_RUN" = 1 ] || state=$(swarm_state)
  [ -n "$state" ] || die "init: cannot reach Docker (docker info failed; DOCKER_HOST?)"
  [ "$state" = inactive ] || return 0
  if ! run docker swarm init ${ADVERTISE_ADDR:+--advertise-addr "$ADVERTISE_ADDR"}; then
    die "init: docker swarm init failed; if it could not choose an address, give the one" \
      "the other machines reach this one at: ADVERTISE_ADDR=192.168.1.10 $prog init ..."
  fi
}

cmd_init() {
  local compose=0
  if [ "${1:-}" = --compose ]; then compose=1; shift; fi
  local name=${1:-p2ptrain}
  local dir key token_file
  case "$name" in
    *[!A-Za-z0-9_-]*|'') die "init: swarm name '$name': use letters, digits, - and _" ;;
  esac
  dir=$(absolute "$SWARM_DIR")
  key="$dir/$name/swarm.key"
  token_file="$dir/token"
  [ ! -e "$token_file" ] || die "init: $token_file exists (a swarm was made here already);" \
    "remove it or set SWARM_DIR"
  [ ! -e "$key" ] || die "init: $key exists; choose another NAME or SWARM_DIR"
  [ "$compose" = 1 ] || swarm_init
  [ "$DRY_RUN" = 1 ] || { mkdir -p "$dir" && chmod 700 "$dir"; }
  # The image's p2ptrain writes swarm.toml and swarm.key (mode 0600) as this user.
  run docker run --rm --network none --user "$(id -u):$(id -g)" -v "$dir:/swarm" \
    --entrypoint p2ptrain "$IMAGE" init --name "$name" --out "/swarm/$name"
  if [ "$DRY_RUN" = 1 ]; then
    printf '# write %s: p2pt1.%s.<key of %s, base64url>\n' "$token_file" "$name" "$key"
  else
    [ -r "$key" ] || die "init: p2ptrain init wrote no key at $key"
    # The join token is the name and the 32-byte key, unpadded base64url (p2ptrain/swarm.py).
    # Mode 0644 in a 0700 directory: compose bind-mounts the file for the container's user.
    (umask 022 && printf 'p2pt1.%s.%s\n' "$name" \
      "$(base64 -w0 < "$key" | tr '+/' '-_' | tr -d '=')" > "$token_file")
    say "join token written to $token_file (a secret: anyone holding it can join the swarm)"
  fi
  [ "$compose" = 0 ] || return 0
  if [ "$DRY_RUN" != 1 ] &&
     [ "$(docker info --format '{{.Swarm.ControlAvailable}}' 2>/dev/null)" != true ]; then
    say "this Docker is no swarm manager: enough for compose.yml; for a fleet, run on a" \
      "manager: docker secret create $SECRET $token_file"
    return 0
  fi
  run docker secret create "$SECRET" "$token_file"
}

cmd_join() {
  [ $# -eq 2 ] || die "usage: $prog join TOKEN MANAGER (TOKEN from \`docker swarm join-token" \
    "worker\` on a manager; MANAGER its address, HOST or HOST:PORT)"
  local manager=$2
  case "$1" in
    p2pt1.*) die "join: that is a p2ptrain token; this needs Docker's (SWMTKN-...)" ;;
  esac
  case "$manager" in *:*) ;; *) manager="$manager:2377" ;; esac
  run docker swarm join --token "$1" "$manager"
}

cmd_label() {
  [ $# -eq 2 ] || die "usage: $prog label NODE CLASS (CLASS: ${CLASSES// /, })"
  case " $CLASSES " in *" $2 "*) ;; *) die "label: unknown class '$2' (one of: ${CLASSES// /, })" ;; esac
  run docker node update --label-add p2ptrain=true --label-add "p2ptrain.class=$2" "$1"
}

cmd_unlabel() {
  [ $# -eq 1 ] || die "usage: $prog unlabel NODE"
  run docker node update --label-rm p2ptrain --label-rm p2ptrain.class "$1"
}

cmd_deploy() {
  # The stack files read the image and the stack's name (for DNS seeds) from the environment.
  # Extra arguments (more -c files, --resolve-image, --prune) go to docker stack deploy.
  run env P2PT_IMAGE="$IMAGE" STACK="$STACK" \
    docker stack deploy --with-registry-auth -c "$(stack_file)" "$@" "$STACK"
}

cmd_status() {
  [ $# -le 1 ] || die "usage: $prog status [HOST:PORT]"
  local peer=${1:-}
  if [ -z "$peer" ]; then
    if [ "$OVERLAY" = 1 ]; then peer="tasks.${STACK}_node:7100"; else peer=127.0.0.1:7100; fi
  fi
  run docker stack services "$STACK"
  run docker stack ps --filter desired-state=running "$STACK"
  run docker run --rm --network "$(tool_network)" --entrypoint p2ptrain "$IMAGE" \
    status --peer "$peer" ||
    say "no p2ptrain node answers at $peer; give one: $prog status HOST:7100"
}

cmd_logs() {
  local service=node
  case "${1:-}" in ''|-*) ;; *) service=$1; shift ;; esac
  case "$service" in "$STACK"_*) ;; *) service="${STACK}_$service" ;; esac
  run docker service logs --timestamps --tail 200 "$@" "$service"
}

cmd_fetch() {
  [ $# -le 2 ] || die "usage: $prog fetch [DIR [HOST:PORT]]"
  local out token_file peer_args=()
  out=$(absolute "${1:-.}")
  token_file="$(absolute "$SWARM_DIR")/token"
  [ "$DRY_RUN" = 1 ] || [ -r "$token_file" ] ||
    die "fetch: no join token at $token_file (run \`$prog init\` here, or set SWARM_DIR)"
  if [ -n "${2:-}" ]; then peer_args=(--peer "$2")
  elif [ "$OVERLAY" = 1 ]; then peer_args=(--peer "tasks.${STACK}_node:7100")
  fi
  [ "$DRY_RUN" = 1 ] || mkdir -p "$out"
  run docker run --rm --init --network "$(tool_network)" --user "$(id -u):$(id -g)" \
    -v "$out:/out" -v "$token_file:/run/secrets/$SECRET:ro" \
    -e "P2PTRAIN_TOKEN_FILE=/run/secrets/$SECRET" \
    --entrypoint p2ptrain "$IMAGE" checkpoint fetch --out /out ${peer_args[@]+"${peer_args[@]}"}
}

# Global services cannot be scaled: say how to get N machines training instead, and which
# machines are labelled now (when a swarm manager answers). Always fails (exit 2).
cmd_scale() {
  local service=node count class=CLASS c labelled="" machines=""
  case $# in
    1) count=$1 ;;
    2) service=$1; count=$2 ;;
    *) die "usage: $prog scale [SERVICE] N; p2ptrain is a global service: global services" \
         "cannot be scaled, label machines instead (\`$prog label NODE CLASS\`)" ;;
  esac
  case "$count" in *=*) service=${count%%=*}; count=${count#*=} ;; esac
  # `scale worker-rpi 20`: the class the service name mentions
  for c in $CLASSES; do case "$service" in *"$c"*) class=$c ;; esac; done
  if [ "$DRY_RUN" != 1 ] && command -v docker >/dev/null 2>&1 &&
     [ "$(docker info --format '{{.Swarm.ControlAvailable}}' 2>/dev/null)" = true ]; then
    machines=$(docker node ls --format '{{.Hostname}}' 2>/dev/null | xargs)
    labelled=$(docker node ls -q --filter node.label=p2ptrain=true 2>/dev/null |
      xargs -r docker node inspect --format '{{.Description.Hostname}}' | xargs)
  fi
  cat >&2 <<EOT
$prog: cannot scale $service to $count: p2ptrain runs as a global service, exactly one
task on every machine labelled p2ptrain=true, and global services cannot be scaled.
To train on $count machines, label that many (one p2ptrain node each):
  the swarm's machines:  docker node ls
  add a machine:         $prog label NODE $class   (CLASS: ${CLASSES// /, })
  take one out:          $prog unlabel NODE
EOT
  [ -z "$machines" ] || printf 'Machines: %s\nLabelled now: %s\n' "$machines" \
    "${labelled:-none}" >&2
  exit 2
}

cmd_rm() {
  [ $# -eq 0 ] || die "usage: $prog rm"
  run docker stack rm "$STACK"
}

[ $# -gt 0 ] || { usage >&2; exit 2; }
command=$1
shift
case "$command" in
  -h|--help|help) usage ;;
  build) need_docker; cmd_build "$@" ;;
  push) need_docker; cmd_push "$@" ;;
  init) need_docker; cmd_init "$@" ;;
  join) need_docker; cmd_join "$@" ;;
  label) need_docker; cmd_label "$@" ;;
  unlabel) need_docker; cmd_unlabel "$@" ;;
  deploy) need_docker; cmd_deploy "$@" ;;
  status) need_docker; cmd_status "$@" ;;
  logs) need_docker; cmd_logs "$@" ;;
  fetch) need_docker; cmd_fetch "$@" ;;
  rm) need_docker; cmd_rm "$@" ;;
  scale) cmd_scale "$@" ;;
  *) die "unknown command '$command' (try $prog --help)" ;;
esac
