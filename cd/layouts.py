"""Block layouts: where a library (or a user's own model) puts the layers of a pre-norm Transformer block.

A `Layout` names, relative to the block, the paths of the layers that make the CD pairs (paper Sec. 3.2; the table
in `cd/pairs.py`). `LAYOUTS` holds the built-in ones (timm, GPT-2, transformers' ViT and Llama, MMDetection's Swin,
torchvision's ViT and Swin). A model with names of its own passes its layouts explicitly:

    from cd import Layout, find_pairs, ColinearityDecay
    mine = Layout("my model", norm1="ln_attn", norm2="ln_ffn", qkv="attention.qkv_proj", proj="attention.out",
                  fc1="ffn.up", fc2="ffn.down")
    pairs = find_pairs(model, layouts=[mine])            # only `mine` is tried
    pairs = find_pairs(model, layouts=[mine, *LAYOUTS])  # `mine` first, then the built-in ones

The layouts given are the layouts tried, in their order, and no others: a block under built-in names that the
user's list leaves out is not paired, and a refusal names exactly the layouts that were tried. There is no registry
to add to at run time; the argument is the one place that says which layouts a run uses (train.py passes none:
its runs use `LAYOUTS`, so a fork training blocks of its own names with train.py adds their Layout to that tuple).

A Layout is checked when it is made (`Layout.__post_init__`): a malformed one is refused then, naming the field,
not later as a model with no pair.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, Optional

# the layer fields, in the order a block applies them; `q_k_v` holds three paths
_REQUIRED = ("norm1", "proj", "norm2", "fc2")
_OPTIONAL = ("qkv", "fc1", "gate", "up")


def _bad_path(path: object) -> Optional[str]:
    """Why `path` is not a dotted path relative to the block ('attn.qkv', 'mlp.0'), or None when it is one."""
    if not isinstance(path, str):
        return f"is {type(path).__name__} {path!r}, not a str"
    if not path or any(not part or part != part.strip() or " " in part for part in path.split(".")):
        return f"{path!r} is not a dotted path of child names relative to the block (e.g. 'attn.qkv')"
    return None


@dataclass(frozen=True)
class Layout:
    """Where one library puts the layers of a pre-norm block: paths relative to the block.

    The pairs are the same in every layout (the table in `cd/pairs.py`); only the names differ. Whether a weight is
    stored (out, in) or (in, out) is a property of its layer, not of the layout (`cd.pairs._stored_in_out`):
    nanoGPT's GPT-2 has transformers' GPT-2 names on `nn.Linear` layers. A module is a block of the layouts whose
    top-level children (the first part of each of norm1, proj, norm2, fc2: `norm1`, `attn`, `norm2`, `mlp` for
    timm) it has, the innermost one where several modules do, and is paired by each of them whose norm1, norm2,
    proj and fc2 are all there (one per branch of a parallel block; `cd.pairs.layouts_of`).

    Attributes:
        library: named in messages and the family table.
        norm1, norm2: the norms before the attention and before the MLP (modules with a 1-D `weight`).
        proj, fc2: the attention's output projection and the MLP's output layer (W_down when gated).
        qkv: a fused [Q; K; V] projection (rows in that order, equal thirds; the V-row check refuses another
            order), or a matrix Parameter the attention holds itself ('attn.in_proj_weight'); or None.
        q_k_v: separate Q, K, V projections (tried when `qkv` is absent), or None. At least one of qkv, q_k_v.
        fc1: the MLP's input layer (plain MLP; timm's packed GluMlp), or None.
        gate, up: a gated MLP's W_gate and W_up (paired only with `gated_mlp`), both or neither. fc1 or both.
        transposed: the storage of a layer whose type and shape do not tell it (`cd.pairs._Block.storage`): True for
            (in, out). A built-in layout reads such a layer as its pair partner first (`cd.pairs._Block.functional`).
            A layout given with True that no layer of its blocks reads (all nn.Linear) is refused when paired.

    Raises:
        ValueError: a field that cannot describe a block (an empty or non-str path, neither qkv nor q_k_v, neither
            fc1 nor gate and up, one path given to two layers; norm1 and norm2 may share one, GPT-J's parallel
            block), naming the field.
    """

    library: str
    norm1: str
    norm2: str
    proj: str
    fc2: str
    qkv: Optional[str] = None
    q_k_v: Optional[tuple[str, str, str]] = None
    fc1: Optional[str] = None
    gate: Optional[str] = None
    up: Optional[str] = None
    transposed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.q_k_v, Sequence) and not isinstance(self.q_k_v, (str, bytes)):
            # a list from a config file, made hashable; a mapping or a number is refused below, not iterated
            object.__setattr__(self, "q_k_v", tuple(self.q_k_v))
        for why in self._problems():
            raise ValueError(f"cd.Layout(library={self.library!r}): {why}")

    def _problems(self) -> Iterable[str]:
        """What makes this layout unusable, field by field (the first is raised)."""
        if not isinstance(self.library, str) or not self.library.strip():
            yield f"field 'library' must be a non-empty str naming the layout in messages, got {self.library!r}"
        for name in _REQUIRED:
            why = _bad_path(getattr(self, name))
            if why:
                yield f"field {name!r} {why}; it is required"
        for name in _OPTIONAL:
            value = getattr(self, name)
            why = None if value is None else _bad_path(value)
            if why:
                yield f"field {name!r} {why}; give a path or None"
        if self.q_k_v is not None:
            if not isinstance(self.q_k_v, tuple) or len(self.q_k_v) != 3:
                yield f"field 'q_k_v' must be three paths (q, k, v) in a tuple or list, got {self.q_k_v!r}"
            for path in self.q_k_v if isinstance(self.q_k_v, tuple) else ():
                why = _bad_path(path)
                if why:
                    yield f"field 'q_k_v' holds a path that {why}"
        if self.qkv is None and self.q_k_v is None:
            yield "neither field 'qkv' (a fused [Q; K; V] layer) nor 'q_k_v' (separate q, k, v layers) is given"
        if (self.gate is None) != (self.up is None):
            yield (f"fields 'gate' and 'up' go together (a gated MLP's W_gate and W_up), got gate={self.gate!r}, "
                   f"up={self.up!r}")
        if self.fc1 is None and self.gate is None:
            yield "neither field 'fc1' (a plain MLP's input layer) nor 'gate' and 'up' (a gated MLP's) is given"
        if not isinstance(self.transposed, bool):
            yield f"field 'transposed' must be a bool, got {self.transposed!r}"
        seen: dict[str, str] = {}
        for name, path in self.paths():
            if name == "norm2" and path == self.norm1:
                # one norm before both the attention and the MLP (a parallel block as GPT-J's): its scale is the W1
                # of the qkv and the fc1 pairs alike, as norm1's is of each of q, k and v; only W2s are written
                continue
            if path in seen:
                yield f"fields {seen[path]!r} and {name!r} name the same path {path!r}; each layer has its own"
            seen.setdefault(path, name)

    def paths(self) -> list[tuple[str, str]]:
        """(field, path) of every layer path given ('q_k_v[0]' ... for separate q, k, v)."""
        out = [(name, getattr(self, name)) for name in (*_REQUIRED, *_OPTIONAL) if getattr(self, name) is not None]
        if isinstance(self.q_k_v, tuple):
            out += [(f"q_k_v[{i}]", p) for i, p in enumerate(self.q_k_v)]
        return out

    @property
    def children(self) -> tuple[str, ...]:
        """The block's top-level children that identify the layout."""
        return tuple(dict.fromkeys(p.split(".")[0] for p in (self.norm1, self.proj, self.norm2, self.fc2)))

    def describe(self) -> str:
        """'<library>' (children a, b, c), for messages."""
        return f"{self.library!r} (children {', '.join(self.children)})"


