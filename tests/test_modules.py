"""remat(module) is an nn.Module that stands in for the module it wraps."""

import copy

import pytest
import torch
import torch.func as tf
import torch.nn as nn
from torch.testing import assert_close

from funckpt import CheckpointError, checkpoint, checkpoint_sequential, policies, remat

D = torch.float64


def _net():
    return torch.nn.Sequential(torch.nn.Linear(4, 8, dtype=D), torch.nn.GELU(), torch.nn.Linear(8, 4, dtype=D))


def test_wrapper_is_a_module_with_the_original_keys():
    net = _net()
    wrapped = remat(net)
    assert isinstance(wrapped, torch.nn.Module)
    assert list(wrapped.state_dict()) == list(net.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in net.named_parameters()]
    wrapped.load_state_dict(_net().state_dict())
    assert_close(wrapped.state_dict(), net.state_dict())


def test_wrapper_is_an_instance_of_the_wrapped_modules_class():
    """Code that finds layers by class (transformers' output collection, an init function passed
    to ``model.apply``) finds a remat'd one; its type, and how its attributes resolve, stay the wrapper's."""
    import copy
    import io
    import pickle

    from funckpt._modules import Remat, RematSequential

    wrapper, seq = remat(nn.Linear(3, 2, dtype=D)), remat(_net())
    assert isinstance(wrapper, nn.Linear) and isinstance(wrapper, Remat) and type(wrapper) is Remat
    assert isinstance(seq, nn.Sequential) and type(seq) is RematSequential
    assert not isinstance(wrapper, nn.Conv1d)
    assert wrapper.__class__.__name__ == "Linear"  # (code that finds layers by class name finds it)
    assert repr(wrapper).startswith("Remat(")
    x = torch.randn(4, 3, dtype=D)
    for copied in (copy.deepcopy(wrapper), pickle.loads(pickle.dumps(wrapper))):
        assert type(copied) is Remat and isinstance(copied, nn.Linear)
        assert_close(copied(x), wrapper(x))
    buffer = io.BytesIO()
    torch.save(nn.Sequential(wrapper), buffer)
    buffer.seek(0)
    assert_close(torch.load(buffer, weights_only=False)(x), wrapper(x))


def test_a_whole_model_with_wrappers_loads_with_weights_only_and_its_classes_allowed():
    import io

    from funckpt._modules import Remat
    from funckpt._options import RematOptions

    model = nn.Sequential(remat(nn.Linear(3, 2, dtype=D)), nn.ReLU())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([Remat, RematOptions, nn.Linear, nn.Sequential, nn.ReLU]):
        loaded = torch.load(buffer, weights_only=True)
    x = torch.randn(4, 3, dtype=D)
    assert_close(loaded(x), model(x))


def test_posing_runs_none_of_the_wrapped_classes_subclass_hooks():
    registry = {}

    class Registered(nn.Module):
        def __init_subclass__(cls, **kwargs):
            super().__init_subclass__(**kwargs)
            registry[cls.__name__] = cls

    class Layer(Registered):
        def forward(self, x):
            return x.sin()

    assert isinstance(remat(Layer()), Layer)
    assert list(registry) == ["Layer"]


def test_a_parametrization_on_the_wrapper_after_one_on_the_wrapped_module():
    """The wrapped module parametrized after the wrapping, then the wrapper: both reach its forward."""
    from torch.nn.utils import parametrizations, parametrize

    class Double(nn.Module):
        def forward(self, b):
            return 2 * b

    def build(wrap):
        torch.manual_seed(0)
        layer = nn.Linear(4, 4, dtype=D)
        model = remat(layer) if wrap else layer
        parametrizations.orthogonal(layer)
        parametrize.register_parametrization(model, "bias", Double())
        return model

    x = torch.randn(2, 4, dtype=D)
    assert_close(build(True)(x), build(False)(x))
    assert isinstance(remat(nn.Linear(2, 2)).bias, nn.Parameter)  # (no property leaked to every wrapper)


def test_remat_of_a_wrapper_wraps_it_whole():
    from funckpt._modules import Remat, RematSequential

    assert type(remat(remat(_net()))) is Remat
    assert type(remat(remat(_net())).wrapped) is RematSequential
    with pytest.raises(ValueError, match="segments"):
        remat(remat(_net()), segments=2)


def test_an_init_function_applied_by_class_reaches_remat_layers_as_plain_ones():
    def init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight)
            nn.init.zeros_(m.bias)

    reference = _net()
    model = nn.Sequential(*(remat(m) for m in _net()))
    for m in (reference, model):
        torch.manual_seed(0)
        m.apply(init)
    assert_close(model.state_dict(), reference.state_dict())


@pytest.mark.parametrize("segments", [None, 1, 2, 3, 4, 5, 7])
def test_segments_never_start_with_a_layer_that_writes_its_input(segments):
    """torchvision's AlexNet and VGG features: ``ReLU(inplace=True)`` after each layer. Where an equal
    split would put one first in a segment, it would write the segment's input (the previous
    segment's output, which the recomputation starts from): the boundary moves past it."""
    def features():
        torch.manual_seed(0)
        layers = []
        for _ in range(3):
            layers += [nn.Linear(4, 4, dtype=D), nn.ReLU(inplace=True), nn.Dropout(0.0, inplace=True)]
        return nn.Sequential(*layers, nn.Linear(4, 2, dtype=D))

    reference, model = features(), remat(features(), segments=segments)
    x = torch.randn(3, 4, dtype=D)
    for m in (reference, model):
        m(x).square().sum().backward()
    assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])


@pytest.mark.parametrize("segments", [None, 2, 3, 4, 5])
@pytest.mark.parametrize(
    "before",
    [
        lambda: [nn.Identity()],
        lambda: [nn.Dropout(0.5).eval()],
        lambda: [nn.Flatten(), nn.Identity()],
        lambda: [nn.Sequential(nn.Identity())],
    ],
    ids=["Identity", "eval Dropout", "Flatten", "nested pass-through"],
)
def test_segments_never_start_where_a_later_layer_writes_their_input(before, segments):
    """A layer that hands on its input itself or a view of it (``Identity``, a dropout in eval mode,
    ``Flatten``) before ``ReLU(inplace=True)``: the in-place layer writes the segment's input just
    as if it came first. So does one first in a nested ``Sequential``."""
    def features():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(4, 4, dtype=D), *before(), nn.ReLU(inplace=True), nn.Linear(4, 4, dtype=D),
            nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 2, dtype=D)),
        )

    reference, model = features(), remat(features(), segments=segments)
    x = torch.randn(3, 4, dtype=D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    reference(x).square().sum().backward()
    model(x2).square().sum().backward()
    assert_close(x2.grad, x.grad)
    assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])


def test_global_module_hooks_apply_once_to_a_remat_layer():
    """The wrapper's call stands for the layer's (it poses as its class): a global hook runs on it,
    not again on the wrapped layer's call inside, so one that changes a Linear's output or
    gradient changes it once, as without remat."""
    from torch.nn.modules import module as torch_module

    seen = []

    def forward_hook(m, args, out):
        seen.append(type(m).__name__)
        return 2 * out if isinstance(m, nn.Linear) else None

    def backward_hook(m, grad_input, grad_output):
        return tuple(None if g is None else g / 4 for g in grad_input) if isinstance(m, nn.Linear) else None

    def run(model):
        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        handles = [torch_module.register_module_forward_hook(forward_hook), torch_module.register_module_full_backward_hook(backward_hook)]
        try:
            seen.clear()
            out = model(x)
            forward_calls = list(seen)
            out.square().sum().backward()
        finally:
            for h in handles:
                h.remove()
        return out, x.grad, forward_calls

    torch.manual_seed(0)
    layer = nn.Linear(4, 4, dtype=D)
    out, grad, calls = run(remat(layer))
    reference_out, reference_grad, reference_calls = run(layer)
    assert_close(out, reference_out)
    assert_close(grad, reference_grad)
    assert len(calls) == len(reference_calls) == 1


@pytest.mark.parametrize("pre", [False, True])
def test_global_backward_hooks_apply_once_where_the_layer_has_its_own_too(pre):
    """A layer with full backward (pre-)hooks of its own: torch's ``_call_impl`` asks it for its
    backward hooks, and torch's answer adds the global ones, which the wrapper's call already
    applies. A global hook scaling the gradient scales it once, as without remat, and the
    layer's own hook runs once."""
    from torch.nn.modules import module as torch_module

    own = []

    def run(wrap):
        torch.manual_seed(0)
        layer = nn.Linear(4, 4, dtype=D)
        layer.register_full_backward_hook(lambda m, gi, go: own.append("hook"))
        layer.register_full_backward_pre_hook(lambda m, go: own.append("pre-hook"))
        model = wrap(layer)
        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        if pre:
            handle = torch_module.register_module_full_backward_pre_hook(lambda m, go: tuple(g * 3 for g in go))
        else:
            handle = torch_module.register_module_full_backward_hook(
                lambda m, gi, go: tuple(None if g is None else g * 2 for g in gi)
            )
        own.clear()
        try:
            model(x).square().sum().backward()
        finally:
            handle.remove()
        assert sorted(own) == ["hook", "pre-hook"]
        assert "_get_backward_hooks" not in vars(layer)  # (the call's own attributes are gone)
        return x.grad, layer.weight.grad

    assert_close(run(remat), run(lambda m: m))


