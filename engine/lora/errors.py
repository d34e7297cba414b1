"""What can go wrong with an adapter, as the boundary reports it (HTTP status, gRPC code)."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter cannot be registered or used; the message names the adapter and why."""


class LoRANotFoundError(LoRAError):
    """No adapter of that name is registered here (HTTP 404, gRPC NOT_FOUND)."""


class LoRAAdapterError(LoRAError):
    """The adapter does not fit the base model or this server's limits: shapes, rank, target
    modules, PEFT options cbserve does not run, unreadable files (HTTP 400, INVALID_ARGUMENT)."""


class LoRAExistsError(LoRAError):
    """An adapter of that name is already registered (HTTP 400, ALREADY_EXISTS)."""


class LoRAPermissionError(LoRAError):
    """Loading at run time is off, or the path lies outside `--lora-root` (HTTP 403,
    PERMISSION_DENIED): adapter paths are paths on the server, chosen by a client."""
