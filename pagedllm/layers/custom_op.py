"""CustomOp: a layer with a torch implementation and a fused one, chosen once (vLLM's CustomOp).

forward_native is the reference (torch ops, any device); forward_cpu calls the C++ CPU kernels
(pagedllm/layers/csrc/) and may still take forward_native for an input layout the kernel does not
handle. Which of the two runs is decided on the op's first call, from that input's device and whether
the kernels loaded, and kept: a model's tensors stay on one device, so later calls skip the question.
The choice is stored as the class's plain function, not a bound method, so the op holds no reference
to itself (the engine's heap is frozen out of the garbage collector: a cycle would never be freed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.cpu_kernels import load_cpu_kernels
from pagedllm.layers.module import Module


def uses_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether an op first called on x should take the C++ CPU kernels."""
    return x.is_cpu and load_cpu_kernels()


def chosen_on_first_call(namespace: dict[str, Any], name: str, cpp: Callable[[], Callable[..., Any]],
                         reference: Callable[..., Any]) -> Callable[..., Any]:
    """CustomOp's choice for a plain function: a stand-in for namespace[name] whose first call puts there,
    from its first argument's device and whether the kernels loaded, the C++ op (cpp(): torch.ops knows it
    only once the kernels load) or the torch reference, and calls it. Later calls reach the choice with no
    question asked."""

    def choose(*args: Any) -> Any:
        chosen = cpp() if uses_cpu_kernels(args[0]) else reference
        namespace[name] = chosen
        return chosen(*args)

    return choose


class CustomOp(Module):
    def __init__(self) -> None:
        super().__init__()
        self._impl: Callable[..., Any] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        impl = self._impl
        if impl is None:
            impl = self._impl = self.dispatch(args[0])
        return impl(self, *args, **kwargs)

    # A call goes straight here, one Python frame fewer than Module.__call__ -> forward: every layer calls
    # its norms, rotary and activation. (Subclasses give forward_native / forward_cpu, never forward.)
    __call__ = forward

    def dispatch(self, x: torch.Tensor) -> Callable[..., Any]:
        return type(self).forward_cpu if uses_cpu_kernels(x) else type(self).forward_native

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)
