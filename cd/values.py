"""Check the pairs on real numbers: that the fused-qkv rows CD pairs with proj are V (one forward with V set to
zero), and that each pair's W2 reads W1's channels in their order (one forward per bit of the widest pair's channel
index, each with some channels of every pair set to zero: V's for proj, fc1's output for fc2, the norm's scale for a
composable pair).

The meta check (`cd/verify.py`) follows whole tensors: it confirms that proj reads something computed from a
fused qkv (or v), not which of its rows, nor in which order. CD pairs proj with rows [2D:3D] of qkv, the V third of
timm's [Q; K; V] layout, and row i of V with column i of proj (paper Sec. 3.2).

Which rows are V (a fused qkv only): the model runs once on real numbers with those rows of qkv's output set to
zero, and proj's input must be exactly zero. Softmax attention (with masks, windows, relative position biases,
sinks, CaiT's talking heads, which mix the heads' attention maps, not V) mixes V with weights computed from Q and K,
so its output is linear in V and zero V gives zero. A fused qkv laid out per head ([q_h k_h v_h] interleaved, as
GPT-NeoX and Bloom) or in another order (k, v, q) has rows of Q or K there and V elsewhere: proj's input is not zero
and the pair is refused. So is an attention whose proj reads more than V (MViTv2's residual pooling adds q to the
attention's output; a norm with a bias on V maps zero to its bias): one forward cannot tell this from a layout, and
the refusal names both causes.

In which order (every proj pair, of a fused qkv or of a separate v): the model runs once more for each bit b of
V's channel index (ceil(log2 width) forwards, `order_patterns`), with only the channels of V whose bit b is set set
to zero, and proj's input columns of the same numbers must be exactly zero; its other columns are not judged (a V
row of zeros in the model makes its column zero too). Attention that mixes tokens keeps each channel apart, so
those columns are zero. Heads merged in another order or channels permuted between V and proj move the zeros to
other columns: every permutation but the identity moves some channel out of some pattern (one pattern alone misses
a swap within its zeroed set or within the rest), and some of that pattern's columns stay nonzero: refused, naming
the columns on both sides. So is an
attention across channels (XCiT's XCA: each output channel a softmax-weighted sum of its head's V channels), where
proj reads W_V through a data-dependent mixing: W_O M(x) W_V is not the product of the pair CD decays.

What is set to zero, without touching any weight: the chosen V columns of each call that multiplies by the qkv (or
v) weight (the layer's own call; `F.linear` with the weight, as timm's BEiT makes it, bias included; `x @ w.t()` and
a bias added to it by hand, in place too (`y.add_(b)`, `y += b`, `torch.add(y, b, out=y)`); a product the check
cannot follow, such as an einsum, is refused, not passed), and the same entries of every parameter of the attention
module itself of V's width (a learned sink value, as the kv_bias sink variant appends to V; a query or value bias);
a torch function mode does it on the fly. The input is the meta check's example, cut to one sample, on the device of
the model's parameters: for a meta example a fixed ramp of values (floats), zeros (token ids: a valid id) or True
(boolean masks: attend), a user's real example with its values (token ids, masks). Where one sample fails (a 1-D
tensor along the batch, such as labels, is not cut with the rest), the whole example runs instead. The forwards run
under no_grad, in eval mode (every module's training flag restored after), inside `torch.random.fork_rng` (no random
stream moves), compiled submodules run eagerly, every buffer's values restored after (a forward may update one even
in eval mode): no memory beyond one sample's activations and a copy of the buffers; forward hooks on the model run
once per forward: 1 + ceil(log2) of the widest pair's channels (13 for ViT-B/16, whose fc1 has 3,072 outputs; one
fewer for a model with separate v layers only, which has no rows to tell apart; twice as many where the whole
example runs), as in the meta check.

nn.MultiheadAttention, whose forward this mode sees as one call of F.multi_head_attention_forward (the mode makes it
leave its native fast path), is followed by that call's arguments: the chosen V rows of in_proj_weight and
in_proj_bias are set to zero, and proj's input is the call's output with out_proj made the identity.

The same forwards check the other pairs, each with its own `order_patterns` (a pair of fewer channels takes part in
fewer of them). A composable pair (diag(g), W) (paper Eqs. (4)-(5): g's entry i scales W's column i): those entries
of the norm's scale g, and of its bias, are set to zero wherever a torch function is given them (F.layer_norm, an
RMSNorm's `weight * x`), and W's input columns of the same numbers must be exactly zero; a roll or permutation of
the channels between the norm and W (which the meta check takes for a move) puts the zeros elsewhere in some
pattern. An MLP pair (W_F1, W_F2) (Eq. (8)): those channels of fc1's output (of the W_up rows of a gated MLP) are
set to zero as V's are, and fc2's input columns of the same numbers must hold one value in every row (token): act(0)
through an elementwise activation, and through any map that keeps each channel apart (a per-channel scale, a
depthwise conv along the tokens with its bias). A norm over the hidden channels under a name of its own (a sub-LN),
a Linear or a permutation between fc1 and fc2 makes some of them vary with the token: refused, as W_F2 M act(W_F1 x)
is not the path of the product CD decays. Judged only where a product read two or more rows (one token has no row to
differ from). A per-channel map that treats tokens differently (LeFF's depthwise conv over the patch tokens that the
class token skips: its bias reaches some tokens only) makes those columns vary too and is refused although it keeps
the channels apart: verify=False pairs it. nn.MultiheadAttention's in_proj_weight reads the call's query.

A query row whose every key is masked is NaN whatever V is: only the finite inputs of a pair's W2 (proj, the norm's
layer, fc2) are judged, and a W2 whose input has no finite value (a NaN or inf example) is refused as unchecked. A
NaN or inf in a pair's matrix or norm scale is refused before any forward (a plain ValueError naming the parameter),
as it would make every such input NaN.

Not checked: an attention whose own parameter of V's width scales its output (a gate) passes whatever its layout,
since that parameter's entries are zeroed too. Skipped: the forwards of a model with a parameter on the `meta` device
(no values to compute with; the NaN or inf check of its materialised pairs' matrices runs all the same), and wherever
`find_pairs` runs no check (verify=False; FSDP2, which needs verify=False).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Mapping, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from .verify import UnsupportedModelError, example_input

_F = torch.nn.functional
# calls that multiply by a weight: their output's last dim holds the layer's output features
_PRODUCTS = frozenset({_F.linear, torch.addmm, torch.mm, torch.matmul, torch.bmm, torch.Tensor.matmul,
                       torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.addmm})
# calls that add a bias to a product (x @ w.t() + b): the V columns of their output are set to zero again
_ADDS = frozenset({"add", "add_", "__add__", "__radd__", "__iadd__"})
# calls that return a weight's values in another layout or dtype (x @ w.t(), F.linear(x, w.to(dtype)))
_SAME_VALUES = frozenset({"t", "T", "mT", "transpose", "permute", "to", "type_as", "float", "half", "bfloat16",
                          "contiguous", "detach", "view", "reshape"})


def _factors(func, args: tuple, kwargs: dict) -> list[Tensor]:
    """The two tensors a product multiplies, not the bias it adds: F.linear(input, weight, bias) and
    addmm(bias, mat1, mat2) by position or keyword; matmul, mm, bmm and @ take two factors only."""
    if func is _F.linear:
        found = [*args[:2], kwargs.get("input"), kwargs.get("weight")]
    elif func in (torch.addmm, torch.Tensor.addmm):
        found = [*args[1:3], kwargs.get("mat1"), kwargs.get("mat2")]
    else:
        found = [*args, *kwargs.values()]
    return [u for u in found if isinstance(u, Tensor)]


def _name(func) -> str:
    """'t' for Tensor.t, 'T' for the getter of Tensor.T (whose __get__ names no property)."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":
        return owner.__name__
    return getattr(func, "__name__", "")


