"""ClusterSecurity: how the router and pods trust each other (secret, TLS, KV handles), and the
flags that set it. Torch-free: the router builds its pod channels from it too.

- The deployment secret (`--cluster-secret-file`, else $CBSERVE_CLUSTER_SECRET) gates every pod
  RPC but health (`pod.auth`) and keys the KV handles (`kvtransfer.handles`). A pod or router
  without one refuses to start unless given `--insecure-no-cluster-secret`: an open pod serves
  raw KV and tokens to anyone who can reach its port, and loopback is no boundary on a shared
  machine (the reliability probe read KV from a loopback `cbserve up`). `cbserve up` generates a
  secret per run; the chart generates one per release.
- TLS: a pod given `--tls-cert/--tls-key` serves TLS only; with `--tls-ca` it also requires client
  certificates signed by that CA. The router (`--tls-ca`, and `--tls-cert/--tls-key` for mutual
  TLS) and a TLS decode pod dialling prefill pods verify the peer against `--tls-ca`, by the name
  `--tls-server-name` (pods are dialled by IP; one DNS SAN on every pod certificate suffices).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvtransfer.handles import KVHandles
from pod.auth import SECRET_ENV, SecretError, ServerAuth, auth_metadata, client_auth, read_cluster_secret


@dataclass(frozen=True)
class ClusterSecurity:
    """The trust settings of one process; the default is the explicit insecure mode."""

    secret: str | None = field(default=None, repr=False)   # None: no auth, no handles (insecure)
    tls_cert: str | None = None        # PEM paths
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None  # name to verify pods by, instead of the address dialled

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")

    @property
    def handles(self) -> KVHandles | None:
        """The KV handle issuer/checker, or None in insecure mode (pods then trust any address)."""
        return KVHandles.from_secret(self.secret) if self.secret else None

    def call_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """Per-call metadata with the secret (for hot paths that skip the channel interceptors)."""
        return auth_metadata(self.secret) if self.secret else None

    # ---------------------------------------------------------------- client side
    @property
    def client_tls(self) -> bool:
        """Dial pods over TLS: the router when given a CA; a pod when it serves TLS itself."""
        return bool(self.tls_ca or self.tls_cert)

    def channel(self, address: str, options=(), *, add_secret: bool = True) -> grpc.aio.Channel:
        """An aio channel to the pod at `address`: TLS when configured, the secret on every call
        unless `add_secret` is False (the caller then passes `call_metadata()` per call)."""
        options = list(options)
        interceptors = client_auth(self.secret) if self.secret and add_secret else None
        if not self.client_tls:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca), private_key=_read(self.tls_key),
            certificate_chain=_read(self.tls_cert))
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)

    # ---------------------------------------------------------------- server side
    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [ServerAuth(self.secret)] if self.secret else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address` (TLS when this pod has a certificate); returns the bound port."""
        if not self.tls_cert:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials(
            [(_read(self.tls_key), _read(self.tls_cert))], root_certificates=_read(self.tls_ca),
            require_client_auth=bool(self.tls_ca))
        return server.add_secure_port(address, credentials)


def advertise_address(host: str, port: int, environ=os.environ) -> str:
    """HOST:PORT the router reaches a pod at, as discovery names it: $CBSERVE_POD_IP (the chart sets
    it to the pod IP, which EndpointSlices list) or the bind host. A prefill pod checks KV handles
    against it, so it must match the router's address string exactly; `--advertise-address`
    overrides it. "" when unknown (a wildcard bind with no pod IP)."""
    ip = environ.get("CBSERVE_POD_IP") or ("" if host in ("", "0.0.0.0", "::", "[::]") else host)
    if not ip:
        return ""
    return f"[{ip}]:{port}" if ":" in ip and not ip.startswith("[") else f"{ip}:{port}"


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None


def add_security_flags(p: argparse.ArgumentParser, pod: bool) -> None:
    """The trust flags of `cbserve prefill|decode` (`pod`) and `cbserve router`."""
    p.add_argument("--cluster-secret-file", default=None, metavar="PATH",
                   help=f"file holding the deployment secret (default: ${SECRET_ENV}); every pod RPC but "
                        "health must carry it, and it keys the router's KV handles")
    p.add_argument("--insecure-no-cluster-secret", action="store_true",
                   help="run without a secret: pods then answer anyone who reaches them (tests, demos)")
    if pod:
        p.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate")
        p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
        p.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="require client certificates signed by this CA; also verifies prefill pods")
    else:
        p.add_argument("--tls-ca", default=None, metavar="PEM", help="dial pods over TLS, verified by this CA")
        p.add_argument("--tls-cert", default=None, metavar="PEM", help="client certificate for mutual TLS")
        p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="verify pod certificates for this name instead of the address dialled")


def security_from_args(args: argparse.Namespace) -> ClusterSecurity:
    """ClusterSecurity from the flags; ValueError (with what to do) when there is no secret and
    `--insecure-no-cluster-secret` was not given."""
    try:
        secret = read_cluster_secret(args.cluster_secret_file)
    except SecretError as e:
        raise ValueError(str(e)) from None
    if secret is None and not args.insecure_no_cluster_secret:
        raise ValueError(f"no cluster secret: pass --cluster-secret-file or set ${SECRET_ENV} (the same on "
                         "the router and every pod), or --insecure-no-cluster-secret to let anyone who "
                         "reaches the pods use them")
    security = ClusterSecurity(secret=secret, tls_cert=args.tls_cert, tls_key=args.tls_key,
                               tls_ca=args.tls_ca, tls_server_name=args.tls_server_name)
    for path in (security.tls_cert, security.tls_key, security.tls_ca):
        _read(path)   # fail at startup, not on the first call
    return security