@pytest.mark.parametrize("kind", ["hook", "pre-hook"])
@pytest.mark.parametrize("change", ["removed", "added", "registered_inside"])
@pytest.mark.parametrize("how", ["remat_function", "remat_outer_module", "checkpoint_sequential"])
def test_backward_hooks_of_a_module_inside_are_those_it_had_at_the_call(kind, change, how):
    """Without remat a module's call takes its full backward (pre-)hooks as they are then: removed
    between the forward and the backward pass, they run all the same; registered in between, they
    do not; registered by the function itself, once per call. A recomputation calls the module again
    in the backward pass, and gets the hooks it had at the call (they went missing, or one more ran,
    or the function's own accumulated on the module, one more at each recomputation)."""
    ran = []

    def register(layer):
        if kind == "hook":
            return layer.register_full_backward_hook(lambda m, gi, go: (ran.append(kind), (gi[0] * 3,))[1])
        return layer.register_full_backward_pre_hook(lambda m, go: (ran.append(kind), (go[0] * 3,))[1])

    def run(wrap):
        torch.manual_seed(0)
        inner = nn.Linear(4, 4, dtype=D)
        model = nn.Sequential(nn.Linear(4, 4, dtype=D), nn.Tanh(), inner, nn.Tanh())
        handles = [register(inner)] if change == "removed" else []

        def fn(x):
            if change == "registered_inside":
                handles.append(register(inner))
            return model(x)

        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        grads = []
        for _ in range(2):  # (a second step: the hooks the first left on the module)
            ran.clear()
            out = wrap(fn, model)(x)
            if change == "removed":
                handles.pop().remove()
            elif change == "added":
                handles.append(register(inner))
            out.square().sum().backward()
            grads.append((x.grad.clone(), inner.weight.grad.clone(), len(ran)))
            for handle in handles:
                handle.remove()
            handles.clear()
            if change == "removed":
                handles.append(register(inner))
        return grads

    if how == "checkpoint_sequential" and change == "registered_inside":
        pytest.skip("checkpoint_sequential calls the model's layers: no function of the user's to register from")
    wraps = {
        "remat_function": lambda fn, model: remat(fn),
        "remat_outer_module": lambda fn, model: (lambda x: remat(lambda x: fn(x) * 1)(x)),
        "checkpoint_sequential": lambda fn, model: (lambda x: checkpoint_sequential(model, 2, x)),
    }
    assert_close(run(wraps[how]), run(lambda fn, model: fn))


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "forward_with_kwargs", "forward_removing_itself"])
@pytest.mark.parametrize("change", ["removed", "added", "registered_inside"])
@pytest.mark.parametrize("check", ["default", "none"])
def test_forward_hooks_of_a_module_inside_are_those_it_had_at_the_call(kind, change, check):
    """A forward hook (or pre-hook) that changes a module's output (an activation patch) and is
    removed once the forward pass is done made the values the gradient is of; one registered after
    the forward pass changed none. A recomputation calls the module again and gets the forward hooks
    it had at the call (it computed other values: a false "did not reproduce", or with the check
    off a wrong gradient), as without remat and under torch.utils.checkpoint."""
    def register(layer):
        if kind == "forward":
            return layer.register_forward_hook(lambda m, i, o: o * 3)
        if kind == "forward_pre":
            return layer.register_forward_pre_hook(lambda m, i: (i[0] * 3,))
        if kind == "forward_with_kwargs":
            return layer.register_forward_hook(lambda m, i, kw, o: o * 3, with_kwargs=True)
        handle = None

        def once(m, i, o):
            handle.remove()
            return o * 3

        handle = layer.register_forward_hook(once)
        return handle

    def run(wrap):
        torch.manual_seed(0)
        inner = nn.Tanh()
        model = nn.Sequential(nn.Linear(4, 4, dtype=D), inner, nn.Linear(4, 4, dtype=D), nn.Tanh())
        handles = [register(inner)] if change == "removed" else []

        def fn(x):
            if change == "registered_inside":
                handles.append(register(inner))
            return model(x)

        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        grads = []
        for _ in range(2):  # (a second step: the hooks the first left on the module)
            out = wrap(fn)(x)
            if change == "removed":
                handles.pop().remove()
            elif change == "added":
                handles.append(register(inner))
            out.square().sum().backward()
            grads.append((x.grad.clone(), model[0].weight.grad.clone()))
            for handle in handles:
                handle.remove()
            handles.clear()
            if change == "removed":
                handles.append(register(inner))
        return grads

    assert_close(run(lambda fn: remat(fn, determinism_check=check)), run(lambda fn: fn))


@pytest.mark.parametrize("kind", ["full_backward", "full_backward_pre", "forward", "forward_pre"])
@pytest.mark.parametrize("change", ["removed", "added", "registered_inside"])
@pytest.mark.parametrize("how", ["remat_function", "remat_sequential", "checkpoint_sequential"])
def test_global_module_hooks_inside_are_those_registered_at_the_call(kind, change, how):
    """Without remat each module call takes torch's global module hooks as they are then
    (``register_module_full_backward_hook``, ``..._full_backward_pre_hook``, ``register_module_forward_hook``,
    ``..._forward_pre_hook``): removed between the forward and the backward pass, a backward hook runs
    all the same and the forward pass's values stand; registered in between, it does not run.
    A recomputation calls the modules again in the backward pass with the global hooks registered at
    the call (a backward hook went missing or one more ran, silently; a forward hook that changes an
    output made the recomputation compute another one, a false "did not reproduce")."""
    from torch.nn.modules import module as torch_module

    if change == "registered_inside" and how != "remat_function":
        pytest.skip("the model is called without a function of the test's to register in")
    ran = []

    def register():
        # (Each scales what goes through the Tanh layers, and counts its runs in the backward pass.)
        if kind == "full_backward":
            return torch_module.register_module_full_backward_hook(
                lambda m, gi, go: (ran.append(kind), (gi[0] * 3,))[1] if isinstance(m, nn.Tanh) else None
            )
        if kind == "full_backward_pre":
            return torch_module.register_module_full_backward_pre_hook(
                lambda m, go: (ran.append(kind), (go[0] * 3,))[1] if isinstance(m, nn.Tanh) else None
            )
        if kind == "forward":
            return torch_module.register_module_forward_hook(lambda m, i, o: o * 3 if isinstance(m, nn.Tanh) else None)
        return torch_module.register_module_forward_pre_hook(lambda m, i: (i[0] * 3,) if isinstance(m, nn.Tanh) else None)

    def run(wrap):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4, dtype=D), nn.Tanh(), nn.Linear(4, 4, dtype=D), nn.Tanh())
        handles = [register()] if change == "removed" else []

        def fn(x):
            if change == "registered_inside":
                handles.append(register())
            return model(x)

        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        grads = []
        try:
            for _ in range(2):  # (a second step: what the first left registered)
                ran.clear()
                out = wrap(fn, model)(x)
                if change == "removed":
                    handles.pop().remove()
                elif change == "added":
                    handles.append(register())
                out.square().sum().backward()
                grads.append((x.grad.clone(), model[2].weight.grad.clone(), len(ran)))
                for handle in handles:
                    handle.remove()
                handles.clear()
                if change == "removed":
                    handles.append(register())
        finally:
            for handle in handles:
                handle.remove()
        return grads

    wraps = {
        "remat_function": lambda fn, model: remat(fn),
        "remat_sequential": lambda fn, model: remat(model, segments=2),
        "checkpoint_sequential": lambda fn, model: (lambda x: checkpoint_sequential(model, 2, x)),
    }
    assert_close(run(wraps[how]), run(lambda fn, model: fn))