# Order matters where two layouts share their top-level children (timm's and torchvision's Swin): `layouts_of`.
LAYOUTS: tuple[Layout, ...] = (
    Layout("timm", "norm1", "norm2", proj="attn.proj", fc2="mlp.fc2", qkv="attn.qkv",
           q_k_v=("attn.q", "attn.k", "attn.v"), fc1="mlp.fc1", gate="mlp.fc1_g", up="mlp.fc1_x"),
    Layout("GPT-2 (transformers, nanoGPT)", "ln_1", "ln_2", proj="attn.c_proj", fc2="mlp.c_proj", qkv="attn.c_attn",
           fc1="mlp.c_fc", transposed=True),
    Layout("transformers ViT", "layernorm_before", "layernorm_after", proj="attention.o_proj", fc2="mlp.fc2",
           q_k_v=("attention.q_proj", "attention.k_proj", "attention.v_proj"), fc1="mlp.fc1"),
    Layout("transformers Llama", "input_layernorm", "post_attention_layernorm", proj="self_attn.o_proj",
           fc2="mlp.down_proj", q_k_v=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           gate="mlp.gate_proj", up="mlp.up_proj"),
    Layout("MMDetection Swin", "norm1", "norm2", proj="attn.w_msa.proj", fc2="ffn.layers.1",
           qkv="attn.w_msa.qkv", fc1="ffn.layers.0.0"),
    # nn.MultiheadAttention holds its fused [Q; K; V] as its own Parameter `in_proj_weight`, not a Linear's weight
    Layout("torchvision ViT", "ln_1", "ln_2", proj="self_attention.out_proj", fc2="mlp.3",
           qkv="self_attention.in_proj_weight", fc1="mlp.0"),
    # the children of timm's block (norm1, attn, norm2, mlp): told apart by the MLP's layers (`layouts_of`)
    Layout("torchvision Swin", "norm1", "norm2", proj="attn.proj", fc2="mlp.3", qkv="attn.qkv", fc1="mlp.0"),
)


