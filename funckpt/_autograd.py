"""The autograd Function behind ``remat`` and its rules for every torch.func transform.

Everything here works on a *region*: a function from a flat tuple of tensors to
a flat tuple of tensors (:class:`Region`). The user's function becomes one (see
``_transform.py``); the rules below build new regions from old ones, the way
JAX's ``remat`` rules do:

* **forward**: run the region under no-grad and keep only its inputs.
* **vmap rule**: ``remat(f)`` batched is ``remat(vmap(f))`` one level lower.
* **backward**: recompute the region and take its vjp. Where the result must
  itself be differentiable (a higher-order derivative, ``create_graph=True``)
  the backward *is* a remat'd region, ``remat(vjp(f))``, so it too keeps only
  its inputs (primals and cotangents) between its forward and backward.
* **jvp rule**: ``remat(jvp(f))`` one level lower.

Why "one level lower" matters. ``torch.func.grad`` runs its backward pass with
``create_graph=True`` so that enclosing transforms can differentiate it. A
naive backward that recomputes ``f`` at the Function's own grad level is then
recorded at that level, and since each block's input gradient references its
recomputed graph, every block's recomputed activations stay alive until the
whole backward ends: the checkpoint saves nothing. Instead, when the
Function's own grad level ``L`` is live on top of the functorch stack, we unwrap
primals and cotangents to level ``L-1``, pop level ``L``, compute the vjp there,
and wrap the result back. Level ``L`` records nothing (its result is never
differentiated again by torch.func, which unwraps it at once); lower levels
(grad of grad, vmap of grad, jacfwd of jacrev) still see the whole computation.
If user code *does* differentiate such a result again at level ``L`` (a
``torch.autograd.grad(..., create_graph=True)`` inside a ``torch.func.grad``),
a guard node raises :class:`~funckpt.CheckpointError` instead of returning a
wrong answer.

When the backward is called on a dead level (the ``vjp_fn`` of
``torch.func.vjp``/``jacrev``, called after the transform returned) or by
plain autograd, the vjp runs at the current stack.

Under ``torch.compile``, Dynamo does not trace any of this: :func:`apply` and
the backward are ``torch.compiler.disable``d, so a remat'd call that reaches them
(see ``_compile.py`` for the calls that do not) is a graph break and its
forward, recomputation and vjp run eagerly (the backward is called by
the autograd engine, possibly from a frame Dynamo is compiling, such as the
eager fallback of a compiled ``torch.func.grad``). So is ``_transform._call_eagerly``,
so Dynamo does not trace the argument flattening and closure discovery either.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _aliasing, _rng
from ._capture import has_tangent, made_by_nested_region, note_nested_node, replayable_backward, set_internal
from ._errors import CheckpointError, differing_digests, digest, the_recomputation
from ._internals import (
    PLAIN_TENSORS,
    at_a_grad_level_of_its_own,
    autograd_included,
    has_gradient_dtype,
    GradInterpreter,
    JvpInterpreter,
    SingleLevelFunction,
    TransformType,
    level_kinds,
    VmapInterpreter,
    add_batch_dim,
    apply_function,
    autograd_grad,
    backward_names_no_inputs,
    bind_forward_once,
    compiler_disable,
    custom_function_call,
    forward_ad_level,
    forward_mode_active,
    func_jvp_nests,
    functorch_dispatches_first,
    grad_levels_active,
    graph_task_keeps_graph,
    has_torch_function,
    is_batchedtensor,
    is_legacy_batchedtensor,
    is_dead_tensor_wrapper,
    jvp_levels_active,
    legacy_vmap_decrement,
    legacy_vmap_depth,
    legacy_vmap_increment,
    made_under_no_grad,
    level_lift,
    lowered,
    make_dual,
    maybe_get_level,
    interpreter_stack,
    peek_interpreter_stack,
    register_tensor_hook,
    set_fwd_grad_enabled,
    set_fwd_grad_mode,
    set_grad_enabled,
    fwd_grad_enabled,
    set_single_level_function_allowed,
    single_level_function_allowed,
    storage_of,
    transforms_active,
    unpack_dual,
    unwrap_batched,
    unwrap_for_grad,
    user_saved_tensors_hooks,
    unwrap_if_dead,
    unwrap_one_level,
    wrap_for_grad,
)

Tensors = tuple[torch.Tensor, ...]
# The vjp of one (sub-)region at the current stack: (region, primals, cotangents, needs) -> gradients
StepVjp = Callable[["Region", Tensors, Tensors, Sequence[bool]], list[Any]]

_EAGER_REASON = (
    "funckpt.remat runs eagerly under torch.compile when it cannot become the compiler's "
    "checkpoint region: with a policy that uses checkpoint_name, offloads or has a memory budget, "
    "a context_fn, debug=True, inside a torch.func transform, or a function that writes its "
    "inputs in place or that Dynamo cannot trace. Such a call is a graph break, so fullgraph=True "
    "cannot include it: use an operator-based policy (dots_saveable, ...), or compile without fullgraph=True"
)
eager_under_compile = compiler_disable(_EAGER_REASON)


class Phase(enum.Enum):
    FORWARD = "forward"  # the first run, during the forward pass
    RECOMPUTE = "recompute"  # any later run: backward, jvp, double backward


class Region:
    """A function of a flat tuple of tensors returning a flat tuple of tensors."""

    name: str = "region"
    #: Outputs on which the function called ``retain_grad()``, by position, with the caller's
    #: tensor for each and whether autograd fills its ``.grad`` with the part that reaches it
    #: directly (see ``funckpt._call._retain_grads``).
    retained_grads: tuple[tuple[int, Callable[[], torch.Tensor | None], bool], ...] = ()
    #: Which inputs required grad at the call, where it was made under a torch.func transform with
    #: grad mode on and one did (a user's region: see ``funckpt._call.prepare``).
    required_grad_at_call: list[bool] | None = None
    #: Where that is set: which inputs were tensors of the caller's innermost level (a module's
    #: parameter, or a tensor an outer transform wraps, is not one).
    of_the_innermost_level: list[bool] | None = None
    #: Was a torch.func grad level (grad, vjp, jacrev) active at the call?
    grad_level_at_call: bool = False
    #: The vmap level its forward run drew random numbers at, per example (see
    #: :func:`_forward_alone_at_vmap`): its vjp at that level recomputes per example.
    drew_at_level: int | None = None
    #: Where the call, made at a grad level, was lowered into plain autograd and its forward run took a
    #: grad level of its own (see ``funckpt._call.UserRegion._forward_run_at_a_grad_level``): the inputs
    #: that were its primals. A recomputation in plain autograd runs under one too
    #: (:func:`_recomputed_at_the_forward_runs_level`). ``None``: no such level.
    primals_of_own_level: list[int] | None = None
    #: Where the call was made with a torch.func grad or jvp level innermost: that level (see
    #: :func:`_hooks_acting_at`). ``None`` otherwise, and for a region derived from another.
    grad_level_of_the_call: int | None = None
    #: Did the forward run register a hook on a leaf requiring grad that the function made itself?
    #: Without remat a ``.backward()`` naming no inputs reaches that leaf and runs it (see :func:`vjp`).
    own_leaf_hooks: bool = False

    def run(self, flat: Tensors, phase: Phase) -> Tensors:
        raise NotImplementedError

    def note_mutated_inputs(self, indices: list[int]) -> None:
        """Called after the forward run with the inputs it modified in place."""

    def note_inputs_changed_by_hooks(self) -> None:
        """Called before the recomputation where the caller's saved-tensor hooks gave back the
        inputs with other values than they packed (activation compression): the recomputation
        then computes other values, by the caller's choice."""

    def release_kept(self) -> None:
        """Drop the values a saving policy kept; a later recomputation computes them again."""

    def unchecked_inputs(self) -> set[int]:
        """Inputs to save without a version check (unused, or restored from a copy)."""
        return set()

    def constant_outputs(self) -> set[int]:
        """Outputs known not to depend differentiably on any input (``x.detach() * 2``)."""
        return set()

    def checked_constants(self) -> set[int]:
        """Inputs no gradient flows into that are still saved with a version check (read by the run)."""
        return set()

    def describe_input(self, index: int, t: torch.Tensor) -> str:
        """Input ``index`` (``t``) in words, for an error message (a parameter's name where known)."""
        return f"input {index} (shape {tuple(t.shape)})"

    def own_vjp(
        self,
        primals: Tensors,
        cotangents: Tensors,
        needs: Sequence[bool],
        *,
        create_graph: bool,
        advancing: Callable[[], contextlib.AbstractContextManager[Any]],
        step_vjp: StepVjp,
    ) -> list[torch.Tensor | None] | None:
        """The vjp by a cheaper route than recomputing the whole region at once, if the region has one.

        A checkpointed loop (``_loops.py``) reverses its steps one at a time along a
        schedule: it runs steps forward under ``advancing()`` and differentiates
        each step with ``step_vjp``, the rule of the stack it is called at. ``None``
        (the default): recompute the region and take its vjp.
        """
        return None

    def outputs_share_no_input_storage(self) -> bool:
        """Known after the forward run: no output it returned shares storage with an input."""
        return False

    def add_retained_parts(self, outs: Tensors, cotangents: Tensors) -> None:
        """After a vjp of its recomputed ``outs``: complete the ``.grad`` of the caller's outputs
        in :attr:`retained_grads` with what reached them through the call's other outputs."""
        for k, caller, hooked in self.retained_grads:
            _add_retained_part(caller(), outs[k], cotangents[k] if hooked else None)

    def registers_hooks_when_recomputed(self) -> bool:
        """Known after the forward run: does a recomputation register hooks on tensors (or autograd
        nodes) it makes, as the function did on its own in the forward run (see :func:`_vjp_here`)?"""
        return False

    def escaped_outputs(self) -> int:
        """Known after the forward run: how many of its outputs, the last ones, are tensors that
        escaped it (kept by a hook, a list, an attribute) rather than returned (see
        ``UserRegion._escaped_tensors``). Their gradients are often never asked for: the
        backward gets ``None`` for those, not a materialized zero tensor as large as the output."""
        return 0


class _SomeOutputs(Region):
    """``base`` with only the outputs at ``keep``: those a backward received a cotangent for."""

    def __init__(self, base: Region, keep: Sequence[int]) -> None:
        self.base, self.keep, self.name = base, tuple(keep), base.name
        self.retained_grads = base.retained_grads
        self.primals_of_own_level = base.primals_of_own_level  # (set by the base's forward run)
        self._all: Tensors = ()  # the base's outputs, where some retain their grad

    def run(self, flat: Tensors, phase: Phase) -> Tensors:
        outs = self.base.run(flat, phase)
        if self.retained_grads:  # (one without a cotangent still gets what reached it through the others)
            self._all = outs
        return tuple(outs[i] for i in self.keep)

    def add_retained_parts(self, outs: Tensors, cotangents: Tensors) -> None:
        given = dict(zip(self.keep, cotangents))
        for k, caller, hooked in self.retained_grads:
            _add_retained_part(caller(), self._all[k], given.get(k) if hooked else None)
        self._all = ()

    def release_kept(self) -> None:
        self.base.release_kept()