def test_the_wrapped_class_own_train_and_apply_run():
    """``remat(block).train()`` and ``.half()``/``.to()`` run the block's class's overrides: a
    block that keeps its BatchNorm frozen in training, and one buffer in float32 under conversions."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 4, dtype=D), nn.BatchNorm1d(4, dtype=D)
            self.register_buffer("scale", torch.arange(4.0, dtype=torch.float32))

        def train(self, mode=True):
            super().train(mode)
            self.bn.eval()
            return self

        def _apply(self, fn, recurse=True):
            scale = self.scale
            out = super()._apply(fn, recurse)
            self.scale = fn(scale).float()
            return out

        def forward(self, x):
            return self.bn(self.lin(x)) * self.scale.to(x.dtype)

    torch.manual_seed(0)
    reference = Block()
    model = remat(Block())
    model.load_state_dict(reference.state_dict())
    reference.train(), model.train()
    assert not model.bn.training and model.training
    x = torch.randn(8, 4, dtype=D)
    reference(x).sum().backward()
    model(x).sum().backward()
    assert_close(model.state_dict(), reference.state_dict())
    assert_close([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])
    reference.to(torch.float32), model.to(torch.float32)
    assert model.scale.dtype == torch.float32 and model.lin.weight.dtype == torch.float32


def test_a_second_wrapper_of_a_module_parametrized_through_the_first():
    """A parametrization registered on one wrapper is the module's: another wrapper of the same
    module reads it too, and does not take its missing property for a removal."""
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, b):
            return 2 * b

    torch.manual_seed(0)
    layer = nn.Linear(4, 4, dtype=D)
    reference = nn.Linear(4, 4, dtype=D)
    reference.load_state_dict(layer.state_dict())
    first = remat(layer)
    parametrize.register_parametrization(first, "bias", Double())
    parametrize.register_parametrization(reference, "bias", Double())
    x = torch.randn(3, 4, dtype=D)
    assert_close(first(x), reference(x))
    assert_close(remat(layer)(x), reference(x))
    assert_close(layer(x), reference(x))
    parametrize.remove_parametrizations(first, "bias")
    parametrize.remove_parametrizations(reference, "bias")
    assert_close(remat(layer)(x), reference(x))
    assert_close(layer(x), reference(x))


def test_wrapper_as_submodule_keeps_prefixed_keys_and_gradients():
    inner = _net()
    outer = torch.nn.Sequential(remat(inner), torch.nn.Tanh())
    reference = torch.nn.Sequential(inner, torch.nn.Tanh())
    assert list(outer.state_dict()) == list(reference.state_dict())
    x = torch.randn(3, 4, dtype=D)
    params = dict(reference.named_parameters())
    loss = lambda m: (lambda p: tf.functional_call(m, p, (x,)).square().sum())  # noqa: E731
    assert_close(tf.grad(loss(outer))(params), tf.grad(loss(reference))(params))


def test_train_and_eval_reach_the_wrapped_module():
    net = torch.nn.Dropout(0.5)
    wrapped = remat(net)
    wrapped.eval()
    assert not net.training
    wrapped.train()
    assert net.training


def _deep(n):
    layers = []
    for _ in range(n):
        layers += [torch.nn.Linear(4, 4, dtype=D), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def test_sequential_split_matches_checkpoint_sequential():
    from funckpt._modules import default_segments, split

    assert split(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert split(2, 5) == [(0, 1), (1, 2)]
    assert default_segments(16) == 4 and default_segments(1) == 1


def test_sequential_in_segments_gives_the_same_gradients_and_recomputes():
    net = _deep(8)
    x = torch.randn(3, 4, dtype=D)
    params = dict(net.named_parameters())
    wrapped = remat(net, segments=4)
    assert wrapped.num_segments == 4
    loss = lambda m: (lambda p: tf.functional_call(m, p, (x,)).square().sum())  # noqa: E731
    assert_close(tf.grad(loss(wrapped))(params), tf.grad(loss(net))(params))

    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: calls.append(m))
    try:
        wrapped(x).sum().backward()
    finally:
        handle.remove()
    linear_calls = sum(isinstance(m, torch.nn.Linear) for m in calls)
    # 8 linears run forward; all 4 segments (8 linears), the last included, run again in backward
    assert linear_calls == 8 + 8


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6, dtype=D), torch.nn.BatchNorm1d(6, dtype=D), torch.nn.Tanh())


def test_batchnorm_running_stats_update_once_per_forward_not_in_recomputation():
    x = torch.randn(8, 4, dtype=D)
    reference, rematted = _bn_net(), _bn_net()
    wrapped = remat(rematted)
    reference(x).square().sum().backward()
    wrapped(x).square().sum().backward()
    assert_close(rematted.state_dict(), reference.state_dict())
    assert rematted[1].num_batches_tracked.item() == 1
    assert_close([p.grad for p in rematted.parameters()], [p.grad for p in reference.parameters()])


def test_batchnorm_under_functional_call_and_grad():
    x = torch.randn(8, 4, dtype=D)
    reference, rematted = _bn_net(), _bn_net()
    wrapped = remat(rematted)

    def loss(module, params, buffers):
        return tf.functional_call(module, (params, buffers), (x,)).square().sum()

    def grads(module, net):
        return tf.grad(loss, argnums=1)(module, dict(net.named_parameters()), dict(net.named_buffers()))

    assert_close(grads(wrapped, rematted), grads(reference, reference))
    # functional_call updated the buffers it was given, once, in the forward run
    assert_close(rematted.state_dict(), reference.state_dict())


def test_eval_mode_uses_running_stats_in_forward_and_recomputation():
    x = torch.randn(8, 4, dtype=D)
    reference, rematted = _bn_net(), _bn_net()
    reference.eval()
    wrapped = remat(rematted).eval()
    assert not rematted.training
    reference(x).sum().backward()
    wrapped(x).sum().backward()
    assert_close([p.grad for p in rematted.parameters()], [p.grad for p in reference.parameters()])


def test_stack_module_state_ensemble_under_vmap():
    import copy

    torch.manual_seed(0)
    members = [_net() for _ in range(3)]
    params, buffers = tf.stack_module_state(members)
    x = torch.randn(5, 4, dtype=D)

    def ensemble_loss(module, params):
        base = copy.deepcopy(module).to("meta")

        def one(p, b):
            return tf.functional_call(base, (p, b), (x,)).square().sum()

        return tf.vmap(one)(params, buffers).sum()

    expected = tf.grad(lambda p: ensemble_loss(members[0], p))(params)
    got = tf.grad(lambda p: ensemble_loss(remat(members[0]), p))(params)
    assert_close(got, expected)


def _ensemble_member(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8, dtype=D), nn.BatchNorm1d(8, dtype=D), nn.Tanh(), nn.Linear(8, 1, dtype=D)).train()


def _remat_batch_norm(net):
    net[1] = remat(net[1])
    return net


def _remat_block(net):
    return nn.Sequential(remat(nn.Sequential(net[0], net[1])), net[2], net[3])


@pytest.mark.parametrize("transform", ["vmap(grad)", "vmap then backward"])
@pytest.mark.parametrize("place", [_remat_batch_norm, remat, _remat_block], ids=["batch norm", "whole model", "block"])
def test_ensemble_with_batch_norm_in_training_mode_under_vmap(transform, place):
    """Model ensembling (stack_module_state, vmap over the members) with BatchNorm in training mode:
    each member's running statistics, a slice of the stacked buffers, are updated in place under
    vmap. With remat anywhere around it, the gradients and the updated statistics are those
    without remat (the forward run updates them once; the recomputation starts from copies).
    Under vmap(grad) the statistics join the forward run's own grad level, as torch.func.grad
    wraps all of its arguments (see at_the_top_level)."""
    members = [_ensemble_member(s) for s in range(3)]
    params, buffers = tf.stack_module_state(members)
    x = torch.randn(5, 4, dtype=D)

    def run(net):
        # The remat'd model's own names for the stacked tensors (a remat'd block nests them).
        names = [n for n, _ in net.named_parameters()], [n for n, _ in net.named_buffers()]
        p = dict(zip(names[0], params.values()))
        b = dict(zip(names[1], (v.clone() for v in buffers.values())))

        def loss(p, b, x):
            return tf.functional_call(net, (p, b), (x,)).square().mean()

        if transform == "vmap(grad)":
            grads = list(tf.vmap(tf.grad(loss), in_dims=(0, 0, None))(p, b, x).values())
        else:
            leaves = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
            tf.vmap(loss, in_dims=(0, 0, None))(leaves, b, x).sum().backward()
            grads = [v.grad for v in leaves.values()]
        return grads, list(b.values())

    expected = run(_ensemble_member(0))
    assert_close(run(place(_ensemble_member(0))), expected)
    assert not torch.equal(expected[1][0], buffers["1.running_mean"])  # (the statistics did move)


def test_replacing_a_layer_after_wrapping_is_seen():
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4, dtype=D) for _ in range(4)])
    wrapped = remat(net)
    net[0] = torch.nn.Linear(4, 4, dtype=D)
    x = torch.randn(2, 4, dtype=D)
    assert_close(wrapped(x), net(x))
    wrapped(x).sum().backward()
    assert net[0].weight.grad is not None


def test_remat_of_a_sequential_reads_like_the_sequential():
    seq = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    wrapped = remat(seq)
    assert len(wrapped) == 3 and wrapped[1] is seq[1] and list(wrapped) == list(seq)
    assert list(wrapped[1:]) == list(seq[1:])


@pytest.mark.parametrize("how", ["remat(bn)", "closure", "argument", "segments"])
@pytest.mark.parametrize("backwards", [1, 2])
def test_remat_d_batch_norm_updates_its_statistics_once_per_forward(how, backwards):
    """The recomputation writes copies of the running statistics, never the module's own."""
    torch.manual_seed(0)
    plain = nn.BatchNorm1d(3, dtype=torch.float64)
    bn = nn.BatchNorm1d(3, dtype=torch.float64)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    run = {
        "remat(bn)": lambda: remat(bn)(x),
        "closure": lambda: remat(lambda x: bn(x))(x),
        "argument": lambda: remat(lambda x, m: m(x))(x, bn),
        "segments": lambda: remat(nn.Sequential(bn, nn.Tanh()), segments=2)(x),
    }[how]
    out = run().square().sum()
    expected = (plain(x).tanh() if how == "segments" else plain(x)).square().sum()
    for i in range(backwards):
        retain = i < backwards - 1
        assert_close(torch.autograd.grad(out, x, retain_graph=retain), torch.autograd.grad(expected, x, retain_graph=retain))
    assert_close(bn.state_dict(), plain.state_dict())


def test_a_buffer_the_forward_updates_is_recomputed_from_its_old_value_however_it_is_read():
    """The recomputation starts from the buffer's value at the call, through its module's
    attribute and through another path to the same tensor alike (a list the module keeps);
    the buffer is left as the forward pass left it, with the caller's update after it."""

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros((), dtype=torch.float64))
            self.seen = [self.count]  # the same tensor, reached without the attribute

        def forward(self, x):
            self.count.add_(1)
            return x * self.count.clone() + x.sin() * self.seen[0].clone()

    def program(m):
        x = torch.linspace(0.1, 1, 4, dtype=torch.float64, requires_grad=True)
        out = m(x).sum()
        m.count.add_(10)  # (between forward and backward, as a later forward pass would)
        return torch.autograd.grad(out, x), m.count.clone()

    assert_close(program(remat(Counting())), program(Counting()))


def test_a_buffer_the_forward_updates_then_resized_before_the_backward_is_recomputed_from_its_old_value():
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("count", torch.zeros(1, dtype=torch.float64))

        def forward(self, x):
            self.count.add_(1)
            return x * self.count.clone()

    def program(m):
        x = torch.linspace(0.1, 1, 4, dtype=torch.float64, requires_grad=True)
        out = m(x).sum()
        m.count.resize_(3).fill_(5.0)
        return torch.autograd.grad(out, x), m.count.clone()

    assert_close(program(remat(Counting())), program(Counting()))


