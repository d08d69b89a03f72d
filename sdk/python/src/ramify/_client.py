"""The connection to Kubernetes: a kubeconfig (or the in-cluster service account), a
namespace, and the few calls the SDK makes on the ramify.dev CRDs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._kube import ApiException, k8s, k8s_config, k8s_watch
from .errors import NotFound, RamifyError, Timeout, from_api_exception

GROUP = "ramify.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
#: The aggregated API serving ``sandboxes/exec|log|diff`` (ramify-api).
SUBRESOURCE_GROUP = "subresources.ramify.dev"
SUBRESOURCE_VERSION = "v1alpha1"
#: Annotation that ends a BranchSet without a winner (what ``kubectl ramify abort`` sets).
ANNOTATION_ABORT = "ramify.dev/abort"
LABEL_BRANCHSET = "ramify.dev/branchset"
#: On branch Sandboxes: the branch's name inside its BranchSet.
LABEL_BRANCH = "ramify.dev/branch"
#: On a BranchSet: the node its parent runs on (the operator sets it, and corrects it).
LABEL_NODE = "ramify.dev/node"

Obj = dict[str, Any]


class Client:
    """A Kubernetes connection and a namespace.

    ``Client()`` reads ``$KUBECONFIG`` (or ``~/.kube/config``), falling back to the
    in-cluster service account; the namespace defaults to ``$RAMIFY_NAMESPACE``, then the
    kubeconfig context's namespace, then ``default``.
    """

    def __init__(
        self,
        kubeconfig: str | None = None,
        namespace: str | None = None,
        context: str | None = None,
    ) -> None:
        cfg = k8s.Configuration()
        ctx_ns: str | None = None
        try:
            k8s_config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=cfg
            )
            _, active = k8s_config.list_kube_config_contexts(config_file=kubeconfig)
            if context is not None:
                contexts, _ = k8s_config.list_kube_config_contexts(config_file=kubeconfig)
                active = next((c for c in contexts if c.get("name") == context), active)
            ctx_ns = (active or {}).get("context", {}).get("namespace")
        except (k8s_config.ConfigException, FileNotFoundError, TypeError) as e:
            if kubeconfig is not None:
                raise RamifyError(f"kubeconfig {kubeconfig}: {e}", reason="BadConfig") from e
            try:
                k8s_config.load_incluster_config(client_configuration=cfg)
            except k8s_config.ConfigException as e2:
                raise RamifyError(
                    f"no kubeconfig and not in a cluster: {e}; {e2}", reason="BadConfig"
                ) from e2
            try:
                with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                    ctx_ns = f.read().strip()
            except OSError:
                ctx_ns = None
        self.configuration = cfg
        self.api_client = k8s.ApiClient(cfg)
        self.custom = k8s.CustomObjectsApi(self.api_client)
        self.namespace: str = namespace or os.environ.get("RAMIFY_NAMESPACE") or ctx_ns or "default"

    _default: Client | None = None

    @classmethod
    def default(cls) -> Client:
        """The process-wide client from the environment (created on first use)."""
        if cls._default is None:
            cls._default = cls()
        return cls._default

    # --- CRD calls, each turning an ApiException into a typed error -------------------

    def create(self, plural: str, body: Obj) -> Obj:
        try:
            out: Obj = self.custom.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, plural, body
            )
            return out
        except ApiException as e:
            raise from_api_exception(e) from None

    def get(self, plural: str, name: str) -> Obj:
        try:
            out: Obj = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, plural, name
            )
            return out
        except ApiException as e:
            err = from_api_exception(e)
            if isinstance(err, NotFound):
                kind = plural[:-1] if plural.endswith("s") else plural
                err.message = f"{kind} {name} not found in namespace {self.namespace}"
            raise err from None

    def list(self, plural: str, label_selector: str = "") -> list[Obj]:
        try:
            out = self.custom.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, plural, label_selector=label_selector
            )
            items: list[Obj] = out.get("items", [])
            return items
        except ApiException as e:
            raise from_api_exception(e) from None

    def merge_patch(self, plural: str, name: str, body: Obj) -> Obj:
        try:
            out: Obj = self.custom.patch_namespaced_custom_object(
                GROUP, VERSION, self.namespace, plural, name, body
            )
            return out
        except ApiException as e:
            raise from_api_exception(e) from None

    def delete(self, plural: str, name: str) -> None:
        """Deletes in the foreground: the object stays (with a deletionTimestamp) until
        the garbage collector removed what it owns (a BranchSet's branches and snapshot),
        so waiting for it to be gone waits for those too."""
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                self.namespace,
                plural,
                name,
                body=k8s.V1DeleteOptions(propagation_policy="Foreground"),
            )
        except ApiException as e:
            err = from_api_exception(e)
            if not isinstance(err, NotFound):
                raise err from None

    def exists(self, plural: str, name: str) -> bool:
        try:
            self.get(plural, name)
            return True
        except NotFound:
            return False

    def watch(self, plural: str, name: str, timeout: float | None) -> Iterator[Obj]:
        """Yields the object now and after every change, until ``timeout`` seconds
        pass (then raises :class:`Timeout`). Raises :class:`NotFound` when it is (or
        gets) deleted. Watches resume from the last resourceVersion, and restart from a
        fresh read when the API server expired it (410)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        obj = self.get(plural, name)
        yield obj
        rv = obj["metadata"].get("resourceVersion", "")
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Timeout(f"{plural} {name}: still waiting after {timeout}s", reason="Timeout")
            # A server-side timeout bounds each watch call; the loop re-arms it.
            server_timeout = max(1, int(min(left if left is not None else 60, 60)))
            w = k8s_watch.Watch()
            try:
                for ev in self._stream(
                    w, plural, rv, server_timeout, field_selector=f"metadata.name={name}"
                ):
                    kind = ev.get("type")
                    o = ev.get("object")
                    if kind == "ERROR" or not isinstance(o, dict):
                        # 410 Gone or similar: re-read and carry on from there.
                        obj = self.get(plural, name)
                        rv = obj["metadata"].get("resourceVersion", "")
                        yield obj
                        break
                    rv = o.get("metadata", {}).get("resourceVersion", rv)
                    if kind == "DELETED":
                        raise NotFound(
                            f"{plural} {name} was deleted", reason="NotFound", status=404
                        )
                    yield o
                    if deadline is not None and time.monotonic() > deadline:
                        break
            except ApiException as e:
                if getattr(e, "status", None) == 410:
                    obj = self.get(plural, name)
                    rv = obj["metadata"].get("resourceVersion", "")
                    yield obj
                    continue
                raise from_api_exception(e) from None
            finally:
                w.stop()

    def _stream(
        self, w: Any, plural: str, rv: str, server_timeout: int, **selector: str
    ) -> Iterator[Any]:
        """One watch call from ``rv``, ended by the server after ``server_timeout``."""
        out: Iterator[Any] = w.stream(
            self.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            plural,
            resource_version=rv,
            timeout_seconds=server_timeout,
            _request_timeout=server_timeout + 5,
            **selector,
        )
        return out

    def watch_list(
        self, plural: str, label_selector: str, timeout: float | None, tick: int = 1
    ) -> Iterator[tuple[str, Obj] | None]:
        """Yields ``(event type, object)`` for the objects matching ``label_selector``:
        each existing one as ``ADDED``, then every change as it happens. Yields
        ``None`` at least every ``tick`` seconds (each watch call's server-side
        timeout), so the caller can look at something else meanwhile; raises
        :class:`Timeout` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def relist() -> tuple[str, list[Obj]]:
            try:
                out = self.custom.list_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, plural, label_selector=label_selector
                )
            except ApiException as e:
                raise from_api_exception(e) from None
            return str(out["metadata"].get("resourceVersion", "")), list(out.get("items", []))

        rv, items = relist()
        for o in items:
            yield "ADDED", o
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Timeout(
                    f"{plural} {label_selector}: still waiting after {timeout}s", reason="Timeout"
                )
            server_timeout = max(1, int(min(left if left is not None else tick, tick)))
            w = k8s_watch.Watch()
            expired = False
            try:
                for ev in self._stream(
                    w, plural, rv, server_timeout, label_selector=label_selector
                ):
                    kind, o = ev.get("type"), ev.get("object")
                    if kind == "ERROR" or not isinstance(o, dict):
                        expired = True
                        break
                    rv = o.get("metadata", {}).get("resourceVersion", rv)
                    yield str(kind), o
            except ApiException as e:
                if getattr(e, "status", None) != 410:
                    raise from_api_exception(e) from None
                expired = True
            finally:
                w.stop()
            if expired:
                # The resourceVersion expired (410): start again from a fresh list.
                rv, items = relist()
                for o in items:
                    yield "ADDED", o
            yield None

    def wait_for(
        self,
        plural: str,
        name: str,
        done: Callable[[Obj], bool],
        timeout: float | None,
    ) -> Obj:
        """The object once ``done(obj)`` holds; ``done`` may raise to end the wait."""
        for obj in self.watch(plural, name, timeout):
            if done(obj):
                return obj
        raise Timeout(f"{plural} {name}: wait ended", reason="Timeout")  # pragma: no cover

    def wait_gone(self, plural: str, name: str, timeout: float | None) -> None:
        """Returns once the object does not exist any more (finalizers done)."""
        try:
            for _ in self.watch(plural, name, timeout):
                pass
        except NotFound:
            return


def condition(obj: Obj, type_: str) -> Obj | None:
    """The status condition of this type, if any."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            out: Obj = c
            return out
    return None


def ready_reason(obj: Obj) -> tuple[str, str]:
    """(reason, message) of the object's Ready condition, or a ``Reconciled`` /
    ``NodeReconciled`` failure, whichever says more."""
    for t in ("Ready", "NodeReconciled", "Reconciled"):
        c = condition(obj, t)
        if c and c.get("status") != "True" and (c.get("message") or c.get("reason")):
            return str(c.get("reason", "")), str(c.get("message", ""))
    c = condition(obj, "Ready")
    if c:
        return str(c.get("reason", "")), str(c.get("message", ""))
    return "", ""
