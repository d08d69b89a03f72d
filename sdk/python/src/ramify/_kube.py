"""The official kubernetes client's modules, typed ``Any``: the client is only
partially annotated, and mypy --strict would otherwise refuse every call into it."""

from typing import Any

import kubernetes.client
import kubernetes.client.exceptions
import kubernetes.config
import kubernetes.stream.ws_client
import kubernetes.watch

k8s: Any = kubernetes.client
k8s_config: Any = kubernetes.config
k8s_watch: Any = kubernetes.watch
WSClient: Any = kubernetes.stream.ws_client.WSClient
PortForward: Any = kubernetes.stream.ws_client.PortForward
create_websocket: Any = kubernetes.stream.ws_client.create_websocket
ApiException: type[Exception] = kubernetes.client.exceptions.ApiException