class _CarriedHidden(nn.Module):
    """An RNN carrying its hidden state across batches (truncated backpropagation through time):
    ``None`` until its first call, then the last state, detached."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(4, 5, dtype=D)
        self.hidden = None
        self.calls = 0

    def forward(self, xs):
        self.calls += 1
        h = self.hidden
        for x in xs:
            h = self.cell(x, h)
        self.hidden = h.detach()
        return h


@pytest.mark.parametrize("how", ["remat(module)", "checkpoint", "torch.func.grad"])
def test_state_a_module_starts_on_its_first_call_is_recomputed_from_none(how):
    """A tensor attribute that was ``None`` at the call and that the forward run sets (without a
    graph) is state, as a tensor attribute rebound is: the recomputation starts from ``None``, as
    the forward run did (it used to read the forward run's new state and raise "did not
    reproduce"), and the module keeps the forward run's state, and the count of its calls, as
    without remat."""
    import funckpt

    def program(rematted):
        torch.manual_seed(0)
        rnn = _CarriedHidden()
        results = []
        for step in range(3):
            xs = torch.linspace(-1, 1, 24, dtype=D).view(3, 2, 4) * (step + 1)
            if how == "torch.func.grad":
                module = remat(rnn) if rematted else rnn
                params = {k: v.detach() for k, v in rnn.named_parameters()}
                results.append(tf.grad(lambda p: tf.functional_call(module, p, (xs,)).sin().sum())(params))
            else:
                if not rematted:
                    out = rnn(xs)
                elif how == "checkpoint":
                    out = funckpt.checkpoint(rnn, xs, use_reentrant=False)
                else:
                    out = remat(rnn)(xs)
                out.sin().sum().backward()
                results.append([p.grad.clone() for p in rnn.parameters()])
            results.append(rnn.hidden)
        return results, rnn.calls

    assert_close(program(True), program(False))


class _AddsItsLastOutput(nn.Module):
    """Adds its previous output, graph and all, to the next one (``None`` before its first call)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=D)
        self.last = None

    def forward(self, x):
        h = self.lin(x).tanh()
        out = h if self.last is None else h + self.last
        self.last = h
        return out


@pytest.mark.parametrize("calls", [1, 2, 3])
def test_a_tensor_with_a_graph_a_module_keeps_from_its_first_call_is_recomputed_from_none(calls):
    """As above, for a tensor the forward run computed with a graph: it is an output of the call
    (a tensor kept outside it), and the recomputation starts from ``None`` as the forward run did
    (it used to read the kept tensor and raise on a correct program)."""

    def program(rematted):
        torch.manual_seed(0)
        module = _AddsItsLastOutput()
        call = remat(module) if rematted else module
        x = torch.linspace(-1, 1, 6, dtype=D).view(2, 3).requires_grad_()
        sum(call(x * (i + 1)).sin().sum() for i in range(calls)).backward()
        return x.grad, [p.grad for p in module.parameters()]

    assert_close(program(True), program(False))


class _AddsItsLastOutputDetached(nn.Module):
    """Keeps its output, graph and all, for the caller and its next call, which reads it detached."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, dtype=D)
        self.last = None

    def forward(self, x):
        h = self.lin(x).tanh()
        out = h if self.last is None else (h + self.last.detach()).sin()
        self.last = h
        return out


@pytest.mark.parametrize("reads_kept", [False, True])
def test_a_tensor_a_module_kept_at_the_previous_step_is_where_the_recomputation_starts(reads_kept):
    """A backward pass per step: at the next call the attribute holds the previous step's kept
    tensor, its graph spent (not routed into the call, so no place of the call puts it back). The
    recomputation starts from it, as the forward run did; it used to read the tensor the forward run
    kept instead and raise "did not reproduce" on a correct program (torch.utils.checkpoint runs it)."""

    def program(rematted):
        torch.manual_seed(0)
        module = _AddsItsLastOutputDetached()
        call = remat(module) if rematted else module
        results = []
        for step in range(3):
            x = (torch.linspace(-1, 1, 6, dtype=D).view(2, 3) * (step + 1)).requires_grad_()
            loss = call(x).square().sum()
            if reads_kept:
                loss = loss + module.last.sum()
            loss.backward()
            results.append([x.grad, *[p.grad.clone() for p in module.parameters()], module.last.detach()])
        return results

    assert_close(program(True), program(False))


@pytest.mark.parametrize("outer", ["remat", "checkpoint"])
def test_a_tensor_kept_by_a_module_remat_d_inside_a_remat_d_call_is_where_the_outer_recomputation_starts(outer):
    """The module above, remat'd itself inside a remat'd (or checkpointed) network: the outer
    call's recomputation runs the inner call again, which must read what the attribute held at the
    outer call (``None``, then the previous step's kept tensor). The outer walk listed the remat
    wrapper, whose attributes are not the module's: the inner call run again read the tensor the
    forward run kept and raised "did not reproduce" on a correct program."""

    class Network(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.lin = inner, nn.Linear(3, 3, dtype=D)

        def forward(self, x):
            return self.lin(self.inner(x)).cos()

    def program(rematted):
        torch.manual_seed(0)
        module = _AddsItsLastOutputDetached()
        net = Network(remat(module) if rematted else module)
        call = net if not rematted else remat(net) if outer == "remat" else (lambda x: checkpoint(net, x))
        results = []
        for step in range(3):
            x = (torch.linspace(-1, 1, 6, dtype=D).view(2, 3) * (step + 1)).requires_grad_()
            (call(x).square().sum() + module.last.sum()).backward()
            results.append([x.grad, *[p.grad.clone() for p in net.parameters()], module.last.detach()])
        return results

    assert_close(program(True), program(False))


def test_remat_module_reads_the_wrapped_modules_plain_attributes():
    """Models read their layers' attributes (HF ModernBERT's attention_type, Swin's downsample)."""

    class Layer(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(3, 3)
            self.attention_type = "sliding"
            self.downsample = None

    wrapped = remat(Layer())
    assert wrapped.attention_type == "sliding" and wrapped.downsample is None
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        wrapped.missing


@pytest.mark.parametrize("how", ["remat(module)", "checkpoint", "remat(fn) closing over the module", "scan"])
def test_mode_switched_between_forward_and_backward_recomputes_in_the_forward_mode(how):
    """``model.eval()`` (or ``.train()``) between the forward and the backward pass: the
    recomputation runs in the modes of the forward pass (dropout drawing its masks, BatchNorm
    on batch statistics), as the graph of the model without remat does; the modes are left
    as the caller set them."""
    import funckpt

    x = torch.randn(6, 4, dtype=D)
    checkpointed = {
        "remat(module)": lambda net, h: remat(net)(h),
        "checkpoint": lambda net, h: funckpt.checkpoint(net, h, use_reentrant=False),
        "remat(fn) closing over the module": lambda net, h: remat(lambda v: net(v))(h),
        "scan": lambda net, h: funckpt.scan(lambda c, _: (net(c), None), h, None, length=2, checkpoints=1)[0],
    }[how]
    plain = (lambda net, h: net(net(h))) if how == "scan" else (lambda net, h: net(h))
    for start_training in (True, False):
        results = []
        for call in (checkpointed, plain):
            torch.manual_seed(0)
            # (a loop's step may not update BatchNorm statistics: README, checkpointed loops)
            norm = nn.LayerNorm(4, dtype=D) if how == "scan" else nn.BatchNorm1d(4, dtype=D)
            net = nn.Sequential(nn.Linear(4, 4, dtype=D), norm, nn.Dropout(0.5), nn.Tanh())
            net.train(start_training)
            torch.manual_seed(1)
            h = x.clone().requires_grad_()
            loss = call(net, h).square().sum()
            net.train(not start_training)  # switched before the backward
            loss.backward()
            assert all(m.training is (not start_training) for m in net.modules())
            results.append([h.grad, *(p.grad for p in net.parameters())])
        assert_close(results[0], results[1])


class _WithExtraState(torch.nn.Module):
    """A module with extra state (a step counter) and its own load-time conversion: it drops
    a legacy key that older checkpoints have (as timm's frozen BatchNorm drops
    ``num_batches_tracked``)."""

    _version = 3

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.step = 0

    def get_extra_state(self):
        return {"step": self.step}

    def set_extra_state(self, state):
        self.step = state["step"]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict.pop(prefix + "legacy", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x):
        return self.lin(x)


def _extra_state_model(rematted):
    torch.manual_seed(0)
    inner = _WithExtraState()
    sn = torch.nn.utils.spectral_norm(torch.nn.Linear(4, 4, dtype=D))
    bn = torch.nn.BatchNorm1d(4, dtype=D)
    hooked = torch.nn.Linear(4, 4, dtype=D)
    hooked.register_state_dict_post_hook(lambda m, sd, prefix, meta: sd.__setitem__(prefix + "tag", torch.ones(1)))
    layers = [inner, sn, bn, hooked]
    return torch.nn.Sequential(*[remat(m) if rematted else m for m in layers])


def test_state_dict_is_the_wrapped_modules_own_with_extra_state_metadata_and_hooks():
    """remat(m) saves and loads as m does: extra state, version metadata (BatchNorm's, spectral
    norm's), state-dict hooks, and the class's own _load_from_state_dict."""
    reference, model = _extra_state_model(False), _extra_state_model(True)
    reference[0].step = 7
    saved = reference.state_dict()
    assert list(model.state_dict()) == list(saved)
    assert model.state_dict()._metadata == saved._metadata
    legacy = dict(saved, **{"0.legacy": torch.zeros(1)})
    legacy.pop("3.tag")
    assert not model.load_state_dict(legacy, strict=True).missing_keys
    assert model[0].step == 7
    assert_close(model.state_dict(), saved)
    # and back: what the remat'd model saves loads into the plain one
    model[0].step = 9  # set through the wrapper
    fresh = _extra_state_model(False)
    state = model.state_dict()
    state.pop("3.tag")
    fresh.load_state_dict(state)
    assert fresh[0].step == 9


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, dtype=D)
        self.scale = 1.0

    def forward(self, x):
        out = torch.tanh(self.lin(x)) * self.scale
        return out + self.shift if hasattr(self, "shift") else out


def test_attributes_set_and_deleted_through_the_wrapper_reach_the_wrapped_module():
    """Configuring a remat'd module by its attributes (diffusers' enable_freeu sets s1, s2, b1, b2
    on each up block) configures the module that runs: the wrapper reads through and writes
    through alike, never silently running the unconfigured module."""
    import copy

    torch.manual_seed(0)
    reference = _Scaled()
    model = remat(copy.deepcopy(reference))
    x = torch.randn(3, 4, dtype=D)
    for m in (reference, model):
        m.scale = 0.5  # an existing attribute
        m.shift = 2.0  # a new one
    assert model.scale == model.wrapped.scale == 0.5 and model.wrapped.shift == 2.0
    assert_close(model(x), reference(x))
    for m in (reference, model):
        del m.shift
    assert not hasattr(model, "shift") and not hasattr(model.wrapped, "shift")
    assert_close(model(x), reference(x))
    # the wrapper's own state stays its own
    model.register_forward_hook(lambda *a: None)
    assert model._forward_hooks and not model.wrapped._forward_hooks
    model.eval()
    assert not model.training and not model.wrapped.training


def test_training_flag_set_directly_reaches_the_wrapped_module():
    """``for m in model.modules(): m.training = False`` (code that switches modes without
    ``eval()``) reaches the wrapper, not the module it wraps (which is not among the
    modules): the wrapped BatchNorm then runs in that mode too, as the plain model does."""
    import copy

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=D), torch.nn.BatchNorm1d(4, dtype=D))
    model = torch.nn.Sequential(*[remat(m) for m in copy.deepcopy(reference)])
    x = torch.randn(8, 4, dtype=D)
    for training in (False, True):
        for net in (reference, model):
            for m in net.modules():
                m.training = training
        assert all(m.wrapped.training is training for m in model)
        x_ref, x_remat = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out = reference(x_ref), model(x_remat)
        assert_close(out, out_ref)
        out_ref.square().sum().backward()
        out.square().sum().backward()
        assert_close(x_remat.grad, x_ref.grad)
        assert_close(dict(model.named_buffers()), dict(reference.named_buffers()))


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal"])
def test_parametrization_registered_on_the_wrapper_reaches_the_wrapped_module(kind):
    """``parametrizations.orthogonal(remat(layer))``: the parametrization is registered on the wrapper,
    whose class gets the ``weight`` property; the wrapped layer's forward reads ``self.weight`` and must
    see it too. Trained for a few steps, then the parametrization removed through the wrapper, against
    the same network parametrized without remat."""
    from torch.nn.utils import parametrizations, parametrize

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6, dtype=D), nn.Tanh(), nn.Linear(6, 6, dtype=D), nn.Tanh(), nn.Linear(6, 2, dtype=D))

    reference, model = net(), net()
    model[2] = remat(model[2])
    for m in (reference, model):
        torch.manual_seed(1)  # spectral_norm draws its power-iteration vectors
        getattr(parametrizations, kind)(m[2])
    assert list(model.state_dict()) == list(reference.state_dict())

    def steps(n):
        for m in (reference, model):
            opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            torch.manual_seed(2)
            for _ in range(n):
                m(torch.randn(5, 4, dtype=D)).square().sum().backward()
                opt.step()
                opt.zero_grad()
        assert_close(model.state_dict(), reference.state_dict())

    steps(3)
    x = torch.randn(5, 4, dtype=D)
    params = {k: v.detach() for k, v in reference.named_parameters()}
    loss = lambda m: (lambda p: tf.functional_call(m, p, (x,)).square().sum())  # noqa: E731
    assert_close(tf.grad(loss(model))(params), tf.grad(loss(reference))(params))
    with parametrize.cached():
        assert_close(model(x), reference(x))
    for m in (reference, model):
        parametrize.remove_parametrizations(m[2], "weight")
    assert not parametrize.is_parametrized(model[2].wrapped)
    assert type(model[2].wrapped) is nn.Linear
    steps(2)