def _only_forward_levels_active() -> bool:
    """Forward-mode levels (jvp) and no grad level: a jvp of this backward (jvp of grad, an HVP).

    The vjp is then computed directly at the current stack, where the jvp levels see
    every operation; remat'ing it as a VjpRegion gave wrong tangents when a plain
    tensor requiring grad was among the primals.
    """
    return jvp_levels_active() and not grad_levels_active()


def _needs_graph(tensors: Sequence[torch.Tensor]) -> bool:
    """Must a computation on ``tensors`` be recorded for a later differentiation?"""
    return torch.is_grad_enabled() and (
        any(t.requires_grad for t in tensors)
        # (under a vmap, where a batched tensor reads False whatever it wraps: _requires_grad)
        or (transforms_active() and (grad_levels_active() or any(map(_requires_grad, tensors))))
    )


def _requires_grad(t: torch.Tensor) -> bool:
    """Does ``t``, or the tensor under its vmap wrappers, require grad?

    A BatchedTensor says it does not, whatever it wraps: under ``grad(vmap(grad(f)))`` the
    backward of the inner grad runs its vjp as a :class:`VjpRegion` batched by the vmap, on
    plain tensors of the outer grad's backward that require grad under the batching; read
    off the wrapper, that vjp was computed without a graph and the outer gradient was zero.
    """
    while is_batchedtensor(t):
        t = unwrap_one_level(t)
    return t.requires_grad


def _requires_grad_below(t: torch.Tensor, level: int) -> bool:
    """Does ``t``, a tensor of the grad or jvp level ``level``, require grad at some level below it,
    down to plain autograd's, where the forward run of a Function applied at ``level`` goes lowered?

    Not only at the level right below: under ``jvp(vmap(f))`` a remat'd call nested in another's run
    at a grad level of its own gets a module's parameter wrapped by that level, around the jvp's
    wrapper (which says it requires no grad), around the parameter (which does, in plain autograd).
    """
    t = unwrap_for_grad(t, level)
    while not t.requires_grad:
        if maybe_get_level(t) == -1:
            return False
        t = unwrap_one_level(t)
    return True


@eager_under_compile
def apply(region: Region, flat: Sequence[torch.Tensor]) -> Tensors:
    """Run ``region`` checkpointed: differentiable, keeping only its inputs.

    Equivalent to ``_RematFunction.apply(region, *flat)`` without its per-call
    ``inspect.signature(forward).bind(...)`` (about 100 us), a no-op here since
    ``forward`` takes positional arguments only, with no defaults.
    """
    internal = set_internal(True)  # (until the region runs its function: UserRegion._call_fn)
    try:
        outputs = _apply(region, flat)
    finally:
        set_internal(internal)
    made_by_nested_region(outputs, flat)  # (in the user's code of the runs it is nested in)
    return outputs


def _apply(region: Region, flat: Sequence[torch.Tensor]) -> Tensors:
    if transforms_active():
        try:
            top = peek_interpreter_stack()
            if (
                top is not None
                and top.key() in (TransformType.Grad, TransformType.Jvp)
                and functorch_dispatches_first()
                and not has_torch_function(tuple(flat))
            ):
                return _apply_at_level(top, region, flat)
            drawing = _unbatched_under_drawing_vmap(top, flat)
            if drawing is not None:
                if not _records_below_the_top(flat):
                    # Nothing below these vmaps would record the Function's node: its forward alone, at
                    # them, where random operators draw per example (or raise) as without remat.
                    return _forward_alone_at_vmap(region, flat, top)
                return _refusing_one_draw_for_the_batch(region, flat, drawing)
            return cast(Tensors, custom_function_call(_RematFunction, region, *flat))
        except RuntimeError as e:
            # (Told once torch refused it: asking for the levels on every call costs the common case.)
            if _FUNCTIONALIZE_NYI in str(e) and TransformType.Functionalize in level_kinds():
                raise _under_functionalize(region) from None
            raise
    flat = tuple(unwrap_if_dead(t) for t in flat)  # as Function.apply does
    return cast(Tensors, apply_function(_RematFunction, region, *flat))


#: What torch raises for an ``autograd.Function`` under ``torch.func.functionalize``.
_FUNCTIONALIZE_NYI = "Functionalize rule for custom_function_call"


def _under_functionalize(region: Region) -> CheckpointError:
    """torch has no ``functionalize`` rule for an ``autograd.Function`` with ``setup_context`` (its
    own "NYI: Functionalize rule for custom_function_call"), which remat's call is: said so, with what
    to do, in place of torch's error."""
    return CheckpointError(
        f"remat({region.name}): the call is made under torch.func.functionalize, which has no rule for "
        "the autograd.Function a remat'd call is (torch raises 'NYI: Functionalize rule for "
        "custom_function_call'). Call the remat'd function outside functionalize (functionalize "
        "the code around it, or the function inside remat: remat(torch.func.functionalize(fn))), or "
        "use torch.compile, which functionalizes the program itself and turns remat into its own "
        "checkpoint."
    )


def _unbatched_under_drawing_vmap(top: Any, flat: Sequence[torch.Tensor]) -> Any:
    """The innermost vmap, among those nested around this call (``top`` and the vmaps right below
    it), whose random operators draw per example (``randomness="different"``) or raise
    (``"error"``), with no input batched at its level; ``None`` if there is none."""
    if top is None or top.key() != TransformType.Vmap:
        return None
    for interpreter in reversed(interpreter_stack()):
        if interpreter.key() != TransformType.Vmap:
            return None
        vmap = VmapInterpreter(interpreter)
        if vmap.randomness() != "same" and not any(_batched_under(t, interpreter.level()) for t in flat):
            return vmap
    return None


def _forward_alone_at_vmap(region: Region, flat: Sequence[torch.Tensor], top: Any) -> Tensors:
    """:func:`_forward_alone` at the vmap ``top``; where it drew random numbers (per example),
    the region notes that vmap's level: its vjp there recomputes per example too."""
    outs, drew = _drawing(region, flat, lambda: _forward_alone(region, flat))
    if drew is not None:
        region.drew_at_level = top.level()
    return outs


def _drawing(
    region: Region, flat: Sequence[torch.Tensor], run: Callable[[], Tensors]
) -> tuple[Tensors, _rng.RngState | None]:
    """``run()``'s outputs, and, if it drew random numbers (moved a generator the call reaches),
    the generators' states before it (``None`` if it drew none)."""
    generators = getattr(region, "generators", ())
    before = _rng.capture(flat, generators)
    outs = run()
    return outs, None if _rng.same(before, _rng.capture(flat, generators)) else before


def _records_below_the_top(flat: Sequence[torch.Tensor]) -> bool:
    """Would a Function applied below the innermost transform record a node: a grad or jvp level
    below it, or an input that requires grad or carries a plain forward-mode tangent?"""
    below = interpreter_stack()[:-1]
    return any(i.key() in (TransformType.Grad, TransformType.Jvp) for i in below) or any(
        _requires_grad(t) or has_tangent(t) for t in flat
    )


def _refusing_one_draw_for_the_batch(region: Region, flat: Sequence[torch.Tensor], vmap: Any) -> Tensors:
    """The region applied as usual, refused if it drew random numbers.

    torch.func runs a Function none of whose inputs is batched at a vmap level below that
    level, once for the whole batch: a random operator inside draws one sample where the
    function without remat draws one per example (``"different"``), or raises (``"error"``).
    Where a level below records the Function's node (``grad(vmap(f))``), it must be applied;
    running it under that vmap instead would batch every output, random or not, and change
    what the caller's code may do with them (write them in place, read ``.item()``). So the
    call runs as torch.func runs it, and the generators tell whether it drew.
    """
    outs, drew = _drawing(region, flat, lambda: cast(Tensors, custom_function_call(_RematFunction, region, *flat)))
    if drew is not None:
        _rng.restore(drew)  # refused: the generators as they were, as where torch.func raises itself
        randomness = vmap.randomness()
        raise CheckpointError(
            f"remat({region.name}): the function drew random numbers under torch.func.vmap("
            f"randomness={randomness!r}) with none of its inputs batched there. torch.func runs such a call "
            "once for the whole batch: it would draw one sample where the function without remat "
            + ("draws one per example" if randomness == "different" else "raises")
            + ". Pass the remat'd function an input that is batched there (the vmapped tensor, or one computed "
            "from it), or use randomness='same' if one sample for the whole batch is what you want."
        )
    return outs


class _AtLevel:
    """A region and the grad or jvp level it is applied at: what :class:`_RematAtLevel` is given."""

    __slots__ = ("interpreter", "region")

    def __init__(self, region: Region, interpreter: Any) -> None:
        self.region, self.interpreter = region, interpreter


def _apply_at_level(top: Any, region: Region, flat: Sequence[torch.Tensor]) -> Tensors:
    """``custom_function_call(_RematFunction, region, *flat)`` where a grad or jvp level is on top.

    What functorch does there (``dispatch_functorch``, the interpreter's ``process`` and
    ``custom_function_call_grad``): unwrap dead wrappers, lift the tensors to the level, apply a single-level Function at that level whose forward
    applies ``_RematFunction`` one level lower and whose backward and jvp are
    ``_RematFunction``'s. functorch builds that Function as a new class on every call
    and applies the one below through ``Function.apply``, which binds its signature;
    :class:`_RematAtLevel` is that Function, made once, taking the level as an argument.
    Elsewhere (vmap, functionalize, a torch-function mode or subclass to consult,
    ``torch.export`` tracing) ``apply`` leaves the call to functorch.
    """
    interpreter = GradInterpreter(top) if top.key() == TransformType.Grad else JvpInterpreter(top)
    lift = level_lift(interpreter)
    flat = tuple(lift(unwrap_if_dead(t)) for t in flat)
    allowed = single_level_function_allowed()
    set_single_level_function_allowed(True)
    try:
        return cast(Tensors, _RematAtLevel.apply(_AtLevel(region, interpreter), *flat))
    finally:
        set_single_level_function_allowed(allowed)


# ----------------------------------------------------------------- derived regions


