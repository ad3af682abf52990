"""pagedllm.layers.module: layers called through their forward, attributes bound once a model is loaded."""

import torch
from torch import nn

from pagedllm.layers.module import Module, bind_attributes


class Inner(Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(2), requires_grad=False)

    def forward(self, x):
        return x * self.weight + (self.bias if self.bias is not None else 0)


class Outer(Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.plain = nn.Linear(2, 2)  # not a pagedllm Module: left to nn.Module

    def forward(self, x):
        return self.inner(x)


def test_bound_attributes_are_plain_and_never_stale():
    model = Outer()
    bind_attributes(model)
    inner = model.inner
    assert model.__dict__["inner"] is inner and inner.__dict__["weight"] is inner._parameters["weight"]
    assert "weight" not in model.plain.__dict__
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(model(x), x)

    inner.weight = nn.Parameter(torch.full((2,), 3.0), requires_grad=False)  # replaced: registered, read back
    assert inner.weight is inner._parameters["weight"] and torch.equal(model(x), 3 * x)
    inner.bias = None  # a registered parameter set to None: nn.Module keeps the slot, the bound copy goes
    assert inner.bias is None and inner._parameters["bias"] is None
    replacement = Inner()
    model.inner = replacement
    assert model.inner is replacement and model._modules["inner"] is replacement
    del model.inner
    assert not hasattr(model, "inner") and "inner" not in model._modules
    assert [name for name, _ in Outer().named_parameters()] == ["inner.weight", "inner.bias", "plain.weight",
                                                                "plain.bias"]


def test_a_module_call_is_its_forward():
    calls = []
    layer = Inner()
    layer.register_forward_hook(lambda *args: calls.append(args))  # pagedllm's layers take no hooks
    assert torch.equal(layer(torch.ones(2)), torch.ones(2)) and not calls