@pytest.mark.parametrize("kind", ["spectral_norm", "orthogonal"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("use", ["one call", "two calls", "read before the call"])
def test_stateful_parametrization_under_cached_is_computed_once_or_refused(kind, training, use):
    """Under ``parametrize.cached()`` a parametrized weight is computed once in the block; a remat'd
    call computes it in a cache of its own. ``spectral_norm`` in training mode advances its power
    iteration each time it is computed: a second remat'd call in the block (or one after the caller
    read the weight) silently advanced it once more than without remat (a relative drift of 3e-6 in
    the weight's gradient and in its ``_u``/``_v`` buffers). Such a call is now refused, the state left
    as it was; a stateless parametrization (orthogonal), eval mode and a single call stay as without
    remat."""
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    base = getattr(parametrizations, kind)(nn.Linear(4, 4, dtype=D))

    def run(wrap):
        model = copy.deepcopy(base).train(training)
        layer = wrap(model)
        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with parametrize.cached():
            before = model.weight if use == "read before the call" else torch.zeros((), dtype=D)
            y = layer(x)
            if use == "two calls":
                y = layer(y)
            (y.square().sum() + (before * 2).sum()).backward()
        return y.detach(), x.grad, [p.grad for p in model.parameters()], dict(model.named_buffers())

    expected = run(lambda m: m)
    if kind == "spectral_norm" and training and use != "one call":
        model = copy.deepcopy(base).train()
        with parametrize.cached():
            if use == "two calls":
                remat(model)(torch.randn(3, 4, dtype=D))
            else:
                model.weight
            buffers = {k: v.clone() for k, v in model.named_buffers()}
            with pytest.raises(CheckpointError, match="computes it in a cache of its own"):
                remat(model)(torch.randn(3, 4, dtype=D))
        assert_close(dict(model.named_buffers()), buffers)  # (no extra power-iteration step)
    else:
        assert_close(run(remat), expected)


def test_stateful_parametrization_under_cached_in_a_nested_remat_with_the_backward_in_the_block():
    """A remat'd call of a spectral-normed layer nested in another, once in a ``cached()`` block whose
    backward pass runs inside it: the outer recomputation runs the inner forward run again, which
    computes the weight again as the enclosing forward run's did (not a second computation of the
    block: no refusal), with the values and buffers of the function without remat."""
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    base = parametrizations.spectral_norm(nn.Linear(4, 4, dtype=D))

    def run(nest):
        model = copy.deepcopy(base).train()
        f = nest(lambda x: nest(model)(x) * 2)
        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with parametrize.cached():
            y = f(x)
            y.square().sum().backward()
        return y.detach(), x.grad, [p.grad for p in model.parameters()], dict(model.named_buffers())

    assert_close(run(remat), run(lambda f: f))


def test_layers_replaced_deleted_and_popped_through_a_remat_d_sequential():
    """``m[i] = layer``, ``del m[i]`` and ``m.pop(i)`` on a remat'd ``nn.Sequential``, between training
    steps, as on the Sequential itself. ``del``/``pop`` renumber the layers into a new dictionary: the
    wrapper's names (``named_parameters``, ``functional_call`` by name, ``load_state_dict`` of its
    own ``state_dict``) must follow, not name the removed layer."""

    def net():
        torch.manual_seed(0)
        return nn.Sequential(*(m for _ in range(3) for m in (nn.Linear(4, 4, dtype=D), nn.Tanh())), nn.Linear(4, 2, dtype=D))

    reference, model = net(), remat(net(), segments=2)
    x = torch.randn(5, 4, dtype=D)

    def step():
        names = [n for n, _ in reference.named_parameters()]
        assert [n for n, _ in model.named_parameters()] == names
        assert list(model.state_dict()) == list(reference.state_dict())
        for m in (reference, model):
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        assert_close(model.state_dict(), reference.state_dict())
        params = {k: v.detach() for k, v in reference.named_parameters()}
        loss = lambda m: (lambda p: tf.functional_call(m, p, (x,)).square().sum())  # noqa: E731
        assert_close(tf.grad(loss(model))(params), tf.grad(loss(reference))(params))
        model.load_state_dict(reference.state_dict())

    step()
    for m in (reference, model):
        m.pop(0)
    step()
    for m in (reference, model):
        torch.manual_seed(1)
        m[1] = nn.Linear(4, 4, dtype=D)
        del m[0]
    step()
    for m in (reference, model):
        del m[-3:-1]
        m.append(nn.Tanh())
    step()


def test_a_second_parametrization_registered_on_the_wrapper_of_a_parametrized_module():
    """The wrapped layer is parametrized before remat (``weight``), another tensor (``bias``) through
    the wrapper afterwards: it reaches the layer, trains as without remat, and does not become a
    property of every other wrapper."""
    from torch.nn.utils import parametrizations, parametrize

    from funckpt._modules import Remat

    class Positive(nn.Module):
        def forward(self, b):
            return b.exp()

        def right_inverse(self, b):
            return b.log()

    def net():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 6, dtype=D), nn.Tanh(), nn.Linear(6, 2, dtype=D))
        with torch.no_grad():
            m[0].bias.abs_()
        parametrizations.orthogonal(m[0])
        return m

    reference, model = net(), net()
    model[0] = remat(model[0])
    for m in (reference, model):
        parametrize.register_parametrization(m[0], "bias", Positive())
    assert "bias" not in vars(Remat)
    assert list(model.state_dict()) == list(reference.state_dict())
    for m in (reference, model):
        opt = torch.optim.Adam(m.parameters(), lr=0.05)
        torch.manual_seed(2)
        for _ in range(3):
            m(torch.randn(5, 4, dtype=D)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert_close(model.state_dict(), reference.state_dict())
    other = remat(nn.Linear(2, 2, dtype=D))
    other.bias = nn.Parameter(torch.zeros(2, dtype=D))
    assert_close(other(torch.ones(1, 2, dtype=D)), torch.ones(1, 2, dtype=D) @ other.weight.T)


def test_wrapper_of_a_once_parametrized_module_still_pickles():
    """The class of its own that a wrapper of a parametrized module gets is not what is pickled:
    once the parametrizations are removed, ``torch.save(model)`` works as for any wrapper."""
    import copy
    import io

    from torch.nn.utils import parametrizations, parametrize

    from funckpt._modules import Remat

    layer = nn.Linear(3, 3, dtype=D)
    parametrizations.orthogonal(layer)
    model = nn.Sequential(remat(layer), nn.Tanh())
    parametrize.remove_parametrizations(layer, "weight")
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded[0]) is Remat
    x = torch.randn(2, 3, dtype=D)
    assert_close(loaded(x), model(x))
    assert_close(copy.deepcopy(model)(x), model(x))


