"""Property: for random small networks x transforms x policies x dropout, remat changes nothing.

Each example draws a network (a few layers from a pool of operators, one of them a
module's, optionally with dropout), a transform stack, a saving policy and whether to remat each
layer or the whole network, and checks that values and derivatives equal the
un-remat'd computation's under the same seed, in float64.
"""

import torch
import torch.func as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from funckpt import checkpoint_name, policies, remat

D = torch.float64
WIDTH = 3
# A module whose parameters require grad where the layer runs, reached through a closure: below a
# vmap, a graph is recorded there even where the run has no grad level of its own.
_NORM = torch.nn.LayerNorm(WIDTH, dtype=D)
with torch.no_grad():
    _NORM.weight.copy_(torch.linspace(0.5, 1.5, WIDTH, dtype=D))

LAYERS = {
    "linear_tanh": lambda w, x: torch.tanh(x @ w),
    "sin_mul": lambda w, x: x.sin() * w.sum(0),
    "softplus_matmul": lambda w, x: torch.nn.functional.softplus(x) @ w.T,
    "named_square": lambda w, x: checkpoint_name(x @ w, "h").square() * 0.5,
    "residual_gelu": lambda w, x: x + torch.nn.functional.gelu(x @ w),
    "norm_matmul_t": lambda w, x: _NORM(x) @ w.t(),
}
POLICIES = {
    "none": None,
    "dots": policies.dots_saveable,
    "everything": policies.everything_saveable,
    "names": policies.save_only_these_names("h"),
    "except_names": policies.save_anything_except_these_names("h"),
    "budget": policies.memory_budget(0.4),
    "offload": policies.save_and_offload_only_these_names(names_which_can_be_offloaded=["h"]),
}
# dropout needs a transform whose vmap (if any) allows randomness
TRANSFORMS_WITH_DROPOUT = ["grad", "vmap_grad", "grad_grad", "backward", "grad_vmap", "vmap_backward"]
TRANSFORMS = TRANSFORMS_WITH_DROPOUT + ["jacrev", "jacfwd", "hessian"]


def network(layers, dropout, wrap):
    def layer_fn(name):
        f = LAYERS[name]
        if dropout:
            return lambda w, x: torch.nn.functional.dropout(f(w, x), 0.3)
        return f

    def net(ws, x):
        for name, w in zip(layers, ws):
            x = wrap(layer_fn(name))(w, x)
        return x

    return net


def run(transform, net, ws, x, seed):
    torch.manual_seed(seed)
    loss = lambda ws, x: net(ws, x).sin().sum()  # noqa: E731
    if transform == "grad":
        return tf.grad(loss)(ws, x)
    if transform == "vmap_grad":
        return tf.vmap(tf.grad(loss), in_dims=(None, 0), randomness="different")(ws, x.unsqueeze(1))
    if transform == "grad_vmap":
        return tf.grad(lambda ws: tf.vmap(lambda x: loss(ws, x), randomness="different")(x.unsqueeze(1)).sum())(ws)
    if transform == "grad_grad":
        return tf.grad(lambda ws: sum(g.sin().sum() for g in tf.grad(loss)(ws, x)))(ws)
    if transform == "jacrev":
        return tf.jacrev(lambda x: net(ws, x))(x)
    if transform == "jacfwd":
        return tf.jacfwd(lambda x: net(ws, x))(x)
    if transform == "hessian":
        return tf.hessian(lambda x: loss(ws, x))(x)
    leaves = [w.clone().requires_grad_() for w in ws]
    if transform == "vmap_backward":
        tf.vmap(lambda x: loss(leaves, x), randomness="different")(x.unsqueeze(1)).sum().backward()
    else:
        loss(leaves, x).backward()
    return [w.grad for w in leaves]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.lists(st.sampled_from(sorted(LAYERS)), min_size=2, max_size=4),
    transform=st.sampled_from(TRANSFORMS),
    policy=st.sampled_from(sorted(POLICIES)),
    dropout=st.booleans(),
    per_layer=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_remat_never_changes_values_or_derivatives(layers, transform, policy, dropout, per_layer, seed):
    dropout = dropout and transform in TRANSFORMS_WITH_DROPOUT
    g = torch.Generator().manual_seed(seed)
    ws = [torch.randn(WIDTH, WIDTH, dtype=D, generator=g) for _ in layers]
    x = torch.randn(2, WIDTH, dtype=D, generator=g)
    plain = network(layers, dropout, lambda f: f)
    checkpointed = remat(policy=POLICIES[policy])
    if per_layer:
        rematted = network(layers, dropout, checkpointed)
    else:
        rematted = checkpointed(plain)
    assert_close(run(transform, rematted, ws, x, seed), run(transform, plain, ws, x, seed))
