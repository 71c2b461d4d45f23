"""Shared checks of the torch operator tests: torch.compile(fullgraph=True) against eager mode."""

import torch


class Projected(torch.nn.Module):
    """Attention between a q/k/v projection and an output projection (float64); subclasses
    say how ``attend`` lays the heads out."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        kw = dict(dtype=torch.float64)
        self.heads = heads
        self.qkv, self.o = torch.nn.Linear(d, 3 * d, **kw), torch.nn.Linear(d, d, **kw)


def assert_compiles_like_eager(model, *inputs):
    """torch.compile(fullgraph=True) of ``model``: one graph, no break; outputs and
    parameter gradients (of the squared output's sum) equal eager mode's. (backend="aot_eager":
    inductor's C++ compile is slow here.)"""
    explain = torch._dynamo.explain(model)(*inputs)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    results = []
    for m in (model, compiled):
        model.zero_grad()
        y = m(*inputs)
        y.square().sum().backward()
        results.append([y.detach()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
