"""The effects gate with an approval step: three branches each prepare a deployment
and request it as an effect (``/run/ramify/effects/01-deploy.json``). Only the branch
whose checks pass commits; the losers' requests are discarded; the winner's waits for
a person's approval, then reaches the webhook exactly once.

    python examples/effects_gate_approval.py [--rootfs-class busybox] [--yes]

The webhook is a small HTTP server this program runs on 127.0.0.1 (the operator POSTs
to it, so run this where the operator can reach it, as with ``make demo``). Without
``--yes`` it asks before approving.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, ClassVar

import ramify


class Receiver(BaseHTTPRequestHandler):
    """Records every effect POSTed to it (what a deploy system would receive)."""

    received: ClassVar[list[tuple[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        Receiver.received.append((self.headers.get("idempotency-key", ""), json.loads(body)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def branch(version: str, checks: str) -> str:
    """A branch's command: prepare ``version``, request its deployment, run checks."""
    effect = json.dumps({"kind": "deploy", "payload": {"version": version}})
    return (
        f"echo {version} > /work/release && "
        f"echo '{effect}' > /run/ramify/effects/01-deploy.json && {checks}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rootfs-class", default="busybox")
    p.add_argument("--name", default="release")
    p.add_argument("--yes", action="store_true", help="approve without asking")
    args = p.parse_args(argv)

    server = HTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/effects"

    with ramify.Sandbox.create(
        args.name,
        rootfs_class=args.rootfs_class,
        command="mkdir -p /work && while true; do sleep 1; done",
        env={"PATH": "/bin"},
        resources={"cpu": "100m", "memory": "256Mi"},
    ) as sb:
        sb.wait_running()
        branches = {
            "v1": branch("v1", "exit 1"),  # its checks fail
            "v2": branch("v2", 'test "$(cat /work/release)" = v2'),
            "v3": branch("v3", "exit 3"),
        }
        with sb.fork(
            branches, effects=ramify.Effects(approval=True, webhook=url), timeout=300
        ) as bs:
            out = bs.wait()
            print(f"winner: {out.winner}")
            held = bs.wait_effects(until=("AwaitingApproval", "Discarded"))
            for e in held:
                print(f"  effect {e.id}: {e.state} {e.payload}")
            if not args.yes and input("approve the winner's effects? [y/N] ").lower() != "y":
                print("not approved: nothing was deployed")
                return 1
            bs.approve()
            for e in bs.wait_effects():
                print(f"  effect {e.id}: {e.state}")
        print(f"webhook received {len(Receiver.received)} request(s):")
        for key, body in Receiver.received:
            print(f"  idempotency-key={key} payload={json.dumps(body['payload'])}")
        print(f"workspace release: {sb.files.read_text('/work/release').strip()}")
    server.shutdown()
    return 0 if [b["payload"] for _, b in Receiver.received] == [{"version": "v2"}] else 1


if __name__ == "__main__":
    sys.exit(main())