class VmapRegion(Region):
    """``vmap(base)``: the batching rule of a remat'd region."""

    def __init__(self, base: Region, in_dims: Sequence[int | None], randomness: str) -> None:
        self.base, self.in_dims, self.randomness = base, tuple(in_dims), randomness
        self.name = base.name
        # Per output: not batched at this vmap (computed from unbatched inputs only), as the run found.
        self.unbatched: tuple[bool, ...] = ()

    def release_kept(self) -> None:
        self.base.release_kept()

    #: The inputs that required grad at the grad or jvp level right below this vmap, where one of a
    #: level below that required grad too (see :meth:`note_levels_below`); ``None`` otherwise.
    grad_primals_below: list[int] | None = None

    def note_levels_below(self, flat: Sequence[torch.Tensor]) -> None:
        """Note, in the vmap rule (the vmap level stepped off the stack, ``flat`` unwrapped from it),
        whether the caller's level below the vmap is a grad or jvp level and an input of a level below
        that one requires grad (a module's parameter, under ``grad(vmap(f))``, ``jacrev(vmap(f))``,
        ``jacfwd(vmap(f))``). What the function computes from it alone is then a tensor of that level
        which says it requires no grad; its forward run, lowered out of that level into plain autograd
        where the parameter is a leaf, would see it require grad, and another primal value (or a false
        alarm where its recomputation saw otherwise). The forward run then takes a grad level of its
        own below this vmap (:meth:`run`), whose primals are the inputs that required grad at the
        caller's level, as the function without remat has."""
        top = peek_interpreter_stack()
        if top is None or top.key() not in (TransformType.Grad, TransformType.Jvp) or not torch.is_grad_enabled():
            return
        level = top.level()
        own = [maybe_get_level(t) == level for t in flat]
        required = [t.requires_grad for t in flat]
        # (Also an input of that level that says it requires no grad there while the tensor it wraps
        # does below it, where the forward run goes lowered: one that level computed from a tensor
        # requiring grad below it, or wrapped, in a remat'd call nested in another's run at a level
        # of its own, where every input of the outer call is wrapped: ``jvp(vmap(f))`` of a function
        # whose nested remat'd call reads a module's parameter.)
        lower = True in map(operator.gt, required, own) or any(
            o and not r and _requires_grad_below(t, level) for t, r, o in zip(flat, required, own)
        )
        if lower and not _reaches_a_script_module(self.base):
            self.grad_primals_below = [i for i, (t, r, o) in enumerate(zip(flat, required, own)) if r and o and has_gradient_dtype(t)]

    def run(self, flat: Tensors, phase: Phase) -> Tensors:
        if self.grad_primals_below is not None and not grad_levels_active():
            # Lowered out of that level (into plain autograd, or below an outer vmap's own vmap rule:
            # ``vmap(grad(vmap(f)))``), where no grad level is left: the run at a grad level of its own,
            # below the vmap, as without remat. (A recomputation at a grad level already, the one
            # vjp enters for primals_of_own_level or a transform's, runs as it is.)
            if phase is Phase.FORWARD and peek_interpreter_stack() is None:
                self.primals_of_own_level = self.grad_primals_below  # (for vjp in plain autograd)
            return at_a_grad_level_of_its_own(lambda full: self._run(tuple(full), phase), flat, self.grad_primals_below)
        return self._run(flat, phase)

    def _run(self, flat: Tensors, phase: Phase) -> Tensors:
        unbatched: list[bool] = []

        def body(*xs: torch.Tensor) -> Tensors:
            outs = self.base.run(xs, phase)
            top = peek_interpreter_stack()
            unbatched[:] = [not _batched_at(o, top.level()) for o in outs]
            return outs

        outs = torch.func.vmap(body, in_dims=self.in_dims, out_dims=0, randomness=self.randomness)(*flat)
        # An output that is not batched comes back expanded along the batch: it leaves unbatched
        # (the vmap rule says so, out_dims None), as it would without remat (vmap(f, out_dims=None)
        # accepts it, and forward-mode AD above writes one tangent into it, not one per example).
        self.unbatched = tuple(unbatched)
        # (its first example, as a view that exists for an empty batch too)
        return tuple(o.as_strided(o.shape[1:], o.stride()[1:], o.storage_offset()) if u else o for o, u in zip(outs, unbatched))

    def note_mutated_inputs(self, indices: list[int]) -> None:
        self.base.note_mutated_inputs(indices)

    def own_vjp(
        self,
        primals: Tensors,
        cotangents: Tensors,
        needs: Sequence[bool],
        *,
        create_graph: bool,
        advancing: Callable[[], contextlib.AbstractContextManager[Any]],
        step_vjp: StepVjp,
    ) -> list[torch.Tensor | None] | None:
        """``vmap`` of the base's own vjp, if it has one (a checkpointed loop batched step by step)."""
        base = self.base
        while isinstance(base, VmapRegion):  # (nested vmaps: the innermost region's own vjp, if any)
            base = base.base
        if type(base).own_vjp is Region.own_vjp:
            return None
        top = peek_interpreter_stack()
        if top is not None and top.key() == TransformType.Vmap and not any(_batched_at(p, top.level()) for p in primals):
            return None  # cotangents batched over primals that are not (jacrev): recomputed whole, below that vmap
        n = len(primals)
        unused: set[int] = set()

        def batched(*flat: torch.Tensor) -> Tensors:
            grads = _own_vjp_here(self.base, flat[:n], flat[n:], needs, create_graph)
            assert grads is not None
            unused.update(i for i, g in enumerate(grads) if g is None)
            return tuple(torch.zeros_like(p) if g is None else g for p, g in zip(flat, grads))

        # An output the run found unbatched left with out_dims None: its cotangent is not batched,
        # and every example's vjp would take it whole; each takes its share, so that their sum (an
        # unbatched primal's gradient) takes it once.
        unbatched = self.unbatched or (False,) * len(cotangents)
        size = next((p.shape[d] for p, d in zip(primals, self.in_dims) if d is not None), 1)
        if any(unbatched) and size > 1:
            cotangents = tuple(c / size if u else c for c, u in zip(cotangents, unbatched))
        in_dims = (*self.in_dims, *(None if u else 0 for u in unbatched))
        # Each gradient is batched where its primal is (a loop vmapped over in_dims=1); that of an
        # unbatched primal, which every example used, is the sum of the examples' gradients.
        out_dims = tuple(0 if d is None else d for d in self.in_dims)
        grads = torch.func.vmap(batched, in_dims=in_dims, out_dims=out_dims, randomness=self.randomness)(*primals, *cotangents)
        grads = tuple(g.sum(0) if d is None else g for g, d in zip(grads, self.in_dims))
        return [None if i in unused or not need else g for i, (g, need) in enumerate(zip(grads, needs))]


class VjpRegion(Region):
    """``(primals, cotangents) -> gradients``: the backward of ``base``, recomputing it."""

    def __init__(self, base: Region, n_primals: int, needs: Sequence[bool], of_a_grad_level: int | None = None) -> None:
        self.base, self.n, self.needs = base, n_primals, tuple(needs)
        self.name = base.name
        # The torch.func grad level whose backward this is, lowered out of it (grad(grad(f))'s inner
        # one), which an outer level differentiates: see vjp's ``of_a_grad_level``.
        self.of_a_grad_level = of_a_grad_level
        # Positions (among the needed gradients) the outputs do not depend on, as the
        # forward run found: a Function cannot return None, so the caller restores it.
        self.unused: set[int] = set()

    def release_kept(self) -> None:
        self.base.release_kept()

    def run(self, flat: Tensors, phase: Phase) -> Tensors:
        primals, cotangents = flat[: self.n], flat[self.n :]
        # Differentiated in forward mode too (a jvp region's recomputation of this backward: a
        # Hessian of a loss that takes a gradient), it runs with grad mode on, as torch.func.grad's
        # own backward does: the backward formulas then take their differentiable form (SiLU's
        # and Mish's infinitely_differentiable_*_backward, not the fused silu_backward and
        # mish_backward kernels, which have no forward-mode derivative); see _vjp_here.
        create_graph = _needs_graph(flat) or forward_mode_active()
        replayable_backward(True)  # (a hook removing itself here runs again when this is recomputed)
        try:
            grads = vjp(self.base, primals, cotangents, self.needs, create_graph=create_graph, of_a_grad_level=self.of_a_grad_level)
        finally:
            replayable_backward(False)
        needed = [(p, g) for p, g, need in zip(primals, grads, self.needs) if need]
        if phase is Phase.FORWARD:
            self.unused = {k for k, (_, g) in enumerate(needed) if g is None}
        return tuple(torch.zeros_like(p) if g is None else g for p, g in needed)


class JvpRegion(Region):
    """``(primals, tangents) -> output tangents``: forward-mode through ``base``.

    Only the primals in ``with_tangent`` (the inputs that were duals when the call was
    made) become duals in the recomputation; the others stay plain, as in the function
    without remat. A zero tangent is not the same thing: some operators refuse a dual
    where the original call had none (``batch_norm``'s running statistics in eval mode).
    """

    def __init__(self, base: Region, n_primals: int, with_tangent: Sequence[bool]) -> None:
        self.base, self.n = base, n_primals
        self.with_tangent = tuple(with_tangent)
        self.name = base.name
        # The caller's grad mode, which the recomputation runs in, as the function without remat
        # does: applied as a Function (its result needs a graph), its forward runs without. A
        # forward-mode formula consults it (SiLU's tangent is silu_backward(t, x) without grad
        # mode, which has no forward-mode derivative): a function taking a jvp of its own
        # (torch.func.jvp inside remat, differentiated by a Hessian-vector product) needs it on.
        self.grad_mode = torch.is_grad_enabled()

    def release_kept(self) -> None:
        self.base.release_kept()

    def run(self, flat: Tensors, phase: Phase) -> Tensors:
        # torch's fused attention kernels have no forward-mode AD: the function without remat gets
        # the math kernel here, as its mask or inputs require grad at a level this recomputation
        # runs below (a learned attention bias under hessian); so does the recomputation.
        grad_was = torch.is_grad_enabled()
        set_grad_enabled(self.grad_mode)
        try:
            with sdpa_kernel([SDPBackend.MATH]):
                return self._run(flat, phase)
        finally:
            set_grad_enabled(grad_was)

    def _run(self, flat: Tensors, phase: Phase) -> Tensors:
        primals, tangents = flat[: self.n], flat[self.n :]
        diff = [i for i, p in enumerate(primals) if self.with_tangent[i] and has_gradient_dtype(p)]

        def f(*xs: torch.Tensor) -> Tensors:
            # (Under torch.func.jvp, the inputs without a tangent join its level too; a dual made
            # at the user's forward-mode level below has no level of its own to join.)
            full = at_the_top_level(primals) if peek_interpreter_stack() is not None else list(primals)
            for i, x in zip(diff, xs):
                full[i] = x
            return _recomputed_at_the_call_grad_level(self.base, tuple(full))

        diff_p = tuple(primals[i] for i in diff)
        diff_t = tuple(tangents[i] for i in diff)
        if peek_interpreter_stack() is None and forward_ad_level() >= 0 and not func_jvp_nests():
            # Plain forward-mode AD (inside the user's fwAD.dual_level): torch.func.jvp cannot nest
            # there, so make duals at the user's level instead. Below the levels of a torch.func.jvp,
            # whose dual level is in force, torch.func.jvp nests, as a functorch level of its own,
            # and is used: duals made at that one plain level met those of the forward-mode levels
            # the function itself enters or that another jvp region's run made there, silently
            # (a Hessian-vector product of a MAML loss, jvp(grad(f)) with f taking a gradient
            # through remat, was wrong) or loudly ("Setting a forward grad that itself has a forward
            # gradient at the same level0": jvp of grad of jvp).
            with set_fwd_grad_enabled(True):
                # (an inference tensor carries no tangent: a dual of it would be silently constant)
                outs = f(*(make_dual(_not_inference(unpack_dual(p).primal), t) for p, t in zip(diff_p, diff_t)))
                unpacked = [unpack_dual(o) for o in outs]
            outs = tuple(u.primal for u in unpacked)
            out_tangents = tuple(torch.zeros_like(u.primal) if u.tangent is None else u.tangent for u in unpacked)
        else:
            if not diff_p:  # (nothing carries a tangent: torch.func.jvp refuses no primals)
                outs = f()
                out_tangents = tuple(torch.zeros_like(o) for o in outs)
            else:
                # (one constant output more: torch.func.jvp refuses a function returning none, as a
                # region does whose outputs are all inputs returned as they are, remat(lambda: y);
                # made here, under the modes on: a FakeTensor where make_fx traces with fake tensors)
                both = cast("tuple[Tensors, Tensors]", torch.func.jvp(lambda *xs: (*f(*xs), torch.zeros(())), diff_p, diff_t))
                outs, out_tangents = tuple(both[0][:-1]), tuple(both[1][:-1])
        return tuple(t if has_gradient_dtype(o) else torch.zeros_like(o) for o, t in zip(outs, out_tangents))