def order_patterns(width: int) -> list[list[int]]:
    """The channels set to zero in each order forward: for each bit b of the channel index below ceil(log2 width),
    the channels whose bit b is set (none for one channel, which has no order). Each is neither empty nor all of
    the channels (channel 0 is in none). A W2 that reads W1's channel pi(j) at its column j passes every pattern
    (the pattern's columns read zero) only if pi is the identity: passing means that every bit set in j is set in
    pi(j), so pi(j) holds all of j's bits and, as pi maps the channels onto themselves (the counts of set bits
    sum to the same), no more: pi(j) = j. One zero/nonzero pattern alone cannot do this: a permutation that keeps
    its zeroed set (a swap within it, or within the rest) passes it."""
    return [list(_pattern(width, b)) for b in range(_planes(width))]


def _planes(width: int) -> int:
    """How many order patterns `width` channels have: ceil(log2 width), none for one channel."""
    return (width - 1).bit_length() if width > 1 else 0


@functools.lru_cache(maxsize=None)
def _pattern(width: int, plane: int) -> tuple[int, ...]:
    """Order forward `plane`'s channels of a W1 of `width` channels (those whose bit `plane` is set: runs of
    2**plane from 2**plane on, every 2**(plane + 1)): none where it has fewer patterns. Cached: every pair of a
    width, and its judge, asks for the same few."""
    if plane >= _planes(width):
        return ()
    run = 1 << plane
    return tuple(j for start in range(run, width, 2 * run) for j in range(start, min(start + run, width)))