def _max_norm_layer(kind):
    torch.manual_seed(0)
    if kind == "Embedding":
        return nn.Embedding(10, 3, max_norm=1.0, dtype=D)
    return nn.EmbeddingBag(10, 3, max_norm=0.5, mode="sum", dtype=D)


_MAX_NORM_INPUTS = {
    "Embedding": (torch.tensor([[1, 2, 3], [4, 5, 1]]),),
    "EmbeddingBag": (torch.tensor([1, 2, 3, 4, 5, 1]), torch.tensor([0, 2])),
}


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
@pytest.mark.parametrize("how", ["remat(layer)", "checkpoint"])
def test_embedding_with_max_norm_renormalizes_its_weight_once_per_step(kind, how):
    """``max_norm`` renormalizes the rows it looks up in the weight itself, through ``weight.detach()``
    (no graph records it): a correct program, not a differentiable input written in place. As
    without remat, the weight is renormalized by the forward pass, and the gradients are the plain
    layer's, step after step."""
    from funckpt import checkpoint

    reference, layer = _max_norm_layer(kind), _max_norm_layer(kind)
    run = {
        "remat(layer)": remat(layer),
        "checkpoint": lambda *a: checkpoint(layer, *a, use_reentrant=False),
    }[how]
    inputs = _MAX_NORM_INPUTS[kind]
    for step in range(2):
        cotangent = torch.randn(reference(*inputs).shape, dtype=D)
        reference.weight.grad = layer.weight.grad = None
        reference.weight.data.mul_(3)  # rows grow past max_norm again
        layer.weight.data.mul_(3)
        (reference(*inputs) * cotangent).sum().backward()
        (run(*inputs) * cotangent).sum().backward()
        assert_close(layer.weight.grad, reference.weight.grad)
        assert_close(layer.weight, reference.weight)


@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
def test_embedding_with_max_norm_under_functional_call_and_grad(kind):
    reference, layer = _max_norm_layer(kind), _max_norm_layer(kind)
    inputs = _MAX_NORM_INPUTS[kind]

    def loss(module, params):
        return tf.functional_call(module, params, inputs).sin().sum()

    expected = tf.grad(lambda p: loss(reference, p))({"weight": reference.weight.detach()})
    got = tf.grad(lambda p: loss(remat(layer), p))({"weight": layer.weight.detach()})
    assert_close(got, expected)
    assert_close(layer.weight, reference.weight)


class _ClampsItsOwnWeight(nn.Module):
    """Gemma3n's AltUp in training mode: it clamps its own weight through ``.data`` (no graph
    records the write) before using it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4, dtype=D)

    def forward(self, x):
        self.linear.weight.data.clamp_(-0.3, 0.3)
        return self.linear(x).tanh()


def _clamping_layer_and_loss(wrap):
    """The layer (seeded), it wrapped in a model, a batch of three, the model's parameters, and a loss."""
    torch.manual_seed(0)
    inner = _ClampsItsOwnWeight()
    outer = nn.Sequential(wrap(inner))
    xs = torch.randn(3, 4, dtype=D)
    params = {k: v.detach() for k, v in outer.named_parameters()}

    def loss(p, x):
        return tf.functional_call(outer, p, (x,)).square().sum()

    return inner, outer, xs, params, loss


@pytest.mark.parametrize("policy", [None, policies.dots_saveable], ids=["default", "dots_saveable"])
@pytest.mark.parametrize("how", ["vmap(grad)", "grad", "backward"])
def test_a_layer_clamping_its_own_weight_through_data_gets_the_gradients_without_remat(how, policy):
    """Per-example gradients of the parameters of such a layer: the write is one no graph records,
    as without remat, not a differentiable input modified in place."""

    def run(wrap):
        inner, outer, xs, params, loss = _clamping_layer_and_loss(wrap)
        if how == "vmap(grad)":
            grads = tf.vmap(tf.grad(loss), in_dims=(None, 0))(params, xs)
        elif how == "grad":
            grads = tf.grad(loss)(params, xs[0])
        else:
            outer(xs).square().sum().backward()
            grads = {k: p.grad for k, p in outer.named_parameters()}
        return grads, inner.linear.weight.detach()

    assert_close(run(lambda m: remat(m, policy=policy)), run(lambda m: m))


@pytest.mark.parametrize("policy", [None, policies.dots_saveable], ids=["default", "dots_saveable"])
@pytest.mark.parametrize("how", ["vmap(grad)", "vmap(grad(vmap))", "vmap(jacrev)", "jacfwd"])
def test_a_layer_clamping_its_own_weight_through_data_gets_the_input_gradients_without_remat(how, policy):
    """Per-example gradients of the input of such a layer, its parameters not differentiated: the
    weight is no primal of the forward run's own grad level, nor of the recomputation's vjp or jvp,
    and joins their levels as torch.func.grad wraps all of its arguments, where torch allows the
    write (captured from below a level, it refuses it: 'mutate a captured Tensor')."""

    def run(wrap):
        inner, outer, xs, params, loss = _clamping_layer_and_loss(wrap)
        if how == "vmap(grad)":
            grads = tf.vmap(tf.grad(loss, argnums=1), in_dims=(None, 0))(params, xs)
        elif how == "vmap(grad(vmap))":
            chunks = xs.reshape(3, 1, 4)
            grads = tf.vmap(tf.grad(lambda p, x: tf.vmap(loss, in_dims=(None, 0))(p, x).sum(), argnums=1), in_dims=(None, 0))(params, chunks)
        elif how == "vmap(jacrev)":
            grads = tf.vmap(tf.jacrev(lambda p, x: tf.functional_call(outer, p, (x,)), argnums=1), in_dims=(None, 0))(params, xs)
        else:
            grads = tf.jacfwd(lambda p, x: tf.functional_call(outer, p, (x,)), argnums=1)(params, xs[0])
        return grads, inner.linear.weight.detach()

    assert_close(run(lambda m: remat(m, policy=policy)), run(lambda m: m))


_LAZY = {
    "LazyLinear": (lambda: nn.LazyLinear(4, dtype=D), (2, 3)),
    "LazyConv2d": (lambda: nn.LazyConv2d(3, 2, dtype=D), (1, 2, 4, 4)),
    "LazyBatchNorm1d": (lambda: nn.LazyBatchNorm1d(dtype=D), (4, 3)),
}


@pytest.mark.parametrize("kind", sorted(_LAZY))
@pytest.mark.parametrize("how", ["remat(layer)", "checkpoint", "torch.func.grad"])
def test_lazy_module_initializes_its_parameters_on_its_first_remat_d_call(kind, how):
    """A lazy module's first call shapes its parameters from its input, in a pre-hook that
    would run inside the call, after remat took the (uninitialized) parameters as inputs. The
    first remat'd call initializes them first, as without remat: same values (the same draws
    from the generator), same gradients, and the module becomes the plain layer."""
    from funckpt import checkpoint

    make, shape = _LAZY[kind]
    reference, layer = make(), make()
    x = torch.randn(shape, dtype=D)
    loss = lambda y: (y * torch.sin(torch.arange(y.numel(), dtype=D)).reshape(y.shape)).sum()  # noqa: E731
    x_ref = x.clone().requires_grad_()
    torch.manual_seed(0)
    expected = torch.autograd.grad(loss(reference(x_ref)), [x_ref, *reference.parameters()])
    torch.manual_seed(0)
    if how == "torch.func.grad":
        got = tf.grad(lambda x: loss(remat(layer)(x)))(x)
        assert_close(got, expected[0])
    else:
        run = remat(layer) if how == "remat(layer)" else (lambda x: checkpoint(layer, x, use_reentrant=False))
        x_got = x.clone().requires_grad_()
        got = torch.autograd.grad(loss(run(x_got)), [x_got, *layer.parameters()])
        assert_close(got, expected)
    assert type(layer) is type(reference)
    assert_close(layer.state_dict(), reference.state_dict())


def test_uninitialized_lazy_module_inside_a_remat_d_call_raises_saying_what_to_do():
    """One inside (its input is an intermediate: it cannot be shaped before the call) raises a
    CheckpointError naming it, not torch's error about an uninitialized parameter."""
    model = nn.Sequential(nn.Linear(3, 4, dtype=D), nn.Tanh(), nn.LazyLinear(2, dtype=D))
    x = torch.randn(2, 3, dtype=D, requires_grad=True)
    with pytest.raises(CheckpointError, match=r"LazyLinear's 'weight'.*lazy module.*call the model once"):
        remat(model)(x)
    with pytest.raises(CheckpointError, match="uninitialized parameter of a lazy module"):
        tf.grad(lambda x: remat(lambda x: model(x))(x).sum())(x)
    with torch.no_grad():
        model(x)  # as the error says
    assert_close(tf.grad(lambda x: remat(model)(x).sum())(x), tf.grad(lambda x: model(x).sum())(x))


def _qat_model():
    import torch.ao.quantization as Q

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = Q.QuantStub(), Q.DeQuantStub()
            self.conv, self.bn, self.relu = nn.Conv2d(2, 3, 2), nn.BatchNorm2d(3), nn.ReLU()
            self.fc = nn.Linear(27, 4)

        def forward(self, x):
            x = self.relu(self.bn(self.conv(self.quant(x))))
            return self.dequant(self.fc(x.flatten(1)))

    torch.manual_seed(0)
    net = Net().train()
    net.qconfig = Q.get_default_qat_qconfig("x86")
    return Q.prepare_qat(Q.fuse_modules_qat(net, [["conv", "bn", "relu"]]))


def _per_channel_fake_quantize():
    import torch.ao.quantization as Q

    observer = Q.MovingAveragePerChannelMinMaxObserver
    return nn.Sequential(
        nn.Linear(4, 3),
        Q.FakeQuantize(observer=observer, quant_min=-128, quant_max=127, dtype=torch.qint8,
                       qscheme=torch.per_channel_symmetric, ch_axis=1),
    )