def _recomputed_at_the_call_grad_level(region: Region, flat: Tensors) -> Tensors:
    """``region``'s recomputation for a jvp, its inputs requiring grad where they did at the call.

    The call was made at a grad level above the jvp's (``hessian``: ``jacfwd(jacrev(f))``), where
    the function's inputs require grad: it may take a gradient of its own (``torch.autograd.grad``
    inside it, a gradient penalty) or register a hook on an intermediate, as without remat. The jvp
    rule runs below that level, where they do not: so, as the forward run under a vmap does (see
    ``UserRegion._forward_run_at_a_grad_level``), it runs under a grad level of its own whose
    primals are those inputs (:func:`~funckpt._internals.at_a_grad_level_of_its_own`), its outputs
    taken back out of it, with their tangents.
    """
    # (Not where no grad level was: the inputs required grad at plain autograd's, below the jvp,
    # whose derivative the JvpRegion's own Function gives; a TorchScript module's optimized graph
    # takes a path there whose tangents are wrong.)
    # Its primals are the inputs of the caller's innermost level that required grad there, as the
    # forward run's own level's are: one of a level below (a module's parameter) requires grad at
    # plain autograd's level only, and what the function computes from it alone at the call's
    # levels says it requires none (``grad(jvp(f))``: ``lin(x)`` where ``x`` is the jvp's). As a
    # primal it made the recomputation see the other thing, with the forward run: silently other
    # values (the function branching on it, or taking a gradient of its own, as without remat it does not).
    required = region.required_grad_at_call if region.grad_level_at_call else None
    innermost = region.of_the_innermost_level or [True] * len(flat)
    wrt = (
        []
        if required is None
        else [
            i
            for i, (t, r, own) in enumerate(zip(flat, required, innermost))
            if r and own and not t.requires_grad and has_gradient_dtype(t)
        ]
    )
    if not wrt:
        return region.run(flat, Phase.RECOMPUTE)
    # (The others join the level too: see at_the_top_level.)
    return at_a_grad_level_of_its_own(lambda full: region.run(tuple(full), Phase.RECOMPUTE), flat, wrt)


def _recomputed_at_the_forward_runs_level(region: Region, leaves: Tensors, wrt: Sequence[int]) -> Tensors:
    """``region``'s recomputation in plain autograd, under a grad level of its own whose primals are
    the inputs at ``wrt``, as its forward run had (a call under ``grad(f)``, lowered into plain
    autograd, whose function reads a module's parameter: see ``primals_of_own_level``).

    Differentiated at the base level (a gradient penalty, or an output computed from the parameter
    alone, after the transform), the recomputation would otherwise see a tensor computed from the
    parameter alone require grad where the forward run (and the function without remat) saw it
    require none. The level's wrappers pass the operators down to plain autograd, which records the
    graph from the local leaves as it does without the level: the outputs, taken back out of the
    level, carry it, and that level's own graph is dropped.
    """
    # (The others join the level too: see at_the_top_level.)
    return at_a_grad_level_of_its_own(lambda full: region.run(tuple(full), Phase.RECOMPUTE), leaves, wrt)


def refuse_cut_off(region: Region, live: Sequence[bool], cotangents: Sequence[Any], needs: Sequence[bool]) -> None:
    """Raise :class:`CheckpointError` where an output the forward run's graph made differentiable is not
    in the recomputation's, though every input that required grad at the call is a leaf requiring
    grad here (a plain autograd backward of them all, ``.backward()``'s).

    The determinism check compares values, which a function that now cuts an output off its inputs
    keeps: ``y.detach()``, ``torch.no_grad()`` or ``requires_grad_(False)`` on a branch taken on a flag,
    a global or a module attribute changed between the forward and the backward pass. Its gradient
    would be silently ``None`` where the function without remat differentiates the forward run's graph.
    Told where the forward run recorded the caller's graph (under plain autograd: ``out_differentiable``).
    ``live``: which of the recomputation's outputs are differentiable (asked only where one is not).
    """
    forward = getattr(region, "out_differentiable", None)  # (a user's region: UserRegion's)
    if forward is None or len(forward) != len(live) or region.options.determinism_check != "default":  # type: ignore[attr-defined]
        return
    if not all(need for need, d in zip(needs, region.differentiable) if d):  # type: ignore[attr-defined]
        return
    for k, (now, c, was) in enumerate(zip(live, cotangents, forward)):
        if was and c is not None and not now:
            raise CheckpointError(
                f"remat({region.name}): {the_recomputation()} did not reproduce the forward pass: output "
                f"tensor {k} depends differentiably on the inputs in the forward pass, not in the "
                "recomputation (same values, cut off from the graph: a detach(), torch.no_grad() or "
                "requires_grad_(False) taken on a flag, a global or a module attribute that changed "
                "between the forward and the backward pass). Its gradient would be silently missing. "
                "The function must compute the same thing when called again with the same inputs: do not "
                "change such state before the backward pass. Pass determinism_check='none' to skip this check."
            )


