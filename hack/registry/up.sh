#!/usr/bin/env bash
# Starts the test OCI registry on loopback and prints its address (host:port). Plain
# HTTP. Two processes, both bound to 127.0.0.1:
#   regfront  on $RAMIFY_REGISTRY_PORT      the address clients use: anonymous access to
#                                           every repository except private/*, which
#                                           needs HTTP Basic credentials (htpasswd, bcrypt)
#   registry  on $RAMIFY_REGISTRY_PORT + 1  distribution v3, filesystem storage
# Interface (all under $RAMIFY_REGISTRY_DIR):
#   addr              host:port clients use (also printed on stdout)
#   credentials.json  {"registry": addr, "username": ..., "password": ...} for private/*
#   dockerconfig.json a .dockerconfigjson with those credentials (a pull secret's body)
#   dockerconfig-wrong.json  the same user with a wrong password (a pull secret to refuse)
#   docker/config.json  the right one, for DOCKER_CONFIG=$RAMIFY_REGISTRY_DIR/docker (crane)
#   env               `source` it: RAMIFY_REGISTRY=addr, DOCKER_CONFIG, PATH with crane
#   images.json       written by hack/images/build.sh: {name: {ref, digest}}
#   logs/, run/*.pid, storage/
# Re-running it while the registry is healthy is a no-op; the password is kept for the
# life of the directory. Stop it with down.sh (same environment).
#
# Environment: RAMIFY_REGISTRY_DIR (default <repo>/.ramify/registry),
# RAMIFY_REGISTRY_PORT (default 15000; the registry itself takes the next port),
# RAMIFY_REGISTRY_OWNER (a pid written to $dir/owner: `down.sh --if-owner PID` stops
# the registry only while that pid still owns it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${RAMIFY_REGISTRY_DIR:-$repo/.ramify/registry}"
port="${RAMIFY_REGISTRY_PORT:-15000}"
backend_port=$((port + 1))
addr="127.0.0.1:$port"

log() { echo "registry: $*" >&2; }
die() { echo "registry: FAILED: $*" >&2; exit 1; }

bin="$("$here/build.sh")" || die "building the registry failed"
# One start or stop at a time per directory: a test process's reaper stopping the
# registry never races the next process's start (the lock lives beside the directory,
# which down.sh removes).
mkdir -p "$(dirname "$dir")"
exec 9>"$dir.lock"
flock 9
export RAMIFY_REGISTRY_LOCKED=1
own() { [[ -z "${RAMIFY_REGISTRY_OWNER:-}" ]] || echo "$RAMIFY_REGISTRY_OWNER" >"$dir/owner"; }
code() { curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1" 2>/dev/null || true; }
alive() { [[ -f "$dir/run/$1.pid" ]] && kill -0 "$(cat "$dir/run/$1.pid")" 2>/dev/null; }
healthy() {
  alive registry && alive regfront && [[ "$(cat "$dir/addr" 2>/dev/null)" == "$addr" ]] &&
    [[ "$(code "http://127.0.0.1:$backend_port/v2/")" == 200 ]] && [[ "$(code "http://$addr/v2/")" == 401 ]]
}
if healthy; then own; log "already running on $addr ($dir)"; echo "$addr"; exit 0; fi
"$here/down.sh" --keep >/dev/null 2>&1 || true
mkdir -p "$dir/logs" "$dir/run" "$dir/storage" "$dir/docker"

if [[ ! -f "$dir/credentials.json" ]]; then
  user=ramify
  password="$(openssl rand -hex 16)"
  "$bin/regfront" hash "$user" "$password" >"$dir/htpasswd"
  jq -n --arg u "$user" --arg p "$password" '{username: $u, password: $p}' >"$dir/credentials.json"
fi
# distribution signs upload state with it; a fixed one survives restarts mid-upload.
[[ -f "$dir/http-secret" ]] || openssl rand -hex 32 >"$dir/http-secret"
user="$(jq -r .username "$dir/credentials.json")"
password="$(jq -r .password "$dir/credentials.json")"
# The address is part of these files: rewrite them on every start (the port may change).
# A temporary file of its own: two starts at once never move each other's.
creds_tmp="$(mktemp "$dir/credentials.json.XXXXXX")"
jq --arg r "$addr" '. + {registry: $r}' "$dir/credentials.json" >"$creds_tmp"
mv "$creds_tmp" "$dir/credentials.json"
dockerconfig() { # user password
  jq -n --arg r "$addr" --arg u "$1" --arg p "$2" --arg a "$(printf '%s:%s' "$1" "$2" | base64 -w0)" \
    '{auths: {($r): {username: $u, password: $p, auth: $a}}}'
}
dockerconfig "$user" "$password" >"$dir/dockerconfig.json"
dockerconfig "$user" "wrong-$password" >"$dir/dockerconfig-wrong.json"
cp "$dir/dockerconfig.json" "$dir/docker/config.json"

cat >"$dir/config.yml" <<YAML
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: $dir/storage
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$backend_port
  secret: $(cat "$dir/http-secret")
  # Upload locations relative to the request, so they stay right behind the front.
  relativeurls: true
YAML

start() { # name args...
  local name="$1"; shift
  (
    # Close every descriptor inherited beyond stdio (a caller's lock file, a test
    # harness's pipes): a daemon holding them would keep them open as long as it runs.
    for fd in /proc/"$BASHPID"/fd/*; do
      fd="${fd##*/}"
      if ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null || true; fi
    done
    # No tracing exporter: distribution v3 would otherwise dial an OTLP collector.
    OTEL_TRACES_EXPORTER=none OTEL_METRICS_EXPORTER=none OTEL_LOGS_EXPORTER=none \
      exec setsid "$@" >>"$dir/logs/$name.log" 2>&1 </dev/null
  ) &
  echo $! >"$dir/run/$name.pid"
}
wait_for() { # name want-code url
  local deadline=$((SECONDS + 30))
  until [[ "$(code "$3")" == "$2" ]]; do
    alive "$1" || { tail -n 20 "$dir/logs/$1.log" >&2; die "$1 exited (log: $dir/logs/$1.log)"; }
    ((SECONDS < deadline)) || { tail -n 20 "$dir/logs/$1.log" >&2; die "$1 did not answer $2 on $3 within 30s"; }
    sleep 0.1
  done
}

log "starting distribution on 127.0.0.1:$backend_port, auth front on $addr"
start registry "$bin/registry" serve "$dir/config.yml"
wait_for registry 200 "http://127.0.0.1:$backend_port/v2/"
start regfront "$bin/regfront" serve --listen "$addr" --backend "http://127.0.0.1:$backend_port" \
  --htpasswd "$dir/htpasswd" --protect private
wait_for regfront 401 "http://$addr/v2/"
echo "$addr" >"$dir/addr"
own
printf 'export RAMIFY_REGISTRY=%s\nexport DOCKER_CONFIG=%s\nexport PATH=%s:$PATH\n' \
  "$addr" "$dir/docker" "$bin" >"$dir/env"
log "ready: $addr (private/* needs $dir/credentials.json)"
echo "$addr"