def _zeroed(t: Tensor, entries: Optional[Sequence[int]]) -> Tensor:
    """A copy of `t` with `entries` of its flattened values (all, for None) set to zero; `t` itself unchanged."""
    if entries is None:
        return torch.zeros_like(t)
    out = t.clone(memory_format=torch.contiguous_format)  # flat order is the logical order
    out.view(-1)[torch.as_tensor(entries, dtype=torch.long, device=t.device)] = 0
    return out


class _ZeroV(TorchFunctionMode):
    """Sets the given V columns of every product with a qkv (or v) weight to zero, and the same entries of the extra
    value parameters, and records for each proj weight which columns of its input had a finite nonzero entry."""

    def __init__(self, rows: dict[int, tuple[list[int], int]], zero: dict[int, Optional[list[int]]],
                 proj: dict[int, tuple[int, int]]):
        super().__init__()
        # id(weight) -> (its output columns to zero, its output width); id(parameter) -> its entries to zero (None:
        # all); id(proj weight) -> (pair, its input width)
        self.rows, self.zero, self.proj = rows, zero, proj
        self.origin: dict[int, int] = {}  # id of a weight's moved copy (w.t(), w.to(dtype)) -> id of the weight
        self._keep: list[Tensor] = []  # holds the moved copies, so that their ids are not reused
        self._index: dict[tuple[int, torch.device], Tensor] = {}  # (id of a qkv weight, device) -> its columns
        self.zeroed: set[int] = set()  # ids of upstream weights whose product was seen, of norm scales passed
        self.products: dict[int, int] = {}  # id of a product's output with V set to zero -> id of its qkv weight
        self.nonzero: dict[int, Tensor] = {}  # pair -> the reader's input columns with a finite nonzero entry
        self.varies: dict[int, Tensor] = {}  # pair -> the reader's input columns whose finite entries differ by row
        self.rows_seen: dict[int, int] = {}  # pair -> the most rows (tokens) of the reader's input in one product
        self.finite: dict[int, bool] = {}  # pair -> the reader's input had a finite entry in some product

    def release(self) -> None:
        """Drops what only the forward needed (the moved copies and products it holds, so that their ids are not
        reused during it), keeping the findings the judges read."""
        self.origin.clear()
        self._keep.clear()
        self._index.clear()
        self.products.clear()

    def _columns(self, w: int, device: torch.device) -> Tensor:
        """The columns of qkv weight `w`'s output to zero, as an index on `device` (made once per device)."""
        key = (w, device)
        if key not in self._index:
            self._index[key] = torch.as_tensor(self.rows[w][0], dtype=torch.long, device=device)
        return self._index[key]

    def _read(self, k: int, width: int, u: Tensor, dim: int) -> None:
        """Records which columns of the reader's input `u` (channels along `dim`) hold a finite nonzero value, and
        which differ from row to row (token to token); a fully masked query row is NaN whatever V is (0 * NaN):
        only finite entries tell channels apart."""
        along = u.dim() >= -dim and u.shape[dim] == width
        if along and u.is_floating_point() and u.numel():
            values = u.movedim(dim, -1).reshape(-1, width)
            # each column's largest |entry| (amax keeps NaN and inf): when all are finite, so is every entry, and
            # the whole input's isfinite (several times a product's cost on the CPU, in every order forward) and
            # its masks are not needed
            peak = values.abs().amax(0)
            if bool(torch.isfinite(peak).all()):
                self._record(k, peak > 0, (values != values[:1]).any(0), True)
                self.rows_seen[k] = max(self.rows_seen.get(k, 0), values.shape[0])
                return
        finite = torch.isfinite(u)
        hit = (u != 0) & finite
        if along:
            cols = hit.movedim(dim, -1).reshape(-1, width).any(0)
            values, ok = u.movedim(dim, -1).reshape(-1, width), finite.movedim(dim, -1).reshape(-1, width)
            varies = ((values != values[:1]) & ok & ok[:1]).any(0)
            self.rows_seen[k] = max(self.rows_seen.get(k, 0), values.shape[0])
        else:  # channels along no dim of the reader's width: a nonzero entry counts against every column
            cols = hit.any().expand(width)
            varies = cols
        self._record(k, cols, varies, bool(finite.any()))

    def _record(self, k: int, cols: Tensor, varies: Tensor, finite: bool) -> None:
        """Adds one product's findings for pair `k`: its nonzero and varying columns, whether it had a finite entry."""
        for record, new in ((self.nonzero, cols), (self.varies, varies)):
            seen = record.get(k)
            record[k] = new if seen is None else seen | new
        self.finite[k] = self.finite.get(k, False) or finite

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        if any(id(t) in self.zero for t in tensors):
            self.zeroed.update(id(t) for t in tensors if id(t) in self.zero)
            args, kwargs = tree_map(lambda t: _zeroed(t, self.zero[id(t)]) if isinstance(t, Tensor) and
                                    id(t) in self.zero else t, (args, kwargs))
        if func is _F.multi_head_attention_forward:
            return self._attention(func, args, kwargs)
        weights = [(t, self.origin.get(id(t), id(t))) for t in tensors]
        weights = [(t, w) for t, w in weights if w in self.rows or w in self.proj]
        if _name(func) in _ADDS:  # a bias added to a product by hand: its V columns are V's too
            weights += [(t, self.products[id(t)]) for t in tensors if id(t) in self.products]
        product = func in _PRODUCTS
        for t, w in weights if product else ():
            if w in self.proj:  # the other factor is proj's input; a bias, even cast (not a Parameter), is not
                k, width = self.proj[w]
                factors = _factors(func, args, kwargs)
                at = next((i for i, u in enumerate(factors) if u is t), len(factors))
                for i, u in enumerate(factors):
                    # x @ w.t() and F.linear(x, w): channels along x's last dim; w @ x: along its dim -2
                    if u is not t:
                        self._read(k, width, u, -1 if i < at else -2)
        out = func(*args, **kwargs)
        if not isinstance(out, Tensor):
            return out
        for _, w in weights:
            if not product and _name(func) in _SAME_VALUES:  # a copy of the weight's values: followed as the weight
                self.origin[id(out)] = w
                self._keep.append(out)
            elif (product or _name(func) in _ADDS) and w in self.rows and out.dim() >= 1 and \
                    out.shape[-1] == self.rows[w][1]:
                # an in-place add (y.add_(b), y += b, torch.add(y, b, out=y)) returns a tensor the caller holds
                # and reads on, not the value returned here: its V columns are set to zero in that tensor (never in a
                # Parameter's own values: a weight is not to be changed by the check)
                if isinstance(out, nn.Parameter) or not any(out is t for t in tensors):
                    out = out.clone()  # a new tensor: a product's output may be a buffer the model keeps
                out[..., self._columns(w, out.device)] = 0
                self.zeroed.add(w)
                self.products[id(out)] = w
                self._keep.append(out)
        return out

    def _attention(self, func, args: tuple, kwargs: dict):
        """F.multi_head_attention_forward (nn.MultiheadAttention's forward), which this mode sees whole, not the
        products inside it: the given V rows of its fused in_proj_weight (and in_proj_bias) are set to zero as a
        product's V columns are, and proj's input is its output with out_proj made the identity (no bias)."""
        a = inspect.signature(func).bind(*args, **kwargs).arguments
        w = a["in_proj_weight"]
        if w is not None and id(w) in self.rows:
            for key in ("in_proj_weight", "in_proj_bias"):
                if a.get(key) is not None:
                    a[key] = a[key].clone()  # a new tensor: the model's Parameter is not to be changed
                    a[key][self._columns(id(w), a[key].device)] = 0
            self.zeroed.add(id(w))
        reads = self.proj.get(id(w)) if w is not None else None
        if reads is not None:  # in_proj_weight paired with a norm's scale: it reads the query (channels last)
            self._read(*reads, a["query"], -1)
        found = self.proj.get(id(a["out_proj_weight"]))
        if found is not None:
            out_w = a["out_proj_weight"]
            identity = torch.eye(out_w.shape[1], dtype=out_w.dtype, device=out_w.device)
            heads = func(**{**a, "out_proj_weight": identity, "out_proj_bias": None})[0]  # (L, N, E)
            self._read(*found, heads, -1)
        return func(**a)


