"""The SDK's tests drive a real ramify: the e2e harness (``e2e/tests/sdk.rs``) starts
the control plane, the operator, a node agent with runsc and ramify-api, then runs
pytest with these variables. Without them the suite fails: it never skips."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator

import pytest

import ramify

ENV = ("RAMIFY_TEST_KUBECONFIG", "RAMIFY_TEST_NAMESPACE", "RAMIFY_TEST_ROOTFS_CLASS")
#: Small enough that a parent, its branches and a warm pool fit the e2e node's CPU.
RESOURCES = {"cpu": "100m", "memory": "256Mi"}
#: A parent that keeps running and has a /work directory.
PARENT = "mkdir -p /work && while true; do sleep 1; done"


def _env(name: str) -> str:
    v = os.environ.get(name)
    if not v:
        raise RuntimeError(
            f"{name} is not set: run the SDK tests through the e2e harness "
            "(cargo test -p ramify-e2e --test sdk), which starts a real ramify"
        )
    return v


@pytest.fixture(scope="session")
def kubeconfig() -> str:
    return _env("RAMIFY_TEST_KUBECONFIG")


@pytest.fixture(scope="session")
def namespace() -> str:
    return _env("RAMIFY_TEST_NAMESPACE")


@pytest.fixture(scope="session")
def rootfs_class() -> str:
    return _env("RAMIFY_TEST_ROOTFS_CLASS")


@pytest.fixture(scope="session")
def client(kubeconfig: str, namespace: str) -> ramify.Client:
    return ramify.Client(kubeconfig=kubeconfig, namespace=namespace)


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


@pytest.fixture
def parent(client: ramify.Client, rootfs_class: str) -> Iterator[Callable[[], ramify.Sandbox]]:
    """Makes running parent sandboxes; deletes them (waiting) after the test."""
    made: list[ramify.Sandbox] = []

    def make() -> ramify.Sandbox:
        sb = ramify.Sandbox.create(
            unique("p"),
            rootfs_class=rootfs_class,
            command=PARENT,
            env={"PATH": "/bin"},
            resources=RESOURCES,
            client=client,
        )
        made.append(sb)
        sb.wait_running(timeout=120)
        return sb

    yield make
    for sb in made:
        sb.delete(wait=True)


@pytest.fixture(scope="session")
def image() -> str:
    """The test registry's busybox image (``ramify_e2e::registry``)."""
    return _env("RAMIFY_TEST_IMAGE")


@pytest.fixture(scope="session")
def image_digest() -> str:
    return _env("RAMIFY_TEST_IMAGE_DIGEST")


@pytest.fixture(scope="session")
def private_image() -> str:
    """The same busybox under ``private/``: the registry wants credentials for it."""
    return _env("RAMIFY_TEST_PRIVATE_IMAGE")
