"""Pod discovery: which pod addresses exist and are ready, behind one interface (`Discovery`)."""

from __future__ import annotations

from router.discovery.base import Discovery, PodEndpoint
from router.discovery.static import StaticDiscovery

__all__ = ["Discovery", "PodEndpoint", "StaticDiscovery", "build_discovery"]


def build_discovery(config) -> Discovery:
    """The discovery `config.discovery` names ("static", "file" or "kubernetes")."""
    if config.discovery == "kubernetes":
        from router.discovery.kubernetes import KubernetesDiscovery

        services = {"prefill": config.prefill_service, "decode": config.decode_service}
        if config.colocated_service:
            services = {"colocated": config.colocated_service}
        return KubernetesDiscovery(config.namespace, services, config.grpc_port_name)
    if config.discovery == "file":
        from router.discovery.file import FileDiscovery

        return FileDiscovery(config.pods_file)
    return StaticDiscovery.from_config(config)