@pytest.mark.parametrize("make", [_qat_model, _per_channel_fake_quantize], ids=["prepare_qat", "per-channel FakeQuantize"])
def test_quantization_aware_training_steps_as_without_remat(make):
    """FakeQuantize and its observers update their statistics and quantization parameters in
    their forward (an observer's ``min_val`` starts empty and is resized on the first call): with
    remat, once per step, and the gradients are the plain model's, step after step."""
    import copy

    reference = make()
    model = copy.deepcopy(reference)
    wrapped = remat(model)
    shape = (2, 2, 4, 4) if make is _qat_model else (3, 4)
    for _ in range(3):
        x = torch.randn(shape)
        reference.zero_grad()
        model.zero_grad()
        reference(x).square().sum().backward()
        wrapped(x).square().sum().backward()
        assert_close({n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in reference.named_parameters()})
        assert_close(model.state_dict(), reference.state_dict())


def test_a_buffer_the_forward_transposes_in_place_is_recomputed_from_its_old_shape():
    """An in-place view op (``t_``, ``unsqueeze_``) changes the buffer's shape, not its bytes: the
    recomputation must start from the shape it had at the call, not the one the forward left."""

    class Flipping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.arange(1.0, 7.0, dtype=torch.float64).view(2, 3))

        def forward(self, x):
            self.b.t_()
            return x @ self.b

    def program(m):
        x = torch.linspace(0.1, 1, 12, dtype=torch.float64).view(4, 3).requires_grad_()
        grads = torch.autograd.grad(m(x).pow(2).sum(), x)
        return grads, m.b.clone(), m.b.stride()

    assert_close(program(remat(Flipping())), program(Flipping()))


class _SavingCounter(nn.Module):
    """A counter buffer the forward updates, then multiplies by: ``x * self.count`` keeps the
    buffer itself for the backward (``clone=True`` keeps a copy, which the program without
    remat needs where the buffer is written again before its backward)."""

    def __init__(self, clone: bool) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.clone = clone

    def forward(self, x):
        self.count.add_(1)
        return x * (self.count.clone() if self.clone else self.count)


def test_a_buffer_the_forward_updates_and_keeps_for_the_backward_gives_each_call_its_own_value():
    """Called twice (shared weights): each call's gradient is that of the value it multiplied by,
    though the second call wrote the buffer before the first call's backward."""

    def program(m, f):
        x = torch.linspace(0.1, 1, 3, dtype=torch.float64, requires_grad=True)
        return torch.autograd.grad(f(f(x).sin()).sum(), x), m.count.clone()

    plain, module = _SavingCounter(clone=True), _SavingCounter(clone=False)
    assert_close(program(module, remat(module)), program(plain, plain))


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_buffer_the_forward_updates_and_keeps_with_two_forwards_before_their_backwards(order):
    """Gradient accumulation, and the caller's update before the backward, with a buffer the
    backward reads: each backward sees its own forward's value, and the caller's update stays."""

    def program(m, f):
        xs = [torch.linspace(0.1, 1, 4, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        outs = [f(x).pow(2).sum() for x in xs]
        m.count.add_(10)
        grads = [torch.autograd.grad(outs[k], xs[k]) for k in order]
        return grads, m.count.clone()

    plain, module = _SavingCounter(clone=True), _SavingCounter(clone=False)
    assert_close(program(module, remat(module)), program(plain, plain))


def test_torch_jit_trace_of_a_model_with_several_remat_layers():
    """Tracing runs each remat'd call once, under no grad: remat is the function itself there, and
    the trace of two of them is the trace of the two layers."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8, dtype=D), nn.Tanh(), nn.Linear(8, 2, dtype=D))
    model = nn.Sequential(*(remat(m) for m in plain))
    x = torch.randn(3, 4, dtype=D)
    traced = torch.jit.trace(model, (x,), check_trace=False)
    assert_close(traced(x), plain(x))


def _layers_with_a_recording_hook(keep):
    """An embedding, two layers, and a forward hook on the first that keeps its input or output
    (transformers' recorder of ``output_hidden_states`` keeps the first layer's input)."""
    torch.manual_seed(0)
    emb = nn.Linear(4, 4, dtype=D)
    layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4, dtype=D), nn.Tanh()) for _ in range(2)])
    kept, calls = [], []

    def hook(module, args, out):
        calls.append(None)
        kept.append(args[0] if keep == "input" else out)

    layers[0].register_forward_hook(hook)
    return emb, layers, kept, calls


@pytest.mark.parametrize("keep", ["input", "output"])
def test_a_hook_of_the_wrapped_layer_keeping_a_tensor_gets_the_callers(keep):
    """A hook registered on the layer before it is remat'd runs around the checkpointed forward,
    once, on the caller's tensors: a loss through what it kept has the gradient it has without remat."""

    def grads(wrap):
        emb, layers, kept, calls = _layers_with_a_recording_hook(keep)
        if wrap:
            for i in range(len(layers)):
                layers[i] = remat(layers[i])
        h = emb(torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1)))
        for layer in layers:
            h = layer(h)
        (h.sum() + kept[0].square().sum()).backward()
        return [emb.weight.grad, emb.bias.grad], len(calls)

    (want, plain_calls), (got, calls) = grads(False), grads(True)
    assert_close(got, want)
    assert calls == plain_calls == 1  # (not again in the recomputation)


@pytest.mark.parametrize("keep", ["input", "output"])
def test_a_hook_of_the_wrapped_layer_keeping_a_tensor_under_torch_func_grad(keep):
    def grads(wrap):
        emb, layers, kept, _ = _layers_with_a_recording_hook(keep)
        model = nn.Sequential(emb, *[remat(l) if wrap else l for l in layers])
        params = {k: v.detach() for k, v in model.named_parameters()}
        x = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))

        def loss(p):
            kept.clear()
            return tf.functional_call(model, p, (x,)).sum() + kept[0].square().sum()

        return tf.grad(loss)(params)

    want, got = grads(False), grads(True)
    assert_close({k.replace(".wrapped", ""): v for k, v in got.items()}, want)


def test_hooks_of_the_wrapped_layer_change_its_inputs_and_outputs_as_without_remat():
    def run(wrap):
        torch.manual_seed(0)
        layer = nn.Linear(4, 4, dtype=D)
        layer.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        layer.register_forward_hook(lambda m, args, out: out.tanh())
        layer.register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,))
        m = remat(layer) if wrap else layer
        x = torch.randn(3, 4, dtype=D, requires_grad=True)
        y = m(x)
        y.sin().sum().backward()
        return y, x.grad, layer.weight.grad

    assert_close(run(True), run(False))


# ---------------------------------------------------------------- torch's module trackers


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16, dtype=D), nn.Linear(16, 8, dtype=D)

    def forward(self, x):
        return x + self.b(self.a(x).tanh())


def _counted_step(wrap, how):
    """Flops FlopCounterMode counts over a step of two layers (as ``wrap`` calls them) after a
    Linear, and the gradients; and the flops of one layer's forward alone."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    pre, layers = nn.Linear(8, 8, dtype=D), nn.ModuleList([_TwoLinears(), _TwoLinears()])
    x = torch.randn(4, 8, dtype=D)

    def loss(params):
        h = tf.functional_call(pre, {k[4:]: v for k, v in params.items() if k.startswith("pre.")}, (x,))
        for i, layer in enumerate(layers):
            own = {k[len(f"layers.{i}.") :]: v for k, v in params.items() if k.startswith(f"layers.{i}.")}
            h = wrap(lambda h, layer=layer, own=own: tf.functional_call(layer, own, (h,)), h)
        return h.sum()

    named = {f"pre.{k}": v for k, v in pre.named_parameters()} | {f"layers.{k}": v for k, v in layers.named_parameters()}
    with FlopCounterMode(display=False) as counter:
        if how == "backward":
            params = {k: v.detach().requires_grad_() for k, v in named.items()}
            loss(params).backward()
            grads = {k: v.grad for k, v in params.items()}
        else:
            grads = tf.grad(loss)({k: v.detach() for k, v in named.items()})
    with FlopCounterMode(display=False) as one, torch.no_grad():
        layers[0](torch.randn(4, 8, dtype=D))
    return counter.get_total_flops(), grads, one.get_total_flops()


@pytest.mark.parametrize("how", ["backward", "torch.func.grad"])
@pytest.mark.parametrize("wrap", ["remat", "checkpoint"])
def test_flop_counter_mode_counts_a_step_with_one_more_forward_per_checkpointed_layer(wrap, how):
    """``FlopCounterMode`` runs torch's ``ModuleTracker``, whose global module hooks register
    multi-grad hooks on every module's inputs and outputs: inside a remat'd call they are off (the
    layers' modules are counted as the call's), and the count is the step's plus each layer's
    recomputation, with the step's gradients."""
    import funckpt

    wraps = {"remat": lambda f, h: remat(f)(h), "checkpoint": lambda f, h: funckpt.checkpoint(f, h, use_reentrant=False)}
    plain, expected, layer = _counted_step(lambda f, h: f(h), how)
    flops, grads, _ = _counted_step(wraps[wrap], how)
    assert_close(grads, expected)
    assert flops == plain + 2 * layer


def test_module_tracker_hooks_are_back_after_a_remat_call_and_see_the_wrapper_in_the_backward():
    """The trackers' hooks are off inside the call only: the wrapper's own call is tracked, forward
    and backward, and hooks registered after the tracker's keep their order."""
    from torch.utils.module_tracker import ModuleTracker

    layer = remat(_TwoLinears())
    x = torch.randn(4, 8, dtype=D, requires_grad=True)
    seen = []
    with ModuleTracker() as tracker:
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
        try:
            before = list(torch.nn.modules.module._global_forward_hooks.values())
            out = layer(x)
            assert list(torch.nn.modules.module._global_forward_hooks.values()) == before
            inside = []
            out.register_hook(lambda g: inside.append(set(tracker.parents)))
            out.sum().backward()
        finally:
            handle.remove()
    assert "Linear" in seen  # (a hook of the user's runs inside the call)
    assert inside == [{"Global", "Remat"}]  # (the wrapper's call, by its type's name; not its layers')
    assert_close(x.grad, torch.func.grad(lambda x: _TwoLinears.forward(layer, x).sum())(x.detach()))


