#!/usr/bin/env bash
# Creates (or refreshes) the Python venv of the SDK and MCP server at
# ~/.cache/ramify/venv with `pip install -e sdk/python[dev]`. Idempotent and fast when
# done: it reinstalls only when sdk/python/pyproject.toml changed (a stamp records its
# hash). Prints the venv's path.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RAMIFY_VENV:-$HOME/.cache/ramify/venv}"
stamp="$venv/.ramify-sdk-stamp"
want="$(sha256sum "$repo/sdk/python/pyproject.toml" | cut -d' ' -f1) $repo"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "$venv"
  exit 0
fi
# Debian's python3 needs python3-venv for ensurepip.
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  echo "python-venv: apt-get install python3-venv" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
fi
mkdir -p "$(dirname "$venv")"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q -e "$repo/sdk/python[dev]" >&2
echo "$want" > "$stamp"
echo "$venv"
