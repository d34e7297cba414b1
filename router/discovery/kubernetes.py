"""Kubernetes discovery: watch the EndpointSlices of the prefill and decode Services.

The `kubernetes` client is synchronous, so each Service is watched from its own daemon thread
(list, then watch from the list's resourceVersion; relist on 410 Gone or any error) and every change
is handed to the event loop with `call_soon_threadsafe`. Only endpoints whose `ready` condition is
true (or unset, which Kubernetes says to read as ready) and that are not terminating are routed;
a deleted slice removes its pods at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from router.discovery.base import Discovery, PodEndpoint

log = logging.getLogger(__name__)

_WATCH_TIMEOUT_SECONDS = 30     # server-side watch timeout; the loop re-watches after it
_RETRY_SECONDS = 1.0


def endpoints_of_slice(slice_: Any, role: str, port_name: str) -> set[PodEndpoint]:
    """The ready endpoints of one V1EndpointSlice, at the port named `port_name`."""
    ports = list(slice_.ports or [])
    port = next((p.port for p in ports if p.name == port_name), None)
    if port is None and len(ports) == 1:
        port = ports[0].port   # an unnamed single port is unambiguous
    if port is None:
        return set()
    out = set()
    for endpoint in slice_.endpoints or []:
        conditions = endpoint.conditions
        ready = conditions is None or conditions.ready is None or conditions.ready
        terminating = conditions is not None and bool(conditions.terminating)
        if not ready or terminating:
            continue
        name = endpoint.target_ref.name if endpoint.target_ref is not None else ""
        for ip in endpoint.addresses or []:
            host = f"[{ip}]" if ":" in ip else ip
            out.add(PodEndpoint(f"{host}:{port}", role, name or ip))
    return out


class KubernetesDiscovery(Discovery):
    """Ready endpoints of `services` ({role: Service name}) in `namespace`."""

    def __init__(self, namespace: str, services: dict[str, str], port_name: str = "grpc",
                 api_client: Any = None) -> None:
        super().__init__()
        self.namespace = namespace
        self.services = dict(services)
        self.port_name = port_name
        self._api_client = api_client
        self._slices: dict[str, dict[str, set[PodEndpoint]]] = {role: {} for role in services}
        self._listed: dict[str, threading.Event] = {role: threading.Event() for role in services}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watchers: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> Any:
        from kubernetes import client, config

        if self._api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api_client = client.ApiClient()
        return client.DiscoveryV1Api(self._api_client)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        api = self._client()
        for role, service in self.services.items():
            thread = threading.Thread(target=self._watch_forever, args=(api, role, service),
                                      name=f"k8s-watch-{service}", daemon=True)
            thread.start()
            self._threads.append(thread)
        # Wait briefly for the first lists so the router starts with pods; if the API server is not
        # reachable the threads keep retrying and /ready stays false meanwhile.
        await asyncio.to_thread(lambda: [e.wait(5.0) for e in self._listed.values()])

    async def stop(self) -> None:
        self._stop.set()
        for watcher in list(self._watchers.values()):
            watcher.stop()
            # A watch blocks in a socket read until the next event; closing the response wakes it.
            response = getattr(watcher, "_resp", None)
            if response is not None:
                with contextlib.suppress(Exception):
                    response.close()
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 1.0)

    def _watch_forever(self, api: Any, role: str, service: str) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        selector = f"kubernetes.io/service-name={service}"
        while not self._stop.is_set():
            try:
                listed = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                slices = {s.metadata.name: endpoints_of_slice(s, role, self.port_name) for s in listed.items}
                self._hand_over(role, slices, replace=True)
                self._listed[role].set()
                resource_version = listed.metadata.resource_version
                while not self._stop.is_set():
                    watcher = self._watchers[role] = watch.Watch()
                    for event in watcher.stream(api.list_namespaced_endpoint_slice, self.namespace,
                                                label_selector=selector, resource_version=resource_version,
                                                timeout_seconds=_WATCH_TIMEOUT_SECONDS,
                                                _request_timeout=_WATCH_TIMEOUT_SECONDS + 5):
                        if self._stop.is_set():
                            watcher.stop()
                            return
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            raise ApiException(status=getattr(obj, "code", None) or 500, reason="watch error")
                        name = obj.metadata.name
                        resource_version = obj.metadata.resource_version or resource_version
                        if event["type"] == "DELETED":
                            self._hand_over(role, {name: None})
                        else:
                            self._hand_over(role, {name: endpoints_of_slice(obj, role, self.port_name)})
            except ApiException as exc:
                if self._stop.is_set():
                    return
                if exc.status == 410:     # history compacted past our version: relist at once
                    log.info("EndpointSlice watch of %s/%s expired; relisting", self.namespace, service)
                    continue
                log.warning("EndpointSlice watch of %s/%s failed (%s); relisting", self.namespace, service, exc)
                self._stop.wait(_RETRY_SECONDS)
            except Exception as exc:  # relist after any other failure (connection loss, ...)
                if self._stop.is_set():
                    return
                log.warning("EndpointSlice watch of %s/%s failed (%s); relisting", self.namespace, service, exc)
                self._stop.wait(_RETRY_SECONDS)

    def _hand_over(self, role: str, update: dict[str, set[PodEndpoint] | None], replace: bool = False) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._apply, role, update, replace)

    def _apply(self, role: str, update: dict[str, set[PodEndpoint] | None], replace: bool) -> None:
        slices = self._slices[role]
        if replace:
            slices.clear()
        for name, endpoints in update.items():
            if endpoints is None:
                slices.pop(name, None)
            else:
                slices[name] = endpoints
        everything = set()
        for per_role in self._slices.values():
            for endpoints in per_role.values():
                everything |= endpoints
        self._publish(frozenset(everything))