def probe_input(example, device: torch.device, cut: bool = True):
    """The forward's input, from the meta check's example, on `device` and, with `cut`, cut to one sample (the first
    along dim 0 of every tensor of two or more dims): a real tensor's values kept (a user's token ids and masks), a
    meta one made real (a ramp in [-1, 1] for floats, zeros for token ids: a valid id, True for a boolean mask)."""
    def real(x):
        if not isinstance(x, Tensor):
            return x
        if cut and x.dim() >= 2:
            x = x[:1]
        if x.device.type != "meta":
            return x.to(device)
        if x.is_floating_point():
            return torch.linspace(-1.0, 1.0, x.numel(), device=device).reshape(x.shape).to(x.dtype)
        # True for a boolean mask (SDPA's and timm's "attend"): all False would mask every key of every query
        return (torch.ones if x.dtype == torch.bool else torch.zeros)(x.shape, dtype=x.dtype, device=device)
    if isinstance(example, Mapping):
        return (), {k: real(v) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        return tuple(real(v) for v in example), {}
    return (real(example),), {}


def _rng_forks(root: nn.Module) -> contextlib.ExitStack:
    """fork_rng for the CPU and every accelerator the model's parameters lie on (no random stream moves)."""
    stack = contextlib.ExitStack()
    by_type: dict[str, set[int]] = {}
    for p in root.parameters():
        if p.device.type != "cpu":
            by_type.setdefault(p.device.type, set()).add(p.device.index or 0)
    stack.enter_context(torch.random.fork_rng(devices=[]))
    for kind, indices in by_type.items():
        stack.enter_context(torch.random.fork_rng(devices=sorted(indices), device_type=kind))
    return stack


def _eager() -> contextlib.AbstractContextManager:
    """Compiled submodules run eagerly (no compilation for one probe forward); torch < 2.6 has no stance."""
    stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def _width(p) -> int:
    """The channels W1 gives W2 in pair `p`: the norm's scale's, or the rows of W1 the pair uses."""
    if p.diagonal:
        return p.upstream.shape[0]
    start, stop = p.upstream_rows or (0, p.upstream.shape[1] if p.upstream_transposed else p.upstream.shape[0])
    return stop - start


def _plan(root: nn.Module, pairs: Sequence, checked: Sequence[int], channels) -> tuple[dict, dict, dict]:
    """The settings of one `_ZeroV` forward: for each checked functional pair, the columns of its upstream weight's
    output to set to zero, `channels(width)` of W1's rows (relative to the first row the pair uses), and for a proj
    pair the same entries of the attention's own parameters of V's width; for each composable pair, the same
    entries of the norm's scale and bias; for each pair, its downstream weight and input width (the reader)."""
    rows: dict[int, tuple[list[int], int]] = {}
    zero: dict[int, Optional[list[int]]] = {}
    readers: dict[int, tuple[int, int]] = {}
    for k in checked:
        p = pairs[k]
        if p.diagonal:  # (diag(g), W): g's entries, and the norm's bias's, set to zero: W's columns read zero
            chosen = channels(p.upstream.shape[0])
            zero[id(p.upstream)] = chosen
            bias = getattr(root.get_submodule(p.upstream_name.rpartition(".")[0]), "bias", None)
            if isinstance(bias, Tensor) and bias.shape == p.upstream.shape:
                zero[id(bias)] = chosen
            readers[id(p.downstream)] = (k, p.upstream.shape[0])
            continue
        total = p.upstream.shape[1] if p.upstream_transposed else p.upstream.shape[0]
        start, stop = p.upstream_rows or (0, total)
        chosen = channels(stop - start)
        rows[id(p.upstream)] = ([start + j for j in chosen], total)
        readers[id(p.downstream)] = (k, stop - start)
        if p.role != "proj":
            continue
        owner, _, attr = p.upstream_name.rpartition(".")
        # the attention: the parent of a qkv layer (attn.qkv.weight), or the module holding the fused weight itself
        # (nn.MultiheadAttention's in_proj_weight)
        attn = root.get_submodule(owner.rpartition(".")[0] if attr == "weight" else owner)
        # the attention's own parameters of V's width (a learned sink value, a value bias) enter with V
        zero.update({id(t): chosen for t in attn._parameters.values() if t is not None and t.numel() == stop - start})
    return rows, zero, readers


@torch.no_grad()
def refuse_non_finite(pairs: Sequence) -> None:
    """Refuse pairs whose matrices or norm scales hold a NaN or inf, naming the first such parameter in model order.

    Why: the checks below run the model on real numbers, and one NaN weight makes every W2's input NaN, which they
    would report as an example or masks without a finite value; CD's update would spread it to the whole matrix.
    A tensor on the `meta` device has no values and is passed over; the materialised ones of a model partly on meta
    are checked.

    Raises:
        ValueError: naming the parameter, how many of its entries are not finite, the first one's index, and the fix.
    """
    params: dict[int, tuple[str, Tensor]] = {}
    for p in pairs:  # model order, W1 (the norm's scale, or fc1) before W2; a tensor once however many pairs hold it
        params.setdefault(id(p.upstream), (p.upstream_name, p.upstream))
        params.setdefault(id(p.downstream), (p.name, p.downstream))
    for name, t in params.values():
        if t.is_meta:
            continue
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            first = [int(i) for i in bad.nonzero()[0]]
            raise ValueError(f"the model's parameter {name} holds {int(bad.sum())} NaN or inf value(s) (of "
                             f"{t.numel()}; the first at {first}), which CD's checks and update would spread to every "
                             "activation and the whole matrix: load or initialise finite weights first (a checkpoint "
                             "from before a divergence)")


def check_channel_order(root: nn.Module, pairs: Sequence, block_types: dict[str, str],
                        example: Optional[object] = None) -> None:
    """Check every pair on real numbers: that a fused qkv's claimed rows are V, and that each pair's W2 reads W1's
    channels in their order (see the module docstring).

    Args:
        root: the unwrapped model. pairs: its `Pair`s. block_types: block name -> class name.
        example: as `verify_pairs` takes it; default `example_input(root)`.

    Raises:
        ValueError: a pair's matrix or norm scale holds a NaN or inf (`refuse_non_finite`).
        UnsupportedModelError: naming the first block whose claimed V rows are not V, whose W2 reads W1's channels
            in another order or mixed, or whose weights the forward does not multiply by (or whose norm scale it
            does not pass) in a way the check follows (so that their channels cannot be told apart).
    """
    checked = list(range(len(pairs)))
    fused = [k for k, p in enumerate(pairs) if p.role == "proj" and p.upstream_rows is not None]
    tensors = [*root.parameters(), *root.buffers()]
    if not checked or not tensors:
        return
    # before the forwards: a NaN weight would read as an example without finite values; and on the materialised
    # pairs of a model partly on meta, whose forward cannot run (a pair materialised with NaNs is named all the same)
    refuse_non_finite(pairs)
    if any(t.device.type == "meta" for t in tensors):
        return
    # first V whole (for a fused qkv only: separate v is V whole by the meta check), then one order forward per bit
    # of the widest pair's channel index, each pair with its own pattern of that bit while it has one (every pair in
    # the first, so that a weight the forward does not use in a way the check follows is refused even at width 1)
    widths = [_width(p) for p in pairs]
    planes = [[k for k in checked if plane < max(1, _planes(widths[k]))]
              for plane in range(max(1, *(_planes(w) for w in widths)))]
    plans = ([_plan(root, pairs, fused, lambda n: list(range(n)))] if fused else []) + \
        [_plan(root, pairs, ks, lambda n, plane=plane: _pattern(n, plane)) for plane, ks in enumerate(planes)]
    example = example_input(root) if example is None else example
    inputs = [probe_input(example, tensors[0].device)]
    whole = probe_input(example, tensors[0].device, cut=False)
    if [t.shape for t in tree_flatten(whole)[0] if isinstance(t, Tensor)] != \
            [t.shape for t in tree_flatten(inputs[0])[0] if isinstance(t, Tensor)]:
        # the whole example, if one sample fails: a 1-D tensor along the batch (labels) is not cut with the rest
        inputs.append(whole)
    training = {m: m.training for m in root.modules()}
    # a forward may update buffers even in eval mode (an activation probe's running max, a cache): kept to restore
    buffers = [(m, name, b, b.clone()) for m in root.modules() for name, b in m._buffers.items() if b is not None]
    try:
        with _rng_forks(root), torch.no_grad(), _eager():
            for m in training:  # not root.eval(): a train() override may do more (MMDetection's freezes stages)
                m.training = False
            for i, (args, kwargs) in enumerate(inputs):
                modes = [_ZeroV(*plan) for plan in plans]
                try:
                    for mode in modes:
                        with mode:
                            root(*args, **kwargs)
                        mode.release()  # one forward's tensors at a time, however many forwards run
                    break
                except UnsupportedModelError:
                    raise
                except Exception:
                    if i == len(inputs) - 1:
                        raise
    except UnsupportedModelError:
        raise
    except Exception as e:
        raise UnsupportedModelError(
            f"cannot check which rows of the qkv (or v) layers of {type(root).__name__} are V, nor in which order "
            f"the pairs' layers read each other's channels: its "
            f"forward pass on {tensors[0].device} failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); pass example_input= of the right shape, or verify=False "
            "to trust the structure alone") from e
    finally:
        for m, flag in training.items():
            m.training = flag
        with torch.no_grad():
            for m, name, b, saved in buffers:
                m._buffers[name] = b  # the same tensor object (an optimizer or hook may hold it), its values back
                b.set_(saved) if b.shape != saved.shape else b.copy_(saved)
    order_modes = modes[len(plans) - len(planes):]
    for k in checked:
        if k in fused:
            _judge_rows(pairs[k], k, modes[0], block_types)
        judge = _judge_order if pairs[k].role == "proj" else \
            _judge_norm_order if pairs[k].diagonal else _judge_mlp_order
        for plane, (ks, mode) in enumerate(zip(planes, order_modes)):
            if k in ks:
                judge(pairs[k], k, mode, plane, block_types)


def _unread(p, k: int, mode: _ZeroV, what: str, fix: str, where: str) -> None:
    """Refuses a pair whose qkv (or v) or proj weight the forward did not multiply by in a way `mode` follows."""
    unread = [name for name, seen in ((p.upstream_name, id(p.upstream) in mode.zeroed),
                                      (p.name, k in mode.nonzero)) if not seen]
    if unread:
        raise UnsupportedModelError(
            f"{where}: its forward pass {'passes' if unread[0] == p.upstream_name and p.diagonal else 'multiplies by'}"
            f" {unread[0]} in a way CD does not follow (it follows F.linear, matmul and addmm with the weight or its "
            f"transpose, and any torch function given the norm's scale), so it cannot tell {what}. {fix}")


def _judge_rows(p, k: int, mode: _ZeroV, block_types: dict[str, str]) -> None:
    """With the claimed V rows of a fused qkv set to zero, proj's input must be zero."""
    where = f"block '{p.block}' ({block_types.get(p.block, '?')}) is not supported by CD"
    qkv, out = p.upstream_name.removesuffix(".weight"), p.name.removesuffix(".weight")
    rows = f"rows {p.upstream_rows[0]}:{p.upstream_rows[1]}"
    fix = (f"CD expects the rows of a fused qkv as [Q; K; V] in equal thirds (timm's layout). Give the attention "
           "separate q, k, v Linear layers (attn.q, attn.k, attn.v), or order qkv's rows [Q; K; V], or pass "
           f"verify=False to pair {out} with {rows} unchecked")
    _unread(p, k, mode, f"which rows of {qkv} are V", fix, where)
    if not mode.finite[k]:
        raise UnsupportedModelError(
            f"cannot check which rows of {qkv} are V: with {rows} of its "
            f"output set to zero, the input of {out} has no finite value (NaN or inf: every query row masked?). "
            "Pass example_input= with the masks of a real batch, or verify=False to trust the structure alone")
    if bool(mode.nonzero[k].any()):
        # what was measured has two causes the check cannot tell apart (MViTv2 splits qkv as [Q; K; V] and adds
        # q after the attention): the message names both, and asserts neither
        raise UnsupportedModelError(
            f"{where}: with {rows} of {qkv}'s output set to zero, the input of {out} is not zero: something other "
            f"than V reaches {out} (a term added after the attention, as MViTv2's residual pooling x + q; a norm "
            f"with a bias, or a pool, on V), or {qkv} is laid out otherwise than [Q; K; V] in equal thirds (per "
            f"head [q_h k_h v_h], as GPT-NeoX and Bloom, or in another order). CD decays W_O W_V, the product of "
            f"{out} with V's rows, which is {out}'s path only where its input is V mixed by attention alone (paper "
            f"Sec. 3.2). If the layout is the cause, order qkv's rows [Q; K; V] or give the attention separate q, "
            f"k, v Linear layers (attn.q, attn.k, attn.v); otherwise pass verify=False to pair {out} with {rows} "
            f"unchecked (beyond the paper: CD then decays that product although {out} reads more than V)")


def _few(columns: Sequence[int]) -> str:
    """Up to eight channel numbers, and how many more there are."""
    shown = ", ".join(str(j) for j in columns[:8])
    return shown if len(columns) <= 8 else f"{shown} and {len(columns) - 8} more"


def _judge_order(p, k: int, mode: _ZeroV, plane: int, block_types: dict[str, str]) -> None:
    """With only V's channels of order pattern `plane` set to zero, proj's input columns of the same numbers must be
    zero (paper Sec. 3.2 pairs row i of W_V with column i of W_O); the other columns are not judged (a V row of
    zeros in the model would make its column zero too)."""
    width = len(mode.nonzero[k]) if k in mode.nonzero else 0
    chosen = _pattern(width, plane)
    where = f"block '{p.block}' ({block_types.get(p.block, '?')}) is not supported by CD"
    v, out = p.upstream_name.removesuffix(".weight"), p.name.removesuffix(".weight")
    rows = f"rows {p.upstream_rows[0]}:{p.upstream_rows[1]} of {v}" if p.upstream_rows else f"the rows of {v}"
    fix = (f"Merge the heads back in V's channel order (timm: x.transpose(1, 2).reshape(B, N, C)), or pass "
           f"verify=False to pair {out} with {rows} unchecked")
    _unread(p, k, mode, f"in which order {out} reads V's channels", fix, where)
    if not chosen:  # one channel: no order to get wrong
        return
    if not mode.finite[k]:
        raise UnsupportedModelError(
            f"cannot check in which order {out} reads V's channels: with channels {_few(chosen)} of V ({rows}) set "
            f"to zero, the input of {out} has no finite value (NaN or inf: every query row masked?). Pass "
            "example_input= with the masks of a real batch, or verify=False to trust the structure alone")
    nonzero = mode.nonzero[k].tolist()
    bad = [j for j in chosen if nonzero[j]]
    if not bad:
        return
    chosen_set = set(chosen)
    moved = [j for j in range(width) if j not in chosen_set and not nonzero[j]]
    said = (f"with channels {_few(chosen)} of V ({rows}'s output) set to zero, columns {_few(bad)} of {out}'s "
            f"input are not zero")
    if moved:
        raise UnsupportedModelError(
            f"{where}: {out} reads V's channels in another order (heads merged in another order, or channels "
            f"permuted on the way): {said}, and its columns {_few(moved)}, of channels not set to zero, are zero "
            f"instead. CD pairs row i of V with column i of {out} (paper Sec. 3.2). {fix}")
    raise UnsupportedModelError(
        f"{where}: its attention mixes V's channels on the way to {out} (attention across channels, as XCiT's XCA, "
        f"where each output channel is a weighted sum of its head's V channels): {said}, and no other column is "
        f"zero instead. {out} reads W_V through a data-dependent mixing M(x), and W_O M(x) W_V is not the product "
        f"of the pair (W_V, W_O) that CD decays (paper Sec. 3.2). Pass verify=False to pair {out} with {rows} "
        "unchecked (beyond the paper)")


def _start_order(p, k: int, mode: _ZeroV, plane: int, block_types: dict[str, str], width: int, source: str,
                 w1: str):
    """(the chosen channels, the refusal's opening, its fix, W2's layer) for a pair whose W2 reads `source`'s
    channels, after refusing a weight the forward did not use in a way the check follows and a W2 whose input had no
    finite value (nothing tells the channels apart: unchecked, as `_judge_order` refuses it); None when there is
    nothing to judge (one channel has no order)."""
    where = f"block '{p.block}' ({block_types.get(p.block, '?')}) is not supported by CD"
    out = p.name.removesuffix(".weight")
    fix = f"Pass verify=False to pair {out} with {w1} unchecked"
    _unread(p, k, mode, f"in which order {out} reads {source}'s channels", fix, where)
    chosen = _pattern(width, plane)
    if not chosen:
        return None
    if not mode.finite[k]:  # a NaN or inf example (or one the model turns into such values) would pass unjudged
        raise UnsupportedModelError(
            f"cannot check in which order {out} reads {source}'s channels: with channels {_few(chosen)} of "
            f"{source} set to zero, the input of {out} has no finite value (NaN or inf: an example_input of NaN or "
            "inf, or masks that leave no finite value?). Pass example_input= of finite values (a real batch), or "
            "verify=False to trust the structure alone")
    return chosen, where, fix, out


def _judge_norm_order(p, k: int, mode: _ZeroV, plane: int, block_types: dict[str, str]) -> None:
    """(diag(g), W), paper Eqs. (4)-(5): with order pattern `plane` of the norm's scale g (and of its bias) set to
    zero, W's input columns of the same numbers must be zero: W reads the norm's channel i at its column i, as the
    product W diag(g) that CD decays takes it (a roll or permutation of the channels between them moves the zeros
    in some pattern)."""
    norm = p.upstream_name.removesuffix(".weight")
    start = _start_order(p, k, mode, plane, block_types, p.upstream.shape[0], norm, f"diag({p.upstream_name})")
    if start is None:
        return
    chosen, where, fix, out = start
    nonzero = mode.nonzero[k].tolist()  # one list, not a tensor indexed per channel
    bad = [j for j in chosen if nonzero[j]]
    if bad:
        raise UnsupportedModelError(
            f"{where}: with channels {_few(chosen)} of {norm}'s scale (and bias) set to zero, columns {_few(bad)} "
            f"of {out}'s input are not zero, so {out} does not read {norm}'s channel i at its column i (channels "
            f"permuted, rolled or mixed between them). CD decays W diag(g) with g's entry i scaling W's column i "
            f"(paper Eqs. (4)-(5)). {fix} (beyond the paper)")


def _judge_mlp_order(p, k: int, mode: _ZeroV, plane: int, block_types: dict[str, str]) -> None:
    """(W_F1, W_F2), paper Eqs. (7)-(8): with order pattern `plane` of fc1's output set to zero, fc2's input columns
    of the same numbers must be the same in every row (token): act(0) through an elementwise activation (and any
    per-channel map: a depthwise conv, a per-channel scale). A norm over the hidden channels, a Linear or a channel
    permutation between them makes some of those columns vary with the token in some pattern: W_F2 M W_F1 is then
    not the product of the pair. Judged where some product read two or more rows."""
    up = p.upstream_name.removesuffix(".weight")
    rows = f"rows {p.upstream_rows[0]}:{p.upstream_rows[1]} of {up}" if p.upstream_rows else f"the rows of {up}"
    width = len(mode.nonzero[k]) if k in mode.nonzero else 0
    start = _start_order(p, k, mode, plane, block_types, width, up, rows)
    if start is None or mode.rows_seen.get(k, 0) < 2:
        return
    chosen, where, fix, out = start
    varies = mode.varies[k].tolist()  # one list, not a tensor indexed per channel
    bad = [j for j in chosen if varies[j]]
    if bad:
        raise UnsupportedModelError(
            f"{where}: with channels {_few(chosen)} of {up}'s output set to zero, columns {_few(bad)} of {out}'s "
            f"input still vary from token to token, so {out} does not read {up}'s channel i at its column i through "
            f"an elementwise activation (a norm over the hidden channels, a Linear or a channel permutation between "
            f"them). CD decays W_F2 W_F1 (paper Eq. (8)), which is not that path. {fix} (beyond the paper)")