def test_module_tracker_of_another_thread_keeps_its_hooks_through_a_remat_call():
    """The global hooks are the process's: a remat'd call in one thread leaves them on for the
    modules of another, and does not put back the hooks of a tracker that exited meanwhile
    (they would outlive it, run by every module call of the process)."""
    import threading

    from torch.utils.module_tracker import ModuleTracker

    import funckpt

    mm = torch.nn.modules.module
    in_call, tracker_done = threading.Event(), threading.Event()

    def slow(x):
        in_call.set()
        assert tracker_done.wait(10)
        return x.sin()

    def call():
        funckpt.remat(slow)(torch.randn(3, dtype=torch.float64, requires_grad=True))

    seen = []
    lin = torch.nn.Linear(3, 3)
    lin.register_forward_pre_hook(lambda m, a: seen.append(set(tracker.parents)))
    with ModuleTracker() as tracker:
        thread = threading.Thread(target=call)
        thread.start()
        assert in_call.wait(10)
        lin(torch.randn(2, 3))  # (this thread's module, while the other runs its call)
    tracker_done.set()
    thread.join()
    assert seen == [{"Global", "Linear"}]
    hooks = [*mm._global_forward_pre_hooks.values(), *mm._global_forward_hooks.values()]
    assert not [h for h in hooks if isinstance(getattr(h, "__self__", None), ModuleTracker)]
    assert not [h for h in hooks if type(h).__name__ == "_TrackerHookOff"]


class _ResidualStage(nn.Sequential):
    """An nn.Sequential subclass with a forward of its own (timm's dense stages, torchvision's
    ASPPPooling, residual stages): that forward is what the module computes."""

    def forward(self, x, scale=1.0):
        return x + scale * super().forward(x)


class _DenseStage(nn.Sequential):
    def forward(self, x):
        features = [x]
        for layer in self:
            features.append(layer(torch.cat(features, -1)))
        return torch.cat(features, -1)


@pytest.mark.parametrize("kind", ["residual", "residual_with_argument", "dense"])
@pytest.mark.parametrize("route", ["backward", "grad"])
def test_a_sequential_subclass_with_its_own_forward_is_checkpointed_whole(kind, route):
    """Segments would run its layers in order and skip its forward: a silently other value."""
    torch.manual_seed(0)
    if kind == "dense":
        net = _DenseStage(nn.Linear(4, 2, dtype=D), nn.Linear(6, 2, dtype=D))
    else:
        net = _ResidualStage(nn.Linear(4, 8, dtype=D), nn.Tanh(), nn.Linear(8, 4, dtype=D))
    args = (2.0,) if kind == "residual_with_argument" else ()
    x = torch.randn(3, 4, dtype=D)

    def run(model):
        if route == "backward":
            model.zero_grad()
            model(x, *args).square().sum().backward()
            return [p.grad for p in net.parameters()]
        params = {k: v.detach() for k, v in net.named_parameters()}
        return tf.grad(lambda p: tf.functional_call(model, p, (x, *args)).square().sum())(params)

    assert_close(run(remat(net)), run(net))


def test_segments_of_a_sequential_subclass_with_its_own_forward_are_refused():
    with pytest.raises(ValueError, match="a subclass with a forward of its own is checkpointed whole"):
        remat(_ResidualStage(nn.Linear(4, 4, dtype=D)), segments=2)


class _ScriptedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 5, dtype=torch.float64), nn.Linear(5, 3, dtype=torch.float64)
        self.register_buffer("scale", torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))) * self.scale


@pytest.mark.parametrize("wrap", ["module", "closure", "sequential"])
@pytest.mark.parametrize("how", ["backward", "create_graph", "grad", "jvp"])
def test_a_torchscript_module_as_without_remat(wrap, how):
    """A ``torch.jit.script`` module (whose class reads its forward off an instance only, and
    whose submodules sit in a dictionary without ``get``), remat'd, in a closure or in a remat'd
    ``nn.Sequential``: the same values and gradients, its parameters' included, as without remat.
    (``vmap`` of a scripted module fails without remat too once TorchScript has optimized its graph,
    which reads ``.data``; so does ``jacrev``, whose remat'd recomputation runs under ``vmap``.)
    ``torch.func.jvp`` of the scripted module itself gives wrong tangents once TorchScript has
    optimized its graph (torch 2.13 and 2.14: a test earlier in the session that calls it warms it
    up), while remat's recomputation runs it under a jvp level of its own and gets them right: the
    jvp is compared with the same module unscripted.)"""
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64)

    def results(use_remat):
        torch.manual_seed(0)
        m = _ScriptedBlock() if how == "jvp" and not use_remat else torch.jit.script(_ScriptedBlock())
        if wrap == "module":
            f = m
        elif wrap == "closure":
            f = lambda x: m(x).sin()  # noqa: E731
        else:
            f = nn.Sequential(m, nn.Tanh())
        f = remat(f) if use_remat else f
        if how == "backward":
            out = f(x)
            out.square().sum().backward()
            return out, [p.grad for p in m.parameters()]
        if how == "create_graph":
            xx = x.clone().requires_grad_()
            (g,) = torch.autograd.grad(f(xx).sum(), xx, create_graph=True)
            g.square().sum().backward()
            return g, [p.grad for p in m.parameters()]
        if how == "grad":
            return tf.grad(lambda x: f(x).square().sum())(x)
        return tf.jvp(f, (x,), (torch.ones_like(x),))

    assert_close(results(True), results(False))


def _scripted_function(x, w):
    return torch.tanh(x @ w) * x.sin()


@pytest.mark.parametrize("scripted", ["module", "function"])
@pytest.mark.parametrize(
    "how", ["vmap of jvp", "jvp of vmap", "vmap", "jvp", "jacfwd", "vmap of grad", "grad, then hessian", "trained, then vmap of jvp"]
)
def test_torchscript_under_torch_func_transforms_is_differentiated_as_its_python_code(scripted, how):
    """Once TorchScript has optimized a scripted module's or function's graph (from its second call),
    that graph does not compose with torch.func: it reads its inputs' ``.data``, refused under vmap
    ("accessing `data` under vmap transform is not allowed"), and drops their forward-mode tangents (a
    zero jvp without remat). remat's runs of a call made under a transform run TorchScript's graphs
    unoptimized (``torch.jit.optimized_execution(False)``): every call gives the values and
    derivatives of the same code unscripted, also where the module was trained in plain autograd
    first (its graph optimized there for inputs requiring grad). (Under vmap(jvp) remat's forward
    run goes below the jvp, under a vmap of its own: it raised where the function without remat
    gave a wrong tangent.)"""
    torch.manual_seed(0)
    python_module = nn.Sequential(nn.Linear(3, 5, dtype=D), nn.Tanh(), nn.Linear(5, 3, dtype=D))
    w = torch.randn(3, 3, dtype=D, requires_grad=True)  # (a weight, like the module's)
    python_function = _scripted_function
    if scripted == "module":
        script = torch.jit.script(copy.deepcopy(python_module))
        f, reference = (lambda x: script(x).sin()), (lambda x: python_module(x).sin())
    else:

        def function(x, w):  # (a new function object on every test: a graph of its own to optimize)
            return torch.tanh(x @ w) * x.sin()

        script = torch.jit.script(function)
        f, reference = (lambda x: script(x, w).cos()), (lambda x: python_function(x, w).cos())
    xs, ts = torch.randn(4, 3, dtype=D), torch.randn(4, 3, dtype=D)

    def run(g):
        if how in ("vmap of jvp", "trained, then vmap of jvp"):
            return tf.vmap(lambda x, t: tf.jvp(g, (x,), (t,)))(xs, ts)
        if how == "jvp of vmap":
            return tf.jvp(tf.vmap(g), (xs,), (ts,))
        if how == "vmap":
            return tf.vmap(g)(xs)
        if how == "jvp":
            return tf.jvp(g, (xs,), (ts,))
        if how == "jacfwd":
            return tf.jacfwd(g)(xs[0])
        if how == "vmap of grad":
            return tf.vmap(tf.grad(lambda x: g(x).sum()))(xs)
        tf.grad(lambda x: g(x).square().sum())(xs)  # (grad, then hessian)
        return tf.hessian(lambda x: g(x).sum())(xs[0])

    if how == "trained, then vmap of jvp" and scripted == "module":
        for _ in range(3):
            script(xs.clone().requires_grad_()).square().sum().backward()
    expected = run(reference)
    for _ in range(3):  # (TorchScript optimizes the graph from its second call)
        assert_close(run(remat(f)), expected)


@pytest.mark.parametrize("how", ["vmap, then backward", "grad, a constant passed to a scripted function"])
def test_torchscript_that_cannot_run_under_a_transform_in_remat_raises_saying_so(how):
    """Under a transform TorchScript hands the torch-function mode remat runs the function under the
    tensors of its operators unwrapped from the transform's wrappers (under vmap, the whole batch):
    remat cannot route them. A raw, empty RuntimeError from TorchScript's interpreter came out (or a
    CheckpointError blaming a torch.func transform inside the function); it is a CheckpointError
    that says to call the Python code that was scripted, or to remat outside the transform."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, dtype=D)
    if how == "vmap, then backward":
        script = torch.jit.script(nn.Sequential(nn.Linear(3, 3, dtype=D), nn.Tanh()))
        xs = x.clone().requires_grad_()
        with pytest.raises(CheckpointError, match="TorchScript code the function calls"):
            tf.vmap(remat(lambda x: script(x).sin() * x))(xs).sum().backward()
        return
    w, c = torch.randn(3, 3, dtype=D, requires_grad=True), torch.randn(3, 3, dtype=D)

    def function(x, w, c):
        return torch.tanh(x @ w) * (x @ c).sin()

    script = torch.jit.script(function)
    with pytest.raises(CheckpointError, match="TorchScript code the function calls"):
        tf.grad(lambda x: remat(lambda x: script(x, w, c).cos())(x).sum())(x)