def check_layouts(layouts: Any) -> tuple[Layout, ...]:
    """`layouts=` as `find_pairs`, `find_blocks`, `ColinearityDecay` and `TWEO` take it: a non-empty sequence of
    `Layout` (a mapping of Layout's fields counts as one, as a config file writes it), as a tuple.

    Raises:
        TypeError: not a sequence of them (a single Layout, a str), naming what was given.
        ValueError: an empty sequence, or a mapping that is no Layout (unknown or missing fields), naming them.
    """
    if layouts is LAYOUTS:
        return LAYOUTS
    if isinstance(layouts, (Layout, Mapping, str, bytes)) or not isinstance(layouts, Iterable):
        raise TypeError(f"layouts must be a sequence of cd.Layout, e.g. layouts=[Layout(...)] (with the built-in "
                        f"ones: [Layout(...), *cd.LAYOUTS]), got {type(layouts).__name__} {layouts!r}")
    out = []
    for k, lay in enumerate(layouts):
        if isinstance(lay, Mapping):
            names = {f.name for f in fields(Layout)}
            unknown = sorted(set(lay) - names)
            missing = sorted({"library", *_REQUIRED} - set(lay))
            if unknown or missing:
                raise ValueError(f"layouts[{k}]: a mapping of cd.Layout's fields {sorted(names)}; unknown "
                                 f"{unknown}, missing {missing}")
            lay = Layout(**lay)
        if not isinstance(lay, Layout):
            raise TypeError(f"layouts[{k}] is {type(lay).__name__} {lay!r}, not a cd.Layout")
        # cd.pairs tells the built-in layouts by their names (a guessed `transposed` there, one stated in a layout
        # given): a layout of one's own under a built-in name would have its transposed=True taken for a guess and
        # never refused unread, and its refusals would name the built-in layout
        built_in = next((b for b in LAYOUTS if b.library == lay.library), None)
        if built_in is not None and lay != built_in:
            raise ValueError(f"layouts[{k}]: cd.Layout(library={lay.library!r}) is not the built-in layout of that "
                             f"name but has its name, which tells the built-in layouts apart in CD's checks; give "
                             f"yours a name of its own (e.g. library='{lay.library} (mine)')")
        out.append(lay)
    if not out:
        raise ValueError("layouts is empty: give at least one cd.Layout (the default is cd.LAYOUTS, the built-in ones)")
    # the built-in layouts given as a copy (a list, a config file's mappings) are the default: its messages
    return LAYOUTS if tuple(out) == LAYOUTS else tuple(out)
