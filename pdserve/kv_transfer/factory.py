"""Picking a backend by name: `make_sender` / `make_receiver`.

Backend modules are imported only when asked for, so a worker that uses `torch` never
imports nixl or ray. Options are each backend class's keyword arguments; an unknown
option is an error that lists the accepted ones.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch

from .base import KVReceiver, KVSender
from .layout import KVLayout

DEFAULT_BACKEND = "nixl"

# backend name -> ("module:SenderClass", "module:ReceiverClass"), modules in backends/
BACKENDS: dict[str, tuple[str, str]] = {
    "nixl": ("nixl_send:NixlSender", "nixl_recv:NixlReceiver"),
    "torch": ("torch_send:TorchSender", "torch_recv:TorchReceiver"),
    "ray": ("ray_conn:RaySender", "ray_conn:RayReceiver"),
    "local": ("local_conn:LocalSender", "local_conn:LocalReceiver"),
}


def _cls(backend: str, role: int) -> type:
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown KV transfer backend {backend!r}; valid: {', '.join(sorted(BACKENDS))}"
        )
    module_name, cls_name = BACKENDS[backend][role].split(":")
    module = importlib.import_module(f"{__package__}.backends.{module_name}")
    cls: type = getattr(module, cls_name)
    return cls


def _check_opts(cls: type, opts: dict[str, Any]) -> None:
    params = inspect.signature(cls).parameters
    accepted = [n for n in params if n not in ("kv", "layout")]
    unknown = sorted(set(opts) - set(accepted))
    if unknown:
        raise ValueError(f"{cls.__name__} has no option(s) {unknown}; accepted: {accepted}")


def make_sender(backend: str, kv: torch.Tensor, layout: KVLayout, **opts: Any) -> KVSender:
    """A prefill-side sender over `kv` (layout checked) using the named backend."""
    cls = _cls(backend, 0)
    _check_opts(cls, opts)
    sender: KVSender = cls(kv, layout, **opts)
    return sender


def make_receiver(backend: str, kv: torch.Tensor, layout: KVLayout, **opts: Any) -> KVReceiver:
    """A decode-side receiver over `kv` (layout checked) using the named backend."""
    cls = _cls(backend, 1)
    _check_opts(cls, opts)
    receiver: KVReceiver = cls(kv, layout, **opts)
    return receiver
