#!/usr/bin/env bash
# Starts the test object store on loopback: SeaweedFS (`weed server`: master, volume,
# filer and its S3 gateway in one process), with real S3 authentication (one identity
# whose access key and secret are generated per directory) and one bucket. Prints the
# S3 endpoint. Interface (all under $RAMIFY_S3_DIR):
#   endpoint            http://127.0.0.1:$RAMIFY_S3_PORT (also printed on stdout)
#   credentials/accessKeyID, credentials/secretAccessKey
#                       the identity's key pair, in the layout the node agent's
#                       --object-store-credentials-dir reads (a mounted Secret)
#   env                 `source` it: RAMIFY_S3_ENDPOINT, RAMIFY_S3_BUCKET,
#                       RAMIFY_S3_REGION, RAMIFY_S3_CREDENTIALS_DIR
#   data/, logs/weed.log (and weed.* of its own), run/weed.pid
# Re-running it while the store is healthy is a no-op; data and credentials live as
# long as the directory, so `down.sh --keep` then `up.sh` is a restart with the same
# objects. Stop it with down.sh (same environment).
#
# Environment: RAMIFY_S3_DIR (default <repo>/.ramify/objectstore), RAMIFY_S3_PORT
# (default 16900: S3; the next three ports serve the master, volume and filer, their
# gRPC ports are these plus 10), RAMIFY_S3_BUCKET (default ramify).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dir="${RAMIFY_S3_DIR:-$repo/.ramify/objectstore}"
port="${RAMIFY_S3_PORT:-16900}"
bucket="${RAMIFY_S3_BUCKET:-ramify}"
region=us-east-1
endpoint="http://127.0.0.1:$port"

log() { echo "objectstore: $*" >&2; }
die() { echo "objectstore: FAILED: $*" >&2; exit 1; }

bin="$("$here/build.sh")" || die "building seaweedfs failed"
alive() { [[ -f "$dir/run/weed.pid" ]] && kill -0 "$(cat "$dir/run/weed.pid")" 2>/dev/null; }
# A signed HEAD of the bucket: 200 only when S3 answers, authenticates us and has it.
s3_code() { # method path
  curl -s -o /dev/null -w '%{http_code}' --max-time 3 -X "$1" \
    --aws-sigv4 "aws:amz:$region:s3" \
    --user "$(cat "$dir/credentials/accessKeyID"):$(cat "$dir/credentials/secretAccessKey")" \
    "$endpoint/$2" 2>/dev/null || true
}
healthy() {
  alive && [[ "$(cat "$dir/endpoint" 2>/dev/null)" == "$endpoint" ]] && [[ "$(s3_code HEAD "$bucket")" == 200 ]]
}
if healthy; then log "already running on $endpoint ($dir)"; echo "$endpoint"; exit 0; fi
"$here/down.sh" --keep >/dev/null 2>&1 || true
mkdir -p "$dir/data" "$dir/logs" "$dir/run" "$dir/credentials"
chmod 700 "$dir/credentials"

if [[ ! -s "$dir/credentials/secretAccessKey" ]]; then
  printf 'RAMIFY%s' "$(openssl rand -hex 7 | tr a-f A-F)" >"$dir/credentials/accessKeyID"
  openssl rand -hex 20 >"$dir/credentials/secretAccessKey"
fi
jq -n --arg k "$(cat "$dir/credentials/accessKeyID")" --arg s "$(cat "$dir/credentials/secretAccessKey")" \
  '{identities: [{name: "ramify", credentials: [{accessKey: $k, secretKey: $s}],
                  actions: ["Admin", "Read", "Write", "List", "Tagging"]}]}' >"$dir/s3.json"
chmod 600 "$dir/s3.json"

# The bucket is created once S3 answers (a PUT of a bucket already there is refused
# with 409, which is fine).
bucket_ready() {
  [[ "$(s3_code HEAD "$bucket")" == 200 ]] && return 0
  s3_code PUT "$bucket" >/dev/null
  [[ "$(s3_code HEAD "$bucket")" == 200 ]]
}
# shellcheck source=../lib/daemon.sh
source "$here/../lib/daemon.sh"
log "starting seaweedfs on 127.0.0.1:$port (S3) .. $((port + 3))"
# Small volumes (64 MB), at most 128 (each collection grows 7 at a time; 16 filled up in one suite run). GOMAXPROCS=1: it
# shares the 2 cores with the control plane and the sandboxes.
start weed env GOMAXPROCS=1 "$bin/weed" -logdir="$dir/logs" server \
  -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="$dir/data" \
  -master.port=$((port + 1)) -master.port.grpc=$((port + 11)) \
  -master.volumeSizeLimitMB=64 -master.raftHashicorp \
  -volume.port=$((port + 2)) -volume.port.grpc=$((port + 12)) -volume.max=128 \
  -volume.preStopSeconds=0 \
  -filer -filer.port=$((port + 3)) -filer.port.grpc=$((port + 13)) \
  -filer.localSocket="$dir/run/filer.sock" \
  -s3 -s3.port="$port" -s3.port.grpc=$((port + 14)) -s3.config="$dir/s3.json" \
  -s3.port.iceberg=0 -s3.port.lance=0
echo "$endpoint" >"$dir/endpoint"
wait_for weed 90 bucket_ready
printf 'export RAMIFY_S3_ENDPOINT=%s\nexport RAMIFY_S3_BUCKET=%s\nexport RAMIFY_S3_REGION=%s\nexport RAMIFY_S3_CREDENTIALS_DIR=%s\n' \
  "$endpoint" "$bucket" "$region" "$dir/credentials" >"$dir/env"
log "ready: $endpoint, bucket $bucket (credentials in $dir/credentials)"
echo "$endpoint"
