# Sourced by the scripts that start the test bed's daemons (hack/controlplane/up.sh,
# hack/node/up.sh). The caller defines `dir` (with logs/ and run/ in it) and `die`.

# start NAME ARGS...: runs ARGS as a daemon in its own session, its output in
# $dir/logs/NAME.log and its pid in $dir/run/NAME.pid. With DAEMON_NICE=N set, the
# daemon runs at niceness N, and so does its session's scheduling group: with the
# kernel's autogroups on (sched_autogroup_enabled), a new session is a group of its own
# that competes with every other at nice 0 whatever its tasks' niceness, so `nice`
# alone changes nothing against other sessions. The group is the daemon's own (made by
# its setsid), never the caller's.
start() {
  local name="$1"; shift
  local nice="${DAEMON_NICE:-}"
  (
    # Close every descriptor inherited beyond stdio (a caller's lock file, a test
    # harness's pipes): a daemon holding them would keep the lock held, or the
    # caller's output open, for as long as it runs.
    for fd in /proc/"$BASHPID"/fd/*; do
      fd="${fd##*/}"
      if ((fd > 2)); then eval "exec $fd>&-" 2>/dev/null || true; fi
    done
    if [[ -n "$nice" ]]; then
      # shellcheck disable=SC2016 # expanded by the daemon's own shell
      exec setsid bash -c '[[ ! -e /proc/self/autogroup ]] || echo "$0" >/proc/self/autogroup; exec nice -n "$0" "$@"' \
        "$nice" "$@" >"$dir/logs/$name.log" 2>&1 </dev/null
    fi
    exec setsid "$@" >"$dir/logs/$name.log" 2>&1 </dev/null
  ) &
  echo $! >"$dir/run/$name.pid"
}

# wait_for NAME SECONDS COMMAND...: until COMMAND succeeds; fails (with the end of
# NAME's log) when the time is up or the daemon NAME exited.
wait_for() {
  local what="$1" limit="$2"; shift 2
  local deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then
      tail -n 30 "$dir/logs/$what.log" >&2 || true
      die "$what did not become ready within ${limit}s (log: $dir/logs/$what.log)"
    fi
    local pid; pid="$(cat "$dir/run/$what.pid")"
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 30 "$dir/logs/$what.log" >&2 || true
      die "$what exited (log: $dir/logs/$what.log)"
    fi
    sleep 0.2
  done
}

# stop NAME: ends the daemon of $dir/run/NAME.pid (TERM, then KILL after 10 s), by
# that pid only, and removes the pid file. Nothing running is not an error.
stop() {
  local pidfile="$dir/run/$1.pid" pid
  [[ -f "$pidfile" ]] || return 0
  pid="$(cat "$pidfile")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}
