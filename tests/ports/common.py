import functools, itertools
import torch, torch.func as tf
from torch.testing import assert_close
import funckpt
from funckpt import remat, scan, fori_loop, while_loop, policies, checkpoint_name

D = torch.float64
def t(v, **kw): return torch.tensor(v, dtype=D, **kw)
def rng(seed=0): return torch.Generator().manual_seed(seed)
def randn(*shape, seed=0): return torch.randn(*shape, generator=rng(seed), dtype=D)

def scan_reference(f, init, xs=None, length=None, reverse=False):
    carry = init
    n = length if xs is None else torch.utils._pytree.tree_leaves(xs)[0].shape[0]
    idx = range(n - 1, -1, -1) if reverse else range(n)
    ys = [None] * n
    for i in idx:
        x = None if xs is None else torch.utils._pytree.tree_map(lambda l: l[i], xs)
        carry, y = f(carry, x)
        ys[i] = y
    if ys and ys[0] is not None:
        ys = torch.utils._pytree.tree_map(lambda *l: torch.stack([torch.as_tensor(v) for v in l]), *ys)
    else:
        ys = None
    return carry, ys

def split_lengths(lst, idx):
    """``lst`` cut into consecutive pieces of the lengths ``idx``, and the rest."""
    out, start = [], 0
    for i in idx:
        out.append(lst[start:start + i]); start += i
    out.append(lst[start:]); return out

def while_reference(cond, body, carry):
    while bool(cond(carry)):
        carry = body(carry)
    return carry

def fori_reference(lo, hi, body, carry):
    for i in range(lo, hi):
        carry = body(i, carry)
    return carry

# scan implementations: JAX's SCAN_IMPLS_WITH_FOR adapted: checkpoints variants, and remat around scan
def _remat_scan(policy):
    def impl(f, init, xs=None, length=None, **kw):
        return remat(lambda init, xs: scan(f, init, xs, length, **kw), policy=policy)(init, xs)
    return impl
SCAN_IMPLS = {
    "ckNone": scan,
    "ck1": functools.partial(scan, checkpoints=1),
    "ck2": functools.partial(scan, checkpoints=2),
    "ck3": functools.partial(scan, checkpoints=3),
    "ck100": functools.partial(scan, checkpoints=100),
    "remat_nothing": _remat_scan(policies.nothing_saveable),
    "remat_everything": _remat_scan(policies.everything_saveable),
}
WHILE_IMPLS = {
    "ckNone": while_loop,
    "ck1": functools.partial(while_loop, checkpoints=1),
    "ck2": functools.partial(while_loop, checkpoints=2),
    "remat": lambda c, b, init, **kw: remat(lambda init: while_loop(c, b, init, **kw))(init),
}
FORI_IMPLS = {
    "ckNone": fori_loop,
    "ck1": functools.partial(fori_loop, checkpoints=1),
    "ck2": functools.partial(fori_loop, checkpoints=2),
    "remat": lambda lo, hi, b, init, **kw: remat(lambda init: fori_loop(lo, hi, b, init, **kw))(init),
}

def check_grads(f, ref, args, order=2, modes=("fwd", "rev")):
    assert_close(f(*args), ref(*args))
    argnums = tuple(range(len(args)))
    if "rev" in modes:
        assert_close(tf.jacrev(f, argnums)(*args), tf.jacrev(ref, argnums)(*args))
        if order >= 2:
            assert_close(tf.jacrev(tf.jacrev(f, argnums), argnums)(*args), tf.jacrev(tf.jacrev(ref, argnums), argnums)(*args))
    if "fwd" in modes:
        assert_close(tf.jacfwd(f, argnums)(*args), tf.jacfwd(ref, argnums)(*args))
        if order >= 2:
            assert_close(tf.jacfwd(tf.jacfwd(f, argnums), argnums)(*args), tf.jacfwd(tf.jacfwd(ref, argnums), argnums)(*args))
    if "rev" in modes and "fwd" in modes and order >= 2:
        assert_close(tf.jacfwd(tf.jacrev(f, argnums), argnums)(*args), tf.jacfwd(tf.jacrev(ref, argnums), argnums)(*args))
