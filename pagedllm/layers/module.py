"""The base class of pagedllm's layers and models, and the binding that makes their attributes plain."""

from __future__ import annotations

from typing import Any

from torch import nn


class Module(nn.Module):
    """An nn.Module whose call is its forward, and whose submodules and parameters can be bound as plain
    attributes (bind_attributes). pagedllm's layers take no hooks, and both nn.Module.__call__'s hook
    checks and nn.Module.__getattr__ (every `self.qkv_proj`, `self.weight`) are Python calls made for
    every layer of every step: on a small model they cost as much as its norms and rotary embeddings."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__.pop(name, None)  # a bound copy would shadow what nn.Module registers
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self.__dict__.pop(name, None)


def bind_attributes(model: nn.Module) -> None:
    """Put each pagedllm layer's submodules and parameters in its instance dict, where attribute lookup
    finds them before nn.Module.__getattr__ is asked. Done once the model is loaded: setting or deleting
    one through the module afterwards drops the bound copy (Module.__setattr__), so nothing goes stale;
    a write straight into `_parameters` or `_modules` would, and the model code makes none after this."""
    for module in model.modules():
        if isinstance(module, Module):
            for registry in (module._modules, module._parameters):
                for name, value in registry.items():
                    if value is not None:
                        module.__dict__[name] = value