def _differentiated_at_the_forward_runs_level(
    region: Region,
    leaves: Tensors,
    cotangents: Tensors,
    wrt: Sequence[int],
    create_graph: bool,
    primals: Sequence[int] | None = None,
) -> list[torch.Tensor | None]:
    """``region``'s vjp with respect to the primals of its forward run's own grad level alone (see
    ``primals_of_own_level``): ``grad(f)``'s own backward of a call lowered into plain autograd.

    Recomputed and differentiated at a grad level of its own, as ``torch.func.grad`` differentiates
    at its level: what the function computes from a module's parameter alone says it requires no
    grad, as in the forward run, and a hook the function registers on an intermediate acts on this
    gradient, as without remat. With ``create_graph`` the level's operators are recorded by plain
    autograd below it too, from the local leaves: a gradient penalty reaches the parameter.
    ``primals``: the level's primals, where more inputs than ``wrt`` require grad there.
    """

    def run(full: list[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        outs = region.run(tuple(full), Phase.RECOMPUTE)
        pairs = [(o, c) for o, c in zip(outs, cotangents) if o.requires_grad and not made_under_no_grad(o)]
        if not pairs:
            return [None] * len(wrt)
        grads = autograd_grad([o for o, _ in pairs], [full[i] for i in wrt], [c for _, c in pairs], create_graph)
        if region.retained_grads:
            region.add_retained_parts(outs, cotangents)
        return grads

    result: list[torch.Tensor | None] = [None] * len(leaves)
    for i, g in zip(wrt, at_a_grad_level_of_its_own(run, leaves, wrt if primals is None else primals)):
        result[i] = g
    return result


def _hooks_acting_at(region: Region, level: int) -> bool | None:
    """Does a hook the function of ``region`` registers at its call act on the gradient of the grad
    level ``level``? ``True`` at the level the call was made at (its innermost transform a grad
    level), ``False`` at a level below it (or below the jvp level the call was made at, where the
    function's tensors say they require no grad, and register no hook); ``None`` where the call was
    made at no grad or jvp level."""
    while isinstance(region, _SomeOutputs):
        region = region.base
    at = region.grad_level_of_the_call
    return None if at is None else level >= at


def _primals_at_the_call(region: Region, leaves: Sequence[torch.Tensor]) -> list[int]:
    """The inputs of ``region`` that required grad at its call, at its innermost level."""
    while isinstance(region, _SomeOutputs):
        region = region.base
    required, innermost = region.required_grad_at_call, region.of_the_innermost_level
    if required is None or innermost is None:
        return []
    return [i for i, (t, r, own) in enumerate(zip(leaves, required, innermost)) if r and own and has_gradient_dtype(t)]


# --------------------------------------------------------------------- the vjp itself


def vjp(
    region: Region,
    primals: Tensors,
    cotangents: Tensors,
    needs: Sequence[bool],
    *,
    create_graph: bool,
    of_a_grad_level: int | None = None,
) -> list[torch.Tensor | None]:
    """Recompute ``region`` at the current functorch stack and return its vjp.

    With ``create_graph`` the result is differentiable; without it nothing of
    the recomputation outlives this call. ``None`` marks an input the outputs
    do not depend on.

    ``of_a_grad_level``: the torch.func grad level (its number) whose backward this is, lowered out
    of it into plain autograd. Without remat a hook the function registers (``h.register_hook``)
    is registered at the grad level the call was made at and acts on that level's gradient only;
    the levels below it (``grad(grad(f))``'s outer one) record the same operators without it.
    Recomputed in plain autograd, the hook acted on every level's gradient that went through the
    recomputed graph (silently scaled under ``grad(grad(f))``, ``hessian``). So (see
    :func:`_hooks_acting_at`) the backward of the call's own level, to be differentiated again
    (``create_graph``), is recomputed and differentiated at a grad level of its own, and that of a
    level below the call's is recomputed at a grad level of its own and differentiated below it,
    where the hook does not act.
    """
    if type(region).own_vjp is not Region.own_vjp:  # (a loop's region; asked only where it may answer)
        own = _own_vjp_here(region, primals, cotangents, needs, create_graph)
        if own is not None:
            return own
    wrt = [i for i, need in enumerate(needs) if need]
    # (Whether the hooks the function registers act on this gradient: see of_a_grad_level.)
    acting = None if of_a_grad_level is None or not wrt else _hooks_acting_at(region, of_a_grad_level)
    if peek_interpreter_stack() is None:
        # Plain autograd: recompute and differentiate locally. Without
        # create_graph the recomputation starts from detached leaves; with it,
        # from aliases that stay connected to the primals' own graph, so the
        # result can be differentiated again.
        grad_was = torch.is_grad_enabled()
        # Below a torch.func level entered in inference_mode autograd is excluded from dispatch:
        # the recomputation and, with create_graph, its vjp must record all the same.
        included = autograd_included()
        included.__enter__()
        set_grad_enabled(True)  # torch.enable_grad() without its Python frames
        try:
            if create_graph:
                leaves = tuple(_local_leaf(p, need, True) for p, need in zip(primals, needs))
            else:
                leaves = tuple(local_input(p, need) for p, need in zip(primals, needs))
            if forward_ad_level() >= 0:  # (inside the user's fwAD.dual_level: rare)
                leaves = _keeping_tangents(primals, leaves)
            own_level = region.primals_of_own_level
            plain = False  # (recomputed at the backward's own level: see refuse_cut_off)
            if _in_legacy_vmap():
                with _outside_legacy_vmap():
                    outs = region.run(leaves, Phase.RECOMPUTE)
            elif acting is False:
                outs = _recomputed_at_the_forward_runs_level(region, leaves, _primals_at_the_call(region, leaves))
            elif acting and create_graph:
                primals_there = sorted({*wrt, *_primals_at_the_call(region, leaves)})
                return _differentiated_at_the_forward_runs_level(region, leaves, cotangents, wrt, create_graph, primals_there)
            elif own_level is not None and wrt and set(wrt) <= set(own_level):
                return _differentiated_at_the_forward_runs_level(region, leaves, cotangents, wrt, create_graph)
            elif own_level is not None:
                outs = _recomputed_at_the_forward_runs_level(region, leaves, own_level)
            else:
                outs = region.run(leaves, Phase.RECOMPUTE)
                plain = True
            live = [o.requires_grad and not made_under_no_grad(o) for o in outs]
            if plain and not all(live):  # (an output cut off from the inputs: was it in the forward run?)
                refuse_cut_off(region, live, cotangents, needs)
            pairs = [(o, c) for o, c, differentiable in zip(outs, cotangents, live) if differentiable]
            if not pairs:
                return [None] * len(primals)
            if region.own_leaf_hooks and not create_graph and own_level is None and backward_names_no_inputs():
                grads = _vjp_into_own_leaves(leaves, pairs, wrt)
            else:
                try:
                    grads = autograd_grad(
                        [o for o, _ in pairs], [leaves[i] for i in wrt], [c for _, c in pairs], create_graph
                    )
                except RuntimeError as e:
                    if not _refused_by_reentrant_checkpoint(e):
                        raise
                    grads = _vjp_around_reentrant_checkpoint(region, primals, cotangents, needs, wrt, create_graph, e)
            if region.retained_grads:
                region.add_retained_parts(outs, cotangents)
        finally:
            set_grad_enabled(grad_was)
            included.__exit__()
    else:
        # Under torch.func transforms: a fresh vjp level on top of the current stack.
        differentiable: list[bool] = []
        f = _recompute_of(region, primals, wrt, differentiable, hooks_elsewhere=acting is False)
        outs, vjp_fn = _func_vjp(f, [primals[i] for i in wrt])
        if not outs:
            return [None] * len(primals)
        # With grad mode on whatever create_graph says, as torch.func.grad's own backward runs (it
        # passes create_graph=True): a backward formula then takes its differentiable form
        # (group_norm's, rms_norm's, dropout's, SiLU's, ...; derivatives.yaml's
        # GradMode::is_enabled() branches), whose batching rules and forward-mode derivatives
        # exist where the fused kernels' do not (group_norm's backward under vmap refuses a
        # bfloat16 input with a float32 gradient, as bf16 autocast gives it). The graph it records
        # is at this vjp's own level, dropped with the results' wrappers: nothing outlives the call.
        grads = vjp_fn(tuple(c for c, d in zip(cotangents, differentiable) if d), create_graph=True)
    result: list[torch.Tensor | None] = [None] * len(primals)
    for i, g in zip(wrt, grads):
        result[i] = g
    return result


def _add_retained_part(caller: torch.Tensor | None, recomputed: torch.Tensor, cotangent: torch.Tensor | None) -> None:
    """Add to the caller's output's retained ``.grad`` the gradient that reached the recomputed
    output through the call's other outputs: all it got, less the cotangent autograd gave the caller's
    (``None``: where autograd gave the caller's tensor none of it)."""
    if caller is None or recomputed.grad is None:
        return
    part = recomputed.grad.detach() if cotangent is None else recomputed.grad.detach() - cotangent.detach()
    with torch.no_grad():
        caller.grad = part if caller.grad is None else caller.grad + part


def _func_vjp(
    f: Callable[..., Tensors], primals: Sequence[torch.Tensor]
) -> tuple[Tensors, Callable[..., tuple[torch.Tensor | None, ...]]]:
    """``torch.func.vjp(f, *primals)``, whose vjp gives ``None`` for a primal no gradient reached.

    ``torch.func.vjp``'s gives a zero tensor there (functorch fills in what
    ``torch.autograd.grad(..., allow_unused=True)`` left ``None``), which its caller cannot tell
    from a gradient that is zero. :func:`vjp` promises ``None`` for an input the outputs do not
    depend on, and that gradient may leave the transforms: a loop's steps differentiated below
    a ``vmap`` under plain autograd, where a zero would land in a ``.grad`` that the function
    without remat leaves ``None`` (and an optimizer would then move the weight). A hook on each
    primal at the vjp's level notes the gradients the engine computes: those ``allow_unused`` returns.
    """
    reached: set[int] = set()

    def noting(*xs: torch.Tensor) -> Tensors:
        for k, x in enumerate(xs):
            if x.requires_grad:
                register_tensor_hook(x, functools.partial(_note_reached, reached, k))
        return f(*xs)

    outs, vjp_fn = cast("tuple[Tensors, Callable[..., Any]]", torch.func.vjp(noting, *primals))

    def vjp_reached(cotangents: Tensors, **kwargs: Any) -> tuple[torch.Tensor | None, ...]:
        grads = vjp_fn(cotangents, **kwargs)
        return tuple(g if k in reached else None for k, g in enumerate(grads))

    return outs, vjp_reached


def _note_reached(reached: set[int], k: int, grad: torch.Tensor | None) -> None:
    """A primal's hook (see :func:`_func_vjp`): its gradient was computed, if it is a tensor."""
    if grad is not None:
        reached.add(k)


def _refused_by_reentrant_checkpoint(e: RuntimeError) -> bool:
    """Is ``e`` the refusal of a ``torch.utils.checkpoint(..., use_reentrant=True)`` inside ``fn``?

    Its backward runs only in a backward pass that names no ``inputs``
    (``torch.autograd.grad`` always does). Also that refusal as a region nested in this one's
    recomputation passes it on (a remat'd call or a loop's step whose ``fn`` uses the reentrant
    checkpoint): it met it under this region's ``torch.autograd.grad``, and runs in the
    ``.backward()`` this region falls back to.
    """
    if getattr(e, "reentrant_checkpoint_refused", False):
        return True
    return "use_reentrant=True" in str(e) and "incompatible with .grad()" in str(e)


def _vjp_around_reentrant_checkpoint(
    region: Region,
    primals: Tensors,
    cotangents: Tensors,
    needs: Sequence[bool],
    wrt: Sequence[int],
    create_graph: bool,
    error: RuntimeError,
) -> tuple[torch.Tensor | None, ...]:
    """The vjp of a region whose ``fn`` uses PyTorch's reentrant checkpoint, under ``.backward()``.

    As under ``torch.utils.checkpoint(use_reentrant=False)`` around it: the caller's
    backward pass names no inputs, so the recomputation is differentiated by a
    backward pass that names none either, into fresh detached leaves.
    """
    if create_graph or not backward_names_no_inputs():
        refusal = CheckpointError(
            f"remat({region.name}): the function calls torch.utils.checkpoint(..., use_reentrant=True), "
            "whose backward runs only in a .backward() that passes no inputs= and no create_graph "
            "(as without remat). Use use_reentrant=False (or funckpt.checkpoint) inside the function."
        )
        # (Where this region runs in an enclosing region's recomputation, that region's
        # torch.autograd.grad is what names inputs: it falls back to .backward() on seeing this.)
        refusal.reentrant_checkpoint_refused = True  # type: ignore[attr-defined]
        raise refusal from error
    leaves = tuple(p.detach().requires_grad_(True) if need else p.detach() for p, need in zip(primals, needs))
    outs = region.run(leaves, Phase.RECOMPUTE)
    pairs = [(o, c) for o, c in zip(outs, cotangents) if o.requires_grad and not made_under_no_grad(o)]
    torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
    return tuple(leaves[i].grad for i in wrt)


def _vjp_into_own_leaves(
    leaves: Tensors, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], wrt: Sequence[int]
) -> tuple[torch.Tensor | None, ...]:
    """The vjp of a recomputation that made a leaf requiring grad with a hook on it, under a ``.backward()``
    that names no inputs: by a backward pass naming none either, into the recomputation's leaves.

    Without remat such a backward pass reaches every leaf of the graph, the function's own too
    (``z = torch.zeros(3, requires_grad=True); z.register_hook(log)``): its hooks run with its
    gradient, its post-accumulate-grad hooks after that. ``torch.autograd.grad`` over the call's inputs
    alone does not reach it, and they silently did not run. As where the function calls a reentrant
    checkpoint (:func:`_vjp_around_reentrant_checkpoint`), the recomputation's inputs are fresh leaves
    of its own, and every other leaf requiring grad it reaches is one it made (or it refuses it).
    """
    torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
    return tuple(leaves[i].grad for i in wrt)


def _own_vjp_here(
    region: Region, primals: Tensors, cotangents: Tensors, needs: Sequence[bool], create_graph: bool
) -> list[torch.Tensor | None] | None:
    """``region``'s own vjp (if it has one) with this stack's rules: :func:`vjp` for each step."""
    return region.own_vjp(
        primals,
        cotangents,
        needs,
        create_graph=create_graph,
        advancing=functools.partial(_advancing, create_graph),
        step_vjp=functools.partial(vjp, create_graph=create_graph),
    )


@contextlib.contextmanager
def _advancing(create_graph: bool) -> Iterator[None]:
    """Where a region's own vjp runs steps forward: recorded only if the result must be differentiable."""
    with _outside_legacy_vmap(), contextlib.nullcontext() if create_graph else torch.no_grad():
        yield


def at_the_top_level(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` wrapped at the innermost level: a ``torch.func.vjp`` or ``jvp`` that a run of a
    region entered, whose function receives all of a region's inputs, its primals or not.

    ``torch.func.grad`` and ``jvp`` wrap all of their arguments at their level; a run's own vjp or
    jvp differentiates only some of a region's inputs, and the others, captured from below its
    level, would be tensors torch refuses to write in place there (BatchNorm's running statistics,
    a layer clamping its own weight through ``.data``) where, without remat, they are tensors of
    the caller's level, which may be written. So they join the level too. (A run nested in this
    one routes its captured tensors only through the substitutions whose modes are on, and so
    never gets one of these wrappers where this level is not on the stack: see
    :func:`~funckpt._capture.route_through_enclosing`.)
    """
    level = peek_interpreter_stack().level()
    return [wrap_for_grad(t, level) for t in tensors]


def _recompute_of(
    region: Region, primals: Tensors, wrt: Sequence[int], differentiable: list[bool], hooks_elsewhere: bool = False
) -> Callable[..., Tensors]:
    """The recomputation as a function of the primals at positions ``wrt``, for ``torch.func.vjp``.

    It returns the differentiable outputs only and records in ``differentiable``
    which outputs those were, so the caller can pick the matching cotangents.
    ``hooks_elsewhere``: the vjp is that of a grad level below the call's, on whose gradient the
    hooks the function registers do not act (see :func:`vjp`): the recomputation runs at a grad
    level of its own above the vjp's, its inputs requiring grad there as at the call.
    """

    def f(*xs: torch.Tensor) -> Tensors:
        full = at_the_top_level(primals)
        for i, x in zip(wrt, xs):
            full[i] = x
        if hooks_elsewhere:
            outs = _recomputed_at_the_forward_runs_level(region, tuple(full), _primals_at_the_call(region, full))
        else:
            outs = region.run(tuple(full), Phase.RECOMPUTE)
        differentiable[:] = [has_gradient_dtype(o) and not made_under_no_grad(o) for o in outs]
        return tuple(o for o, d in zip(outs, differentiable) if d)

    return f


def _in_legacy_vmap() -> bool:
    """Inside autograd's own vmap mode (``is_grads_batched=True``), which batches the cotangents."""
    return legacy_vmap_depth() > 0


@contextlib.contextmanager
def _outside_legacy_vmap() -> Iterator[None]:
    """Leave autograd's own vmap mode (``torch.autograd.grad(..., is_grads_batched=True)``) for the body.

    That mode batches the cotangents only; the recomputation runs on unbatched
    primals, where random operators (dropout) are allowed and replay exactly.
    """
    depth = legacy_vmap_depth()
    for _ in range(depth):
        legacy_vmap_decrement()
    try:
        yield
    finally:
        for _ in range(depth):
            legacy_vmap_increment()


def _local_leaf(p: torch.Tensor, wrt: bool, create_graph: bool) -> torch.Tensor:
    # With create_graph the result must stay differentiable through p: by reverse mode (p's
    # graph) and by plain forward mode (p's tangent, which detach() would drop).
    if create_graph and (p.requires_grad or (not wrt and has_tangent(p))):
        return p.view_as(p) if wrt else p
    return local_input(p, wrt)


def _keeping_tangents(primals: Tensors, leaves: Tensors) -> Tensors:
    """``leaves``, each a dual with its primal's tangent where ``detach()`` dropped it.

    Inside a plain ``forward_ad.dual_level()``, a backward pass computes the tangents of the
    gradients too (the backward formulas run on the duals they saved, with or without
    ``create_graph``): ``torch.func.grad`` of a dual, or ``torch.autograd.grad`` without
    ``create_graph``, gives a gradient that is a dual itself (a Hessian-vector product, forward
    over reverse). The recomputation must start from the primals' tangents to compute them: from
    a detached leaf, the gradient had no tangent (silently ``None``)."""
    kept = []
    for p, leaf in zip(primals, leaves):
        if leaf is not p and not has_tangent(leaf) and has_tangent(p):
            with set_fwd_grad_enabled(True):
                tangent = unpack_dual(p).tangent
                if tangent is not None:
                    leaf = make_dual(leaf, tangent)
        kept.append(leaf)
    return tuple(kept)


def _not_inference(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it made outside inference mode where it is an inference tensor."""
    if not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


def local_input(t: torch.Tensor, leaf: bool) -> torch.Tensor:
    """What a run recording a graph of its own gets for input ``t``: a fresh leaf requiring grad
    (``leaf``) or ``t`` detached. An inference tensor (made in ``torch.inference_mode``, a data
    pipeline's) can neither require grad nor be saved by a graph outside inference mode: the run
    gets a copy. (Under torch.func, where such tensors are inputs one level below the
    transform, the function without remat never records them at their level.)"""
    t = _not_inference(t) if t.is_inference() else t.detach()
    return t.requires_grad_(True) if leaf else t


def _vjp_here(
    region: Region, primals: Tensors, cotangents: Tensors, needs: Sequence[bool], of_a_grad_level: int | None = None
) -> list[Any]:
    """The vjp at the current stack; itself remat'd when it must be differentiable.
    ``of_a_grad_level``: a torch.func grad level's backward, lowered out of it (see :func:`vjp`)."""
    top = peek_interpreter_stack()
    if top is not None and top.key() == TransformType.Vmap and not any(_batched_at(p, top.level()) for p in primals):
        return _vjp_of_batched_cotangents(region, primals, cotangents, needs, VmapInterpreter(top), of_a_grad_level)
    needs_graph = _needs_graph((*primals, *cotangents))
    # Computed directly (not as a remat'd VjpRegion) where a transform of this backward
    # must see its operations: a jvp level (jvp of grad), plain forward-mode AD around a
    # create_graph backward, or autograd's vmap mode of is_grads_batched.
    plain_forward_mode = top is None and forward_ad_level() >= 0
    legacy_vmap = _in_legacy_vmap()
    under_jvp = top is not None and _only_forward_levels_active()
    direct = under_jvp or legacy_vmap or plain_forward_mode
    # Also where the recomputation registers hooks (``h.register_hook`` on a tensor the function
    # makes, a nested call's on its input): remat'd, this backward would be recomputed for the next
    # one, and each hook would run there again (a logging hook counting one call more). Its graph
    # is kept instead, as without remat, for the pass that differentiates it.
    hooked = needs_graph and not direct and region.registers_hooks_when_recomputed()
    if needs_graph and not direct and not hooked:
        vjp_region = VjpRegion(region, len(primals), needs, of_a_grad_level)
        grads = iter(apply(vjp_region, (*primals, *cotangents)))
        needed = [next(grads) if need else None for need in needs]
        positions = [i for i, need in enumerate(needs) if need]
        for k in vjp_region.unused:  # unused inputs get None, as torch.autograd.grad(allow_unused=True) says
            needed[positions[k]] = None
        return needed
    # Under a jvp level the backward runs with grad mode on, as torch.func.grad's own does: the
    # backward formulas then take their differentiable form (SiLU's and Mish's backward call
    # infinitely_differentiable_*_backward, not the fused silu_backward/mish_backward kernels,
    # which have no forward-mode derivative), so the jvp levels can differentiate them.
    create_graph = (needs_graph and (plain_forward_mode or legacy_vmap or hooked)) or under_jvp
    return vjp(region, primals, cotangents, needs, create_graph=create_graph, of_a_grad_level=of_a_grad_level)


def _batched_at(t: torch.Tensor, level: int) -> bool:
    return is_batchedtensor(t) and maybe_get_level(t) == level


def _batched_under(t: torch.Tensor, level: int) -> bool:
    """Is ``t`` batched at the vmap ``level``, by its own wrapper or one under its other vmaps'?

    Under nested vmaps (``vmap(vmap(f))``) a tensor batched at both is a BatchedTensor of the
    inner level around one of the outer: its own wrapper names the inner level only.
    """
    while is_batchedtensor(t):
        if maybe_get_level(t) == level:
            return True
        t = unwrap_one_level(t)
    return False


def _vjp_of_batched_cotangents(
    region: Region,
    primals: Tensors,
    cotangents: Tensors,
    needs: Sequence[bool],
    interpreter: Any,
    of_a_grad_level: int | None = None,
) -> list[Any]:
    """Unbatched primals, batched cotangents (``jacrev``, ``is_grads_batched``): recompute once.

    The forward is recomputed once, below the vmap level, where random
    operators may run (the vmap may forbid them); only the vjp is batched.
    ``of_a_grad_level``: as :func:`vjp`'s.
    """
    level = interpreter.level()
    # An enclosing transform may differentiate the result (grad of jacrev): then the
    # steps a region's own vjp runs forward must be recorded, and its kept values not used.
    create_graph = _needs_graph((*primals, *cotangents))

    def advancing() -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        stack.enter_context(lowered(interpreter))
        # (Under a jvp level (a Hessian: jacfwd of this jacrev) the steps run forward keep grad
        # mode on, as without remat, so that their forward-mode formulas take their differentiable
        # form: a step taking a jvp of its own (SiLU's tangent is silu_backward(t, x) under no_grad,
        # which has no forward-mode derivative) is differentiated by that level again.)
        if not create_graph and not jvp_levels_active():
            stack.enter_context(torch.no_grad())
        return stack

    def step_vjp(r: Region, p: Tensors, c: Tensors, n: Sequence[bool]) -> list[Any]:
        return _vjp_of_batched_cotangents(r, p, c, n, interpreter)

    unwrapped = [unwrap_batched(c, level) for c in cotangents]
    wrt = [i for i, need in enumerate(needs) if need]
    differentiable: list[bool] = []
    acting = None if of_a_grad_level is None or not wrt else _hooks_acting_at(region, of_a_grad_level)
    f = _recompute_of(region, primals, wrt, differentiable, hooks_elsewhere=acting is False)
    if region.drew_at_level == level:
        # The forward run drew its random values per example, at this vmap: so does the
        # recomputation, one vjp per example under this vmap (of a checkpointed loop too, whole:
        # its steps' own vjps would recompute them below it).
        def per_example(_size: torch.Tensor, *cs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            vjp_fn = cast("tuple[Any, Callable[..., Any]]", torch.func.vjp(f, *(primals[i] for i in wrt)))[1]
            return tuple(vjp_fn(tuple(c for c, d in zip(cs, differentiable) if d)))

        size = torch.zeros(()).expand(interpreter.batch_size())  # (gives the vmap its size)
        with lowered(interpreter):
            grads = torch.func.vmap(
                per_example, in_dims=(0, *(b for _, b in unwrapped)), randomness=interpreter.randomness()
            )(size, *(c for c, _ in unwrapped))
        return _at_positions(len(primals), wrt, [add_batch_dim(g, 0, level) for g in grads])
    own = region.own_vjp(primals, cotangents, needs, create_graph=create_graph, advancing=advancing, step_vjp=step_vjp)
    if own is not None:
        return own
    with lowered(interpreter):
        outs, vjp_fn = cast("tuple[Any, Callable[..., Any]]", torch.func.vjp(f, *(primals[i] for i in wrt)))
        cts = tuple(c for (c, _), d in zip(unwrapped, differentiable) if d)
        dims = tuple(b for (_, b), d in zip(unwrapped, differentiable) if d)
        if not outs:
            return [None] * len(primals)
        batched = any(b is not None for b in dims)
        if batched:
            grads = torch.func.vmap(vjp_fn, in_dims=(dims,), randomness=interpreter.randomness())(cts)
        else:
            grads = vjp_fn(cts)
    return _at_positions(len(primals), wrt, [add_batch_dim(g, 0, level) if batched else g for g in grads])


def _at_positions(n: int, positions: Sequence[int], values: Sequence[Any]) -> list[Any]:
    """``n`` entries, ``values`` at ``positions`` and ``None`` elsewhere."""
    result: list[Any] = [None] * n
    for i, v in zip(positions, values):
        result[i] = v
    return result


def _jvp_here(region: Region, primals: Tensors, tangents: Tensors, with_tangent: Sequence[bool]) -> Tensors:
    # Computed directly (not as a remat'd JvpRegion) where only forward-mode levels are on
    # the stack (jvp of jvp): nothing there would keep the jvp's internals, and applying
    # the JvpRegion as a Function dropped the mixed term of an input that is a dual at an
    # enclosing level only, when a plain tensor requiring grad was among the primals (the
    # twin of the vjp's case in _only_forward_levels_active).
    direct = peek_interpreter_stack() is not None and _only_forward_levels_active()
    if _needs_graph((*primals, *tangents)) and not direct:
        if peek_interpreter_stack() is None and forward_ad_level() >= 0:
            # Plain forward-mode AD: the primals are duals at the user's level; the remat'd
            # jvp region takes their primal parts (else applying it would ask for its own jvp).
            with set_fwd_grad_enabled(True):
                primals = tuple(unpack_dual(p).primal for p in primals)
                tangents = tuple(_primal_part(t) for t in tangents)
        return apply(JvpRegion(region, len(primals), with_tangent), (*primals, *tangents))
    return JvpRegion(region, len(primals), with_tangent).run((*primals, *tangents), Phase.RECOMPUTE)


def _primal_part(t: torch.Tensor) -> torch.Tensor:
    """``unpack_dual(t).primal``; ``t`` itself under autograd's legacy vmap (a forward-mode jacobian
    with ``vectorize=True``), where ``_unpack_dual`` has no batching rule and a batched tangent
    is no dual. (Also where a recomputation runs outside that vmap, a nested remat'd call's in
    ``hessian(..., vectorize=True, outer_jacobian_strategy="forward-mode")``: its tangents are
    still legacy-batched there.)"""
    try:
        return unpack_dual(t).primal
    except RuntimeError:
        if not (_in_legacy_vmap() or is_legacy_batchedtensor(t)):
            raise
        return t


def _own_live_level(ctx: Any, kind: TransformType, tensors: Sequence[torch.Tensor]) -> Any:
    """The interpreter of the level this Function was applied at, if live on top."""
    level = ctx.level
    top = peek_interpreter_stack()
    if level == 0 or top is None or top.key() != kind or top.level() != level:
        return None
    if any(is_dead_tensor_wrapper(t) for t in tensors):
        return None
    if not any(maybe_get_level(t) == level for t in tensors):
        return None
    return GradInterpreter(top) if kind == TransformType.Grad else JvpInterpreter(top)


# ------------------------------------------------------------------- the Function


class _RematFunction(torch.autograd.Function):
    @staticmethod
    def forward(region: Region, *flat: torch.Tensor) -> Tensors:
        versions = [_version(t) for t in flat]
        outs = region.run(flat, Phase.FORWARD)
        mutated = [i for i, (t, v) in enumerate(zip(flat, versions)) if v is not None and _version(t) != v]
        if mutated:
            region.note_mutated_inputs(mutated)
        # An output sharing storage with an input (the input itself, or a view of it)
        # becomes a real view of that input, so autograd's rules for views made by
        # a custom Function apply (an in-place update of it raises instead of
        # changing the input behind autograd's back).
        if region.outputs_share_no_input_storage():
            return outs
        storages = {storage_of(t): t for t in flat}
        storages.pop(None, None)
        return tuple(_as_view_of(storages.get(storage_of(o)), o) for o in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensors) -> None:
        region, *flat = inputs
        ctx.region = region
        note_nested_node(ctx)  # (in the forward runs this call is nested in: see forget_nested_regions)
        # Inputs no gradient flows into (buffers, masks, frozen weights, unused module
        # state the function merely reaches) are saved as fresh aliases: same storage,
        # own version counter. A BatchNorm elsewhere bumping its statistics between
        # forward and backward is then no error; a change that matters to the
        # recomputation is caught by the determinism check, which compares values.
        unchecked, read = region.unchecked_inputs(), region.checked_constants()
        saved: list[torch.Tensor | None] = []
        ctx.unsaved = {}  # index -> tensor kept without save_for_backward (no version check)
        for i, t in enumerate(flat):
            if (t.requires_grad or i in read) and i not in unchecked and not t.is_inference():
                saved.append(t)
                continue
            # One that requires grad is kept itself (a higher-order gradient must reach it
            # through this very tensor); others as an alias with a fresh version counter.
            # So is a plain forward-mode dual: an alias would drop its tangent, which a backward
            # with create_graph inside the dual level must see.
            keep_itself = t.requires_grad or t.is_inference() or has_tangent(t)
            alias = None if keep_itself else _unversioned_alias(t)
            if alias is None:  # kept as it is, outside the version check
                ctx.unsaved[i] = t
            saved.append(alias)
        ctx.save_for_backward(*saved)
        # Under the caller's saved-tensor hooks the inputs come back as the hooks unpack them: a
        # digest of them now tells the backward whether they come back with other values.
        ctx.packed = None
        if user_saved_tensors_hooks() is not None:
            ctx.packed = [i for i, t in enumerate(saved) if t is not None], digest([t for t in saved if t is not None])
        # The versions saved with the check, to name a modified input if the check fails.
        # Weakly: the context lives as long as the caller's graph (the loss keeps it), and a strong
        # reference here would keep every block's input until then, past its own backward.
        ctx.saved_versions = [(i, weakref.ref(t), t._version) for i, t in enumerate(saved) if t is not None and t is flat[i]]
        # Which inputs are duals: the jvp rule receives a zero tangent for every other
        # floating input (autograd materializes them), which must not become a dual.
        # Without a forward-mode level (torch.func.jvp's included) now, the jvp rule is
        # never called for this node: nothing to save for it.
        if forward_ad_level() >= 0:
            ctx.save_for_forward(*flat)
            ctx.with_tangent = tuple(map(has_tangent, flat))
        else:
            ctx.with_tangent = None
        top = peek_interpreter_stack()
        ctx.level = 0 if top is None else top.level()
        # Outputs the forward run found constant depend on no input that requires grad: constant for
        # reverse mode. Applied at a forward-mode level (a jvp level, a plain dual level), an output
        # may still depend on an input that carries a tangent (jvp(grad(f)) w.r.t. some inputs only):
        # marked non-differentiable there, its tangent would be dropped.
        forward_here = forward_ad_level() >= 0 or (top is not None and top.key() == TransformType.Jvp)
        constant = set() if forward_here else region.constant_outputs()
        ctx.output_differentiable = [has_gradient_dtype(o) and i not in constant for i, o in enumerate(output)]
        non_diff = [o for o, d in zip(output, ctx.output_differentiable) if not d]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        # Outputs no gradient reaches (the caller dropped them) come to the backward as None, and
        # the backward drops them: an input only they depend on gets None, as without remat, not a
        # zero (on which an optimizer's weight decay and moments would move it). Not for a region
        # with a vjp of its own (a checkpointed loop, batched or not, reversed along its schedule),
        # which takes every cotangent (zeros for the dropped ones), unless outputs escaped.
        if type(region).own_vjp is Region.own_vjp or region.escaped_outputs():
            ctx.set_materialize_grads(False)
        # Outputs the caller gets as separate tensors over one intermediate's memory (no views
        # rebuilt: see _aliasing.watch_shared_memory): the backward refuses a write into it.
        ctx.watches = (
            ()
            if region.outputs_share_no_input_storage()
            else _aliasing.watch_shared_memory(flat, output, ctx.output_differentiable)
        )

    @staticmethod
    @eager_under_compile
    def backward(ctx: Any, *cotangents: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        needs = ctx.needs_input_grad[1:]
        primals = _saved_primals(ctx)
        region: Region = ctx.region
        if ctx.watches and _aliasing.written(ctx.watches):
            raise CheckpointError(
                f"remat({region.name}): the caller wrote in place into an output that shares memory with "
                "another output or with an input of the call (views of one tensor, as in h = ...; return h.t(), "
                "h[0], or return x[0]). Under torch.func.vmap with reverse mode at or around it "
                "(torch.func.hessian, vmap(grad(f)), grad(vmap(f)), vmap(f) then .backward()) remat returns such "
                "outputs as separate tensors, not views, and under any torch.func transform so it does a tensor "
                "the function wrote into a list or dict it was passed that shares memory with one it returned "
                "(outs.append(h[1:]); return h): the write reaches the values of the others (and of the "
                "input) but not their gradients, which would be wrong. Write into a clone (out = out.clone() "
                "before the update), or make the update inside the remat'd function."
            )
        if ctx.packed is not None:
            positions, packed = ctx.packed
            if differing_digests(packed, digest([primals[i] for i in positions])):
                region.note_inputs_changed_by_hooks()
        if any(c is None for c in cotangents):  # (materialize_grads off: outputs no gradient reached)
            keep = [i for i, c in enumerate(cotangents) if c is not None]
            region, cotangents = _SomeOutputs(region, keep), tuple(cotangents[i] for i in keep)
            if not keep:
                needs = (False,) * len(needs)
        if not any(needs):
            return (None,) * (1 + len(primals))
        interpreter = _own_live_level(ctx, TransformType.Grad, primals)
        if interpreter is None:
            primals = tuple(unwrap_if_dead(p) for p in primals)
            cotangents = tuple(unwrap_if_dead(c) for c in cotangents)
            # (A dead level's, called after its transform returned, or plain autograd's: level 0.)
            grads = _vjp_here(region, primals, cotangents, needs, of_a_grad_level=ctx.level)
            if not graph_task_keeps_graph():
                ctx.region.release_kept()  # no second backward through this node: free them now
                _forget_region(ctx)
            return (None, *grads)
        level = ctx.level  # (the interpreter's: _own_live_level found it on top)
        lowered_p = tuple(unwrap_for_grad(p, level) for p in primals)
        lowered_c = tuple(unwrap_for_grad(c, level) for c in cotangents)
        with lowered(interpreter):
            grads = _vjp_here(region, lowered_p, lowered_c, needs, of_a_grad_level=level)
        ctx.region.release_kept()  # this level's backward runs once
        if not graph_task_keeps_graph():
            _forget_region(ctx)
        wrapped = [None if g is None else wrap_for_grad(g, level) for g in grads]
        if torch.is_grad_enabled():
            wrapped = _guard_same_level(region, wrapped, primals)
        return (None, *wrapped)

    @staticmethod
    def jvp(ctx: Any, _region_tangent: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        primals = _saved_primals(ctx)
        region: Region = ctx.region
        filled = tuple(torch.zeros_like(p) if t is None else t for p, t in zip(primals, tangents))
        with_tangent = tuple(
            t is not None and (ctx.with_tangent is None or ctx.with_tangent[i]) for i, t in enumerate(tangents)
        )
        interpreter = _own_live_level(ctx, TransformType.Jvp, primals)
        # Autograd calls jvp with forward-mode AD off; enclosing jvp levels must
        # still see this computation (jvp of jvp), so turn it back on. Under a level entered
        # in inference_mode, the recomputation's duals need autograd dispatched to.
        if interpreter is None:
            with autograd_included(), set_fwd_grad_enabled(True):
                out = _jvp_here(region, primals, filled, with_tangent)
        else:
            level = interpreter.level()
            lowered_p = tuple(unwrap_for_grad(p, level) for p in primals)
            lowered_t = tuple(unwrap_for_grad(t, level) for t in filled)
            with lowered(interpreter), autograd_included(), set_fwd_grad_enabled(True):
                lowered_out = _jvp_here(region, lowered_p, lowered_t, with_tangent)
            out = tuple(wrap_for_grad(t, level) for t in lowered_out)
        # Outputs marked non-differentiable (integer tensors) take no tangent.
        return tuple(t if d else None for t, d in zip(out, ctx.output_differentiable))

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], region: Region, *flat: torch.Tensor) -> tuple[Tensors, tuple[int | None, ...]]:
        batched = VmapRegion(region, in_dims[1:], info.randomness)
        batched.note_levels_below(flat)
        outs = apply(batched, flat)
        return outs, tuple(None if u else 0 for u in batched.unbatched)


class _RematAtLevel(SingleLevelFunction):  # type: ignore[misc]  # torch's private class, typed Any in _internals
    """``_RematFunction`` at one torch.func grad or jvp level (see :func:`_apply_at_level`)."""

    @staticmethod
    def forward(at: _AtLevel, *operands: torch.Tensor) -> Tensors:
        level = at.interpreter.level()
        unwrapped = tuple(unwrap_for_grad(x, level) for x in operands)
        # As functorch's rule: grad and forward-mode AD on (a single-level Function's
        # forward runs with both off), the level popped (set directly: this runs per call).
        grad_was, fwd_was = torch.is_grad_enabled(), fwd_grad_enabled()
        set_grad_enabled(True)
        set_fwd_grad_mode(True)
        try:
            with lowered(at.interpreter):
                if _nothing_records_below(unwrapped):
                    # The Function one level lower would make no node (no input requires grad
                    # there, no transform or dual below).
                    outs = _forward_alone(at.region, unwrapped)
                else:
                    outs = apply(at.region, unwrapped)
        finally:
            set_fwd_grad_mode(fwd_was)
            set_grad_enabled(grad_was)
        # An output that is an input, unwrapped, is returned as the input itself (as
        # functorch's wrap_outputs_maintaining_identity does); the others are wrapped.
        given = {id(u): x for u, x in zip(unwrapped, operands)}
        return tuple(given[id(o)] if id(o) in given else wrap_for_grad(o, level) for o in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensors) -> None:
        _RematFunction.setup_context(ctx, (inputs[0].region, *inputs[1:]), output)

    @staticmethod
    @eager_under_compile
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Disabled itself, not only through _RematFunction.backward: Dynamo, tracing a
        # torch.func.vjp's vjp_fn, inlines this frame and then takes the call below for
        # an autograd.Function's backward on its own fake context (an AssertionError).
        return _RematFunction.backward(ctx, *grads)  # (None for the _AtLevel, *input grads)

    @staticmethod
    def jvp(ctx: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return _RematFunction.jvp(ctx, *tangents)


def _reaches_a_script_module(region: Region) -> bool:
    """Does the function of ``region`` (or of the region it derives from) reach a TorchScript module?
    (Its optimized graph reads ``.data``, which a level's wrapper refuses: see
    ``UserRegion._reads_a_lower_levels_grad``.)"""
    while not hasattr(region, "captured") and hasattr(region, "base"):
        region = region.base
    captured = getattr(region, "captured", None)
    return captured is not None and any(isinstance(m, torch.jit.ScriptModule) for m, _ in captured.modules)


def _forward_alone(region: Region, flat: Sequence[torch.Tensor]) -> Tensors:
    """The Function's forward alone, as ``Function.apply`` runs it (grad and forward-mode AD
    off), without its setup_context: where nothing would record its node."""
    grad_was, fwd_was = torch.is_grad_enabled(), fwd_grad_enabled()
    set_grad_enabled(False)  # (no_grad and set_fwd_grad_enabled, without their Python objects)
    set_fwd_grad_mode(False)
    try:
        return _RematFunction.forward(region, *flat)
    finally:
        set_fwd_grad_mode(fwd_was)
        set_grad_enabled(grad_was)


def _nothing_records_below(flat: Tensors) -> bool:
    """Plain autograd, forward-mode AD off and no input requiring grad: a Function here records nothing."""
    return (
        not transforms_active()
        and forward_ad_level() < 0
        and not any(t.requires_grad for t in flat)
        and not has_torch_function(flat)
    )


def _forget_region(ctx: Any) -> None:
    """Drop what the context holds beyond its saved tensors, once its only backward has run.

    The context lives as long as the caller's graph (the loss keeps it), through the rest of
    the backward pass and after it; its saved tensors are freed by autograd after this node's
    backward, but the region (the function, the tensors it reaches through its closure or a
    partial, snapshots) and the inputs kept outside ``save_for_backward`` would stay alive
    until then, where ``torch.utils.checkpoint`` frees them with its saved tensors. A second
    backward through this node fails on the freed saved tensors before reaching either.
    """
    ctx.region = None
    ctx.unsaved = {}


def forget_nested_regions(contexts: Sequence[weakref.ref[Any]]) -> None:
    """Forget the regions of the nodes a forward run recorded where its caller keeps no graph.

    Under a torch.func transform no node made inside a forward run is ever differentiated:
    those at the run's own levels go with them, and those below them (its grad mode is the
    caller's, inside the enclosing Function's forward) are dropped once that Function's node
    takes the outputs, which carry them until then. A nested region's node holds the region,
    and so the function and the tensors of the enclosing run it closes over: dropped here,
    they do not look like tensors kept outside the enclosing call (see ``note_nested_node``).
    A backward through such a node, which the transforms never take, would raise.
    """
    for r in contexts:
        ctx = r()
        if ctx is not None:
            _forget_region(ctx)


def _saved_primals(ctx: Any) -> Tensors:
    try:
        saved = ctx.saved_tensors
        if ctx.region is None:  # forgotten after its only backward (_forget_region), with nothing saved to fail on
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved tensors after "
                "they have already been freed). Specify retain_graph=True if you need to backward through "
                "the graph a second time."
            )
    except RuntimeError as e:
        if "modified by an inplace operation" not in str(e):
            raise
        region: Region = ctx.region
        alive = [(i, ref(), v) for i, ref, v in ctx.saved_versions]
        changed = [region.describe_input(i, t) for i, t, v in alive if t is not None and _version(t) != v]
        raise CheckpointError(
            f"remat({region.name}): {', '.join(changed) if changed else 'an input of the remat call'} was "
            "modified in place between the forward and the backward pass (an optimizer step, merging adapter "
            "weights, a copy_ into it); the recomputation would start from the modified "
            "values and the gradient would be wrong. Modify a copy (x = x.clone() before the update), or do "
            "the update after the backward pass."
        ) from e
    if not ctx.unsaved:
        return cast(Tensors, saved)
    return tuple(ctx.unsaved.get(i, t) for i, t in enumerate(saved))


def _unversioned_alias(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s data under a new tensor with its own version counter (``None`` where that cannot be)."""
    if type(t) not in PLAIN_TENSORS or t.is_sparse or t.device.type == "meta":
        return t if not t.requires_grad else None
    try:
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
        )
    except (RuntimeError, NotImplementedError, TypeError):  # functorch wrappers, exotic layouts
        return None


def _as_view_of(base: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out`` as a view of the input ``base`` it shares storage with; with no such input, as a
    tensor of its own."""
    if base is None:
        # A view of the run's own intermediate (torch.func.vmap and jvp return views of what they
        # unwrap; fn may return lin(x).t()): autograd would take it for a view made inside the
        # Function and refuse the caller's in-place update of it, which without remat is allowed.
        # The output is its data under a tensor of its own (detach() makes an alias that is no
        # view). Outputs viewing one intermediate together become such aliases too: a write
        # through one that changes another is refused by the backward (setup_context watches
        # their memory: _aliasing.watch_shared_memory); one that changes no other is right as it is.
        return out.detach() if out._is_view() else out
    if base.dtype != out.dtype or out.is_conj() or out.is_neg():
        # A view with another dtype (x.view(torch.int64), .real), or a lazy conjugate or
        # negative view, which as_strided would not keep: a copy.
        return out.clone()
    return base.as_strided(out.size(), out.stride(), out.storage_offset())


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # some wrapper tensors have no version counter
        return None


# -------------------------------------------------- guard against same-level reuse


def _guard_same_level(region: Region, grads: list[Any], primals: Tensors) -> list[Any]:
    """Attach a node that raises if these gradients are differentiated at their own level."""
    present = [g for g in grads if g is not None]
    anchors = [p for p in primals if p.requires_grad]
    if not present or not anchors:
        return grads
    level = maybe_get_level(anchors[0])
    allowed = single_level_function_allowed()
    set_single_level_function_allowed(True)  # enable_single_level_autograd_function, without its generator
    try:
        guarded = iter(_SameLevelGuard.apply(region.name, level, len(present), *present, *anchors))
    finally:
        set_single_level_function_allowed(allowed)
    return [None if g is None else next(guarded) for g in grads]


class _SameLevelGuard(SingleLevelFunction):  # type: ignore[misc]  # torch's private class, typed Any in _internals
    @staticmethod
    def forward(name: str, level: int, n: int, *tensors: torch.Tensor) -> Tensors:
        # Fresh wrappers of the same values: new tensors for autograd, no copy.
        return tuple(wrap_for_grad(unwrap_for_grad(t, level), level) for t in tensors[:n])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.name = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise CheckpointError(
            f"remat({ctx.name}): a gradient computed by torch.autograd.grad(..., create_graph=True) "
            "inside a torch.func transform is being differentiated again at the same transform "
            "level. remat computes that gradient one level lower to save memory, so it cannot be "
            "differentiated at its own level. Nest torch.func transforms instead (for example "
            "torch.func.grad(torch.func.grad(f))), or use torch.autograd.grad(create_graph=True) "
            "outside torch.func: remat supports both."
        )


for _function in (_RematFunction, _RematAtLevel, _SameLevelGuard):
    bind_forward_once(_function)
