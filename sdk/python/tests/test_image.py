"""Sandboxes from container images through the SDK, against the e2e harness's real
registry (see conftest.py): the public busybox, the private one behind a pull secret,
and a fork of an image sandbox that commits."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import Iterator

import pytest
from conftest import RESOURCES, unique
from kubernetes import client as k8s

import ramify
import ramify.aio

#: The busybox image runs as uid 1000 in /home/app (its config).
HOME = "/home/app"


def _secret(client: ramify.Client, name: str, dockerconfigjson: str) -> None:
    body = k8s.V1Secret(
        metadata=k8s.V1ObjectMeta(name=name),
        type="kubernetes.io/dockerconfigjson",
        data={".dockerconfigjson": base64.b64encode(dockerconfigjson.encode()).decode()},
    )
    k8s.CoreV1Api(client.api_client).create_namespaced_secret(client.namespace, body)


@pytest.fixture(scope="module")
def pull_secrets(client: ramify.Client) -> Iterator[tuple[str, str]]:
    """(right, wrong) pull secrets for the private image, deleted after the module."""
    right, wrong = unique("pull-right"), unique("pull-wrong")
    _secret(client, right, os.environ["RAMIFY_TEST_DOCKERCONFIG"])
    _secret(client, wrong, os.environ["RAMIFY_TEST_DOCKERCONFIG_WRONG"])
    # The wrong one is the right user with another password: the registry says no.
    assert json.loads(os.environ["RAMIFY_TEST_DOCKERCONFIG_WRONG"])["auths"]
    yield right, wrong
    core = k8s.CoreV1Api(client.api_client)
    for n in (right, wrong):
        core.delete_namespaced_secret(n, client.namespace)


def test_a_sandbox_from_the_registrys_busybox_execs(
    client: ramify.Client, image: str, image_digest: str
) -> None:
    # No command: the image's entrypoint and cmd run, as its user, in its working dir.
    with ramify.Sandbox.create(
        unique("img"), image=image, resources=RESOURCES, client=client
    ) as sb:
        assert sb.image == image
        sb.wait_running(timeout=180)
        assert sb.image_digest == image_digest
        r = sb.exec("cat /etc/ramify-image; id -u; pwd", check=True)
        assert r.stdout.split("\n")[:3] == ["busybox v1", "1000", HOME], r
        sb.files.write(f"{HOME}/note", "from the sdk\n")
        assert sb.files.read_text(f"{HOME}/note") == "from the sdk\n"


def test_a_private_image_needs_the_right_pull_secret(
    client: ramify.Client, private_image: str, pull_secrets: tuple[str, str]
) -> None:
    right, wrong = pull_secrets
    with ramify.Sandbox.create(
        unique("wrong"),
        image=private_image,
        image_pull_secrets=[wrong],
        command="sleep 3600",
        resources=RESOURCES,
        client=client,
    ) as bad:
        with pytest.raises(ramify.ImagePullFailed) as e:
            bad.wait_running(timeout=120)
        # The Ready condition's reason, and the registry's refusal naming the image.
        assert e.value.reason == "ImagePullBackOff", e.value
        assert private_image in e.value.message, e.value
        assert "authoriz" in e.value.message.lower(), e.value
        assert isinstance(e.value, ramify.SandboxFailed)
        assert bad.refresh()["status"]["phase"] == "Starting"
    with ramify.Sandbox.create(
        unique("right"),
        image=private_image,
        image_pull_secrets=[right],
        image_pull_policy="Always",
        command="sleep 3600",
        resources=RESOURCES,
        client=client,
    ) as good:
        good.wait_running(timeout=120)
        assert good.exec("cat /etc/ramify-image").stdout == "private busybox v1\n"


def test_a_fork_of_an_image_sandbox_commits(client: ramify.Client, image: str) -> None:
    with ramify.Sandbox.create(
        unique("imgfork"),
        image=image,
        command=f"echo base > {HOME}/state; while true; do sleep 1; done",
        resources=RESOURCES,
        client=client,
    ) as sb:
        sb.wait_running(timeout=180)
        with sb.fork(
            {"good": f"echo good > {HOME}/result", "bad": f"echo bad > {HOME}/result"},
            verdict=f"grep -q good {HOME}/result",
            commit=ramify.Full(),
            timeout=120,
        ) as bs:
            out = bs.wait(timeout=240)
        assert (out.phase, out.winner) == ("Committed", "good"), out
        assert sb.files.read_text(f"{HOME}/result") == "good\n"
        assert sb.files.read_text(f"{HOME}/state") == "base\n"
        st = sb.refresh()["status"]
        assert st["commits"] == 1 and st["phase"] == "Running", st


def test_async_create_from_an_image(client: ramify.Client, image: str) -> None:
    async def main() -> str:
        async with await ramify.aio.Sandbox.create(
            unique("aimg"),
            image=image,
            image_pull_policy="IfNotPresent",
            command="sleep 3600",
            resources=RESOURCES,
            client=client,
        ) as sb:
            await sb.wait_running(timeout=180)
            return (await sb.exec("cat /etc/ramify-image")).stdout

    assert asyncio.run(main()) == "busybox v1\n"
