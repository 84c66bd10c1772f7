"""Load weights from a local file into a timm model (.pth/.pt/.safetensors, ours or official ones).

Reuses timm: `load_state_dict` reads the file (the `model`, `state_dict` or raw layouts, the raw weights where an
EMA copy is beside them, which the log names; `module.` prefixes stripped; DeepSpeed's `module` layout, in which the
official EVA weights come, is unwrapped here) and the model family's
`checkpoint_filter_fn` remaps official DeiT/ViT/Swin key layouts and resizes position embeddings and Swin's relative
position bias tables (a resized table is logged with both grids or windows and its cause, another window size or a
window timm shrank to the feature map of a smaller img_size, and named in the model's `pretrained_resampled`, which
evaluate.py records beside its result; a table is compared in the layout the conversion gives it, e.g. DINOv2's with
registers without its class entry). Tensors the conversion leaves out (a layer the model lacks, such as an old in21k
ViT's pre-logits layer; not the buffers the model rebuilds) are named: logged when fine-tuning, refused when strict
(models/dropped_keys.py).
On top of that: `_orig_mod.` prefixes (compiled models) are stripped, a classifier of another shape (any of its
keys: another number of outputs or input width) is dropped as a whole, weight and bias, when fine-tuning (unless
strict, where the error names what differs; the classifier keys drawn anew are named in the model's
`pretrained_new_classifier`, which engine/start_weights.py reads), the parameters of an attention-sink variant
(`attn.sink_*`) may be missing when weights of the plain model are loaded into a variant (they keep their zero init;
unless strict; where sink parameters alone differ, the error names the file's model.attn variant and the setting
that loads it, models/sink_weights.py),
and any other missing or unexpected key is an error that names the keys (or, where the file's keys are the
model's under one prefix, the attribute a wrapper such as a Lightning module held it under, that prefix, with how to
save the file without it), so a checkpoint of another model fails early (a Swin of more blocks or stages too, whose
conversion by timm fails on an attention the model lacks); a file
of the other kind of model (a GPT's weights given to a ViT, or the reverse) is named as such, with the weights to
give instead. A file that records its architecture (nanoGPT's `model_args`, transformers' config.json beside it) is
checked against the model by the family's `check_recorded_settings`. Integer (or bool) tensors where the model's
are floating point, such as a quantized model's codes saved without their scales, are refused, not cast to weights
(models/weight_dtypes.py); float16 / bfloat16 weights load. A file torch's weights-only reader refuses (a
safetensors file under another name, Python objects beside the tensors, a numpy .npz archive such as JAX ViT weights)
is named with what to do about it, and a file of no weights format at all (a YAML or JSON file, a numpy .npy array)
as such.
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
import re
import sys
import zipfile

import torch
import torch.nn as nn
from timm.models import clean_state_dict, load_state_dict

from .attention_sinks import SINK_PARAMS
from .dropped_keys import dropped_by_filter, rebuilt_buffers
from .gpt import GPT
from .modules import nonfinite_tensors
from .sink_weights import recorded_attn, sink_mismatch
from .weight_dtypes import codes_refusal

log = logging.getLogger(__name__)


class ModelError(ValueError):
    """An unknown model name, bad constructor argument or incompatible weights file."""


class ConversionError(ModelError):
    """timm's conversion of a weights file to the model (its `checkpoint_filter_fn`) raised: a file of another token
    layout, or, for a model built on the meta device (train.py check_start_weights), an operation the conversion
    cannot make on it."""


def check_weights_file(path: str) -> None:
    """Refuse a model.pretrained `path` that is no file (not there, a folder, a link to nothing): load_pretrained's
    first check, which evaluate.py asks before it makes its --out folder."""
    if not os.path.isfile(path):
        # both callers read model.pretrained: name the key, and what it takes
        raise ModelError(f"pretrained weights not found: model.pretrained={path}" + (
            " is a folder; give the weights file in it" if os.path.isdir(path) else
            # ls lists a link whose target is gone (or a loop of links): "no such file" would contradict it
            " is a link that names no file (a loop of links, or its target is gone); give the path of the weights "
            "file itself" if os.path.islink(path) else
            " is no such file; give the path of a local .pth, .pt or .safetensors weights file"))


def load_pretrained(model: nn.Module, path: str, strict: bool = False) -> None:
    """Load the weights in `path` into `model` in place.

    Args:
        model: a timm model (its class's module provides `checkpoint_filter_fn` when timm has one).
        path: a .pth/.pt/.safetensors file; train.py checkpoints work too (their `model` entry: the raw weights,
            never an EMA copy beside them, which the log line names).
        strict: if False, classifier weights of a different shape are skipped (new head for fine-tuning)
            and missing attention-sink parameters keep their initial values.
    """
    check_weights_file(path)
    try:
        state = load_state_dict(path, use_ema=False)
    except (AttributeError, TypeError, KeyError):  # timm reads e.g. a list as if it were a mapping
        # torch's legacy reader meets random bytes as pickle opcodes, one of them a memo lookup (a KeyError)
        raise ModelError(not_weights_file(path) or no_state_dict(path)) from None
    except Exception as e:  # torch / safetensors readers raise RuntimeError, pickle and zip errors alike
        raise ModelError(unreadable(path, e)) from None
    state = module_entry(state)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelError(no_state_dict(path))
    bad = nonfinite_tensors(state)
    if bad:
        raise ModelError(f"model.pretrained={path}: {len(bad)} tensor(s) hold NaN or inf values, e.g. "
                         f"{'; '.join(bad[:3])}: these weights cannot be trained or evaluated; give other weights")
    state = {k.replace("_orig_mod.", ""): v for k, v in state.items()}
    family = sys.modules[type(model).__module__]
    # models/gpt.py: nanoGPT's model_args, transformers' config.json beside the file
    recorded = getattr(family, "check_recorded_settings", None)
    problem = recorded(file_entries(path), model, state) if recorded is not None else ""
    if problem:
        raise ModelError(f"model.pretrained={path}: {problem}")
    own = model.state_dict()
    codes = codes_refusal(state, own, path)  # before a table is resampled: integer codes are no table either
    if codes:
        raise ModelError(codes)
    file_state = dict(state)  # the file's keys, before timm's conversion renames, resamples or pops any of them
    try:
        notes, tables, skipped, new_sinks = _fit_and_load(model, state, own, path, strict, family)
    except ModelError:
        # the model's keys under a wrapper's attribute (a Lightning module's `model.`): the refusal names keys the
        # model lacks, or a conversion that failed on them, not the prefix that is the cause
        wrapped = wrapper_prefix_refusal(file_state, own, strict, path, model)
        if wrapped:
            raise ModelError(wrapped) from None
        raise
    for line in notes:  # logged once the file has loaded: a file refused above was never resampled into it
        log.warning(line)
    # the scored tables are not the file's: what an evaluation of these weights records ({'pos_embed_resampled':
    # '2x2->4x4'}; {} for none)
    model.pretrained_resampled = {key: change for record, _ in tables for key, change in record.items()}
    # the model's keys drawn anew, not loaded (a classifier of another shape, or none in the file): what the start
    # of a run is less them (engine/start_weights.py)
    model.pretrained_new_classifier = sorted(k for k in skipped if k in own)
    ema = ema_copy(path)
    log.info("loaded %s%s%s%s", path,
             f" (raw weights; the file's EMA copy ({ema}) is not used: to start from it, {ema_advice(ema)})"
             if ema else "",
             f" (new classifier: {', '.join(skipped)})" if skipped else "",
             f" ({len(new_sinks)} attention-sink parameters not in the file keep their zero init)"
             if new_sinks else "")


def _fit_and_load(model: nn.Module, state: dict, own: dict, path: str, strict: bool, family) -> tuple:
    """Convert `state` (the weights read from `path`) to `model`'s layout with its `family`'s timm conversion, check
    it against the model's state dict `own` and load it into the model; raise ModelError where it does not fit.
    Returns (lines to log, the position tables resampled, the classifier keys drawn anew, the attention-sink
    parameters that keep their zero init)."""
    tables = [position_table_resize(state, own, model, path), relative_table_resize(state, own, model, path)]
    # lines to log once the file has loaded: tables resampled, tensors timm's conversion left out
    notes = [line for line in (check_patch_size(state, own, path, strict), *(line for _, line in tables)) if line]
    filter_fn = getattr(family, "checkpoint_filter_fn", None)
    head_prefixes = classifier_prefixes(model)
    before = dict(state)  # the filter may pop keys of the dict it is given (DINOv2's conversion does)
    if filter_fn is not None:
        # DeiT III's official files name their layer scales blocks.N.gamma_1; timm's DeiT entry points
        # rename them with this flag, which touches no other key
        takes = inspect.signature(filter_fn).parameters
        filter_args = {"adapt_layer_scale": True} if "adapt_layer_scale" in takes else {}
        try:
            state = filter_fn(state, model, **filter_args)
        except FILTER_ERRORS as e:
            if isinstance(e, AttributeError):  # a module of the file the model lacks: the keys that differ say which
                _refuse_another_architecture(_converted_without_foreign_tables(filter_fn, state, model, filter_args),
                                             own, strict, head_prefixes, path, model)
            # e.g. resampling a position table whose token layout (class, distillation, register tokens) is not
            # the model's: a reshape error from deep inside timm
            raise ConversionError(conversion_failed(path, model, e)) from None
        notes += check_dropped(dropped_by_filter(before, state, rebuilt_buffers(model)), strict, path, model)
        codes = codes_refusal(state, own, path)  # keys an official layout names otherwise, in the model's names
        if codes:
            raise ModelError(codes)
    check_tied_weights(model, state, path)

    skipped = []
    for key in list(state):
        if key in state and key in own and state[key].shape != own[key].shape:  # (a classifier's keys go together)
            setting = getattr(model, "size_settings", {}).get(key)  # a GPT: vocabulary and context sizes
            if setting is not None and state[key].shape[1:] == own[key].shape[1:]:
                # a file of another architecture may share one such trailing shape (a ViT's 1000-class head.weight
                # of the GPT's width): its advice would only lead to the next refusal, so its keys are named instead
                _refuse_another_architecture(state, own, strict, head_prefixes, path, model)
                # e.g. transformers' GPT-2 (50,257 ids) into the recipe's 50,304: the fix is a setting, not
                # another file; a GPT's LM head is its token embedding, never replaced as a classifier is
                raise ModelError(f"{path}: '{key}' has {state[key].shape[0]} rows, the model "
                                 f"{own[key].shape[0]}: set {setting}={state[key].shape[0]} to load it"
                                 + (" (model.pretrained_strict does not apply: a GPT's LM head is its token "
                                    "embedding)" if setting == "model.num_classes" else ""))
            if key.startswith(head_prefixes):
                # the whole classifier (weight and bias): a file's bias beside a new weight is no classifier of either
                head = max((p for p in head_prefixes if key.startswith(p)), key=len)
                if strict:  # an evaluation: never a random classifier
                    # the reverse of the GPT case above: a GPT file's head.weight (its vocabulary) of the ViT's width
                    _refuse_another_architecture(state, own, strict, head_prefixes, path, model)
                    raise ModelError(classifier_mismatch(head, state, own, path))
                for k in [k for k in state if k.startswith(head)]:
                    skipped.append(k)
                    del state[k]
            else:
                raise ModelError(shape_mismatch(key, before, state, own, path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if not strict:  # a file without a classifier (a backbone) gets a new one, logged as one of another size is
        skipped += [k for k in missing if k.startswith(head_prefixes) and k not in skipped]
    missing = [k for k in missing if k not in skipped]
    new_sinks = [k for k in missing if not strict and k.rpartition(".")[2] in SINK_PARAMS]
    missing = [k for k in missing if k not in new_sinks]
    if missing or unexpected:
        if _other_kind(state, model):  # a language model's file into a ViT (fine-tuning: its head was dropped)
            _refuse_another_architecture(state, own, strict, head_prefixes, path, model)
        # a run of another model.attn variant: its sink parameters alone differ, which the key list does not explain
        sinks = sink_mismatch(missing, unexpected, state, model, recorded_attn(mapped_payload(path)))
        if sinks:
            raise ModelError(f"{path} does not fit {type(model).__name__}: {sinks}")
        raise ModelError(f"{path} does not fit {type(model).__name__}: missing {missing[:8]}"
                         f"{'...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                         f"{'...' if len(unexpected) > 8 else ''}{bias_advice(missing, unexpected, model)}")
    return notes, tables, skipped, new_sinks


def bias_advice(missing: list, unexpected: list, model: nn.Module) -> str:
    """The fix where a GPT file and the GPT differ only in their biases (nanoGPT's `bias` setting: a file of
    bias=False into the default bias=True model, or the reverse); '' otherwise."""
    if (not isinstance(model, GPT) or bool(missing) == bool(unexpected)
            or not all(k.endswith(".bias") for k in missing + unexpected)):
        return ""
    value = "false" if missing else "true"  # the model has biases the file lacks, or the file has the model's none
    return f": the file was trained with{'out' if missing else ''} biases; give model.kwargs.bias={value}"


def shape_mismatch(key: str, before: dict, state: dict, own: dict, path: str) -> str:
    """The error line for the tensor `key` of another shape than the model's (`own`), named by its shape in the
    file (`before` the family's conversion, which resamples a patch embedding to the model's patch size: the
    converted shape is none the file has); by the converted one where the file names the tensor otherwise (the
    conversion renamed it: an official or nanoGPT layout)."""
    found = before.get(key)
    shape = found.shape if found is not None and found.shape != own[key].shape else state[key].shape
    return (f"{path}: '{key}' has shape {tuple(shape)}, the model expects {tuple(own[key].shape)}: a checkpoint of "
            f"another model?")


def wrapper_prefix_refusal(state: dict, own: dict, strict: bool, path: str, model: nn.Module) -> str:
    """The error line for a file (its keys as read: `state`) that holds the model's weights under a prefix of
    their keys, the attribute a wrapper held the model under (a Lightning module's `model.`), which timm does not
    strip as it strips DDP's `module.`: without the prefix its keys are the model's (`own`; less a classifier and
    attention-sink parameters when not strict, as loading tolerates). '' for any other file.
    The prefix is named, not stripped: it is the wrapper's own attribute name, one of several a file may hold (a
    student and its teacher), and the family's conversion strips the prefixes of the layouts it reads
    (OpenCLIP's `visual.trunk.`) before any comparison of keys here could tell the two apart."""
    head_prefixes = classifier_prefixes(model)
    candidates = {k[:i + 1] for k in state if k not in own
                  for i, c in enumerate(k) if c == "." and k[i + 1:] in own}
    fits = sorted(p for p in candidates if not any(k.startswith(p) for k in own)
                  and _keys_off({k[len(p):]: v for k, v in state.items() if k.startswith(p)}, own, strict,
                                head_prefixes) == ([], []))
    if not fits:
        return ""
    prefix = fits[0]
    others = [k for k in state if not k.startswith(prefix)]
    read = "safetensors.torch.load_file" if path.endswith(".safetensors") else "torch.load"
    entry = _raw_entry(path)
    return (f"{path} does not fit {type(model).__name__}: the file's keys carry the prefix '{prefix}' (the attribute "
            f"a wrapper, e.g. a Lightning module, holds the model under) and are the model's once it is removed"
            + (f"; so do those under {', '.join(repr(p) for p in fits[1:])}" if len(fits) > 1 else "")
            + (f"; its {len(others)} other key(s) are no part of it ({_few(others)})" if others else "")
            + f": save them so, torch.save({{k.removeprefix('{prefix}'): v for k, v in {read}('{path}')"
            f"{f'[{entry!r}]' if entry else ''}.items() if k.startswith('{prefix}')}}, 'x.pth'), and give "
            f"model.pretrained=x.pth")


def _raw_entry(path: str) -> str:
    """The entry of the torch file `path` that timm's reader took the raw weights from ('state_dict', 'model',
    or module_entry's 'module'); '' for a file that is a state dict as a whole, and for a safetensors file."""
    payload = mapped_payload(path)
    entries = payload if isinstance(payload, dict) else {}
    return next((k for k in RAW_KEYS if isinstance(entries.get(k), dict)), "")


# the entries that timm's reader (use_ema=False) takes the raw weights from, in its order, then module_entry's
RAW_KEYS = ("state_dict", "model", "module")


def no_state_dict(path: str) -> str:
    """The error line for model.pretrained=`path`, a file without raw weights where timm's reader looks for them."""
    payload = mapped_payload(path)
    entries = payload if isinstance(payload, dict) else {}
    # the first of them the file has (an entry that is a tensor is a parameter of that name, in a state dict)
    raw = next((k for k in RAW_KEYS if k in entries and not isinstance(entries[k], torch.Tensor)), "")
    if not raw and (ema := ema_copy(path)):  # an EMA copy alone, which the reader leaves unread (use_ema=False)
        return (f"model.pretrained={path} holds only an EMA copy of the weights ('{ema}'), no raw weights: to start "
                f"from it, {ema_advice(ema)}")
    # raw weights that are no state dict (an EMA copy beside them is not what is wrong): what is wrong with them
    problem = raw and not_a_state_dict(entries[raw])
    return (f"model.pretrained={path} holds no state dict (parameter name -> tensor), neither as a whole nor under "
            f"'model' / 'state_dict' / 'module'{f'; its {raw!r} {problem}' if problem else ''}: give a weights file")


def not_a_state_dict(entry: object) -> str:
    """What keeps `entry` (a torch file's entry) from being a state dict, said of it ('is a list'); '' where it is
    one."""
    if not isinstance(entry, dict):
        return f"is a {type(entry).__name__}"
    others = [k for k, v in entry.items() if not isinstance(v, torch.Tensor)]
    if not others:
        return ""
    first, one = entry[others[0]], len(others) == 1
    return (f"has {len(others)} entr{'y' if one else 'ies'} of {len(entry)} that hold{'s' if one else ''} no tensor, "
            f"e.g. {others[0]!r} ({type(first).__name__} {str(first)[:40]})")


def module_entry(state: object) -> object:
    """The state dict under a file's 'module' entry when that is its one state dict (DeepSpeed's layout, in which
    the official EVA / EVA-02 weights come; timm's EVA conversion reads it too), its own 'module.' prefixes
    stripped as timm strips them elsewhere; `state` as it is otherwise (timm's `load_state_dict` unwraps only the
    'model' and 'state_dict' entries, so such a file arrives whole)."""
    inner = state.get("module") if isinstance(state, dict) else None
    if (isinstance(inner, dict) and inner and all(isinstance(v, torch.Tensor) for v in inner.values())
            and not any(isinstance(v, torch.Tensor) for v in state.values())):  # no weights beside it
        return clean_state_dict(inner)
    return state


# what timm's checkpoint_filter_fn raises for weights of another model: a reshape of a table of another token
# layout, an assertion on a table's shape, or (Swin) the lookup of an attention the model lacks (get_submodule)
FILTER_ERRORS = (RuntimeError, ValueError, AssertionError, KeyError, IndexError, AttributeError)


def conversion_failed(source: str, model: nn.Module, error: Exception) -> str:
    """The error line for weights (of `source`: a file, or the hub's) that timm's conversion to `model` failed on
    (`error`), e.g. a reshape of a position table of another token layout (class, distillation, register tokens)
    than the model's, deep inside timm: weights of another model than this one."""
    # torch's load_state_dict error (hub weights timm loads itself) spans lines and names every key that differs
    reason = " ".join(str(error).split()) or type(error).__name__
    reason = reason if len(reason) <= 300 else reason[:300] + " ..."
    return (f"{source}: timm's conversion of these weights to {type(model).__name__} failed ({reason}): weights of "
            f"another model" + (" (another token layout, e.g. without a class token or with a distillation token)"
                                if "pos_embed" in model.state_dict() else "") + "?")


def _converted_without_foreign_tables(filter_fn, state: dict, model: nn.Module, filter_args: dict) -> dict:
    """`state` in timm's layout (`filter_fn`'s conversion), for naming the keys that differ from the model's when the
    conversion failed on a module the model lacks. timm's Swin filter looks up the attention of each relative
    position bias table in the file, so a file of more blocks or stages (swin_small's weights for swin_tiny) fails
    there; converted without those tables (added back as they are), an official-layout file's keys are compared in
    timm's layout, not as renamed downsample and head keys. The file's own keys where the conversion fails again."""
    def foreign(key: str) -> bool:
        try:
            model.get_submodule(key.rpartition(".")[0])
        except AttributeError:
            return True
        return False

    tables = {k: v for k, v in state.items() if k.endswith("relative_position_bias_table") and foreign(k)}
    try:
        converted = filter_fn({k: v for k, v in state.items() if k not in tables}, model, **filter_args)
    except FILTER_ERRORS:
        return state
    return {**converted, **tables}


def unreadable(path: str, error: Exception) -> str:
    """The error line for a weights file that timm's `load_state_dict` cannot read (`error`), with advice a user can
    follow: torch's own ('retry with weights_only=False') is no setting here."""
    if not path.endswith(".safetensors") and _is_safetensors(path):  # timm picks the reader by the file name
        return (f"model.pretrained={path} is a safetensors file under another name, which torch's reader cannot "
                f"read: give it the .safetensors extension")
    arrays = _npz_arrays(path)
    if arrays and any("/" in name for name in arrays):  # JAX / big_vision parameter paths ('embedding/kernel')
        return (f"model.pretrained={path} is a numpy .npz archive of JAX weights (Google's ViT releases, big_vision), "
                f"which is not read here: convert it with timm (its ViT reads them): model = timm.create_model(NAME, "
                f"pretrained=True, pretrained_cfg_overlay=dict(file='{path}', custom_load=True), **ARGS) with "
                f"model.name's timm name and its arguments, then torch.save(model.state_dict(), 'x.pth'), and give "
                f"model.pretrained=x.pth")
    if arrays:  # one array per parameter name (numpy.savez of a state dict)
        return (f"model.pretrained={path} is a numpy .npz archive, which is not read here: save its arrays as torch "
                f"tensors, torch.save({{k: torch.from_numpy(v) for k, v in numpy.load('{path}').items()}}, 'x.pth'), "
                f"and give model.pretrained=x.pth")
    if problem := not_weights_file(path):  # torch's reader fails on it as on a pickle of Python objects
        return problem
    reason = " ".join(str(error).split()) or type(error).__name__
    # timm re-raises torch's refusal as its own RuntimeError, whose text names the cause only when timm could list
    # the globals: the chained errors say which it was (a Python object, or a pickle opcode torch does not read)
    chain = " ".join(" ".join(str(e).split()) for e in error_chain(error))
    if "Unsupported global" in chain:  # torch's weights-only unpickler met a Python object beside the tensors
        found = re.search(r"Unsupported globals?: (?:GLOBAL )?([\w.]+(?:, [\w.]+)*)", chain)
        return (f"model.pretrained={path} holds Python objects beside its tensors"
                + (f" ({found.group(1).rstrip('.')})" if found else "")
                + " that weights-only loading refuses: if the file is trusted, load it with torch.load(..., "
                  "weights_only=False), save its state dict alone with torch.save and give that file")
    if "Unsupported operand" in chain:  # a torch file (not_weights_file) pickled with opcodes torch cannot read safely
        return (f"model.pretrained={path} is a torch file whose pickle weights-only loading cannot read (a "
                f"pickle protocol other than torch's default 2 or 3, e.g. torch.save(..., pickle_protocol=4 or 5)): "
                f"if the file is trusted, load it with "
                f"torch.load(..., weights_only=False), save it again with torch.save and give that file")
    return f"model.pretrained={path} cannot be read as weights: {reason}"


def error_chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from or while handling (its __cause__ / __context__), in that order."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


# what every file torch.save writes starts with: a zip archive's local file header, or (the legacy format,
# _use_new_zipfile_serialization=False) torch's magic number pickled at the protocol the file was saved with
TORCH_HEADS = (b"PK\x03\x04", *(pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=p)
                                 for p in range(pickle.HIGHEST_PROTOCOL + 1)))


def not_weights_file(path: str) -> str:
    """The error line for model.pretrained=`path` when it is no weights file at all: neither one torch.save wrote
    (a zip archive, or the legacy pickle format), nor a safetensors file (a YAML, JSON, CSV, numpy .npy, random
    bytes); '' for a file of one of those formats (what is wrong with it is said otherwise)."""
    try:
        with open(path, "rb") as f:
            head = f.read(max(len(h) for h in TORCH_HEADS))
    except OSError:
        return ""
    if head.startswith(TORCH_HEADS) or zipfile.is_zipfile(path) or _is_safetensors(path):
        return ""
    what = "an empty file" if not head else "a text file" if _is_text(head) else "binary data"
    return (f"model.pretrained={path} is not a torch or safetensors weights file ({what}, not the zip archive or "
            f"legacy format torch.save writes, nor safetensors); give a .pth/.pt/.safetensors file")


def _is_text(head: bytes) -> bool:
    """Whether `head`, a file's first bytes, reads as text (a YAML, JSON or CSV file): UTF-8 without control bytes
    other than white space (a character cut off at the end of `head` aside)."""
    text = head.decode("utf-8", errors="ignore")
    return len(text.encode()) >= len(head) - 3 and all(c.isprintable() or c in "\t\n\r" for c in text)


def _npz_arrays(path: str) -> list[str]:
    """The array names of a numpy .npz archive (a zip of NAME.npy members) at `path`; [] for any other file."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return []
    return [m[:-len(".npy")] for m in members] if members and all(m.endswith(".npy") for m in members) else []


def _is_safetensors(path: str) -> bool:
    """Whether `path` holds a safetensors file: an 8-byte little-endian header length, then the JSON header."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    return len(head) == 9 and 0 < int.from_bytes(head[:8], "little") <= size - 8 and head[8:] == b"{"


def mapped_payload(path: str) -> object:
    """What a torch file holds, its tensors memory-mapped (none is read): for the entries beside the weights (a
    run's config, nanoGPT's `model_args`). A file of torch's legacy format (torch.save(...,
    _use_new_zipfile_serialization=False)), which torch cannot map, is read whole, as timm's reader reads it: its
    entries beside the weights are checked as a zip file's are. None for a safetensors file or one torch cannot
    read."""
    if path.endswith(".safetensors"):
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception:  # noqa: BLE001 - a broken file: timm's reader says what is wrong with it
        return None


# the entries of an EMA copy of the weights beside the raw ones (timm's train.py, DeiT's and this repository's
# checkpoints), which timm's `load_state_dict` reads only when asked (use_ema; the raw weights are loaded here)
EMA_KEYS = ("state_dict_ema", "model_ema")


def ema_advice(entry: str) -> str:
    """How to start from the EMA copy under a torch file's `entry` (PATH: the file given as model.pretrained)."""
    return f"save it as a file of its own, torch.save(torch.load(PATH)['{entry}'], 'ema.pth'), and give that"


def ema_copy(path: str) -> str:
    """The entry of the EMA copy of the weights that the torch file `path` holds, beside its raw weights or alone
    ('' for none, and for a safetensors file: it holds one set)."""
    payload = mapped_payload(path)
    return next((k for k in EMA_KEYS if isinstance(payload.get(k), dict)), "") if isinstance(payload, dict) else ""


def file_entries(path: str) -> dict:
    """What records the architecture of the weights in `path` beside them, for a model family to check: the entries
    of a torch file beside its weights (nanoGPT's `model_args`; timm's `load_state_dict` keeps only the weights) and
    transformers' config.json in the file's folder (`config_beside`, under "config.json"); {} where there are none."""
    payload = mapped_payload(path)
    entries = {k: payload[k] for k in ("model_args",) if k in payload} if isinstance(payload, dict) else {}
    config = config_beside(path)
    if config is not None:
        entries["config.json"] = config
    return entries


def config_beside(path: str) -> dict | None:
    """The config.json in the folder of `path` as a dict: what transformers' save_pretrained writes beside
    model.safetensors or pytorch_model.bin, the architecture the weights were built as (its model_type says which).
    None where there is none, or it is no JSON object: the weights load without it."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(path)), "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):  # absent, unreadable, not JSON (UnicodeDecodeError is a ValueError)
        return None
    return config if isinstance(config, dict) else None


def check_patch_size(state: dict, own: dict, path: str, strict: bool) -> str:
    """A file of another patch size: timm resamples its patch embedding (FlexiViT's resize) to this model's, which
    fine-tuning may ask for (the returned line, '' for none, to log once the file has loaded), but an evaluation
    (strict) would score weights that are not the file's."""
    key = "patch_embed.proj.weight"
    if key not in state or key not in own or state[key].shape[-2:] == own[key].shape[-2:]:
        return ""
    size, mine = tuple(state[key].shape[-2:]), tuple(own[key].shape[-2:])
    if strict:
        raise ModelError(f"{path}: its patch embedding has {size} patches, the model {mine}: a checkpoint of another "
                         f"model (set the patch size it was trained with)")
    return f"{path}: patch size {size} resampled to the model's {mine} (timm's patch-embedding resize)"


def position_table_resize(state: dict, own: dict, model: nn.Module, path: str) -> tuple[dict, str]:
    """A ViT file whose position table is for another grid (weights trained at another img_size or patch size, which
    the line names as its cause: `_grid_cause`): timm's filter resamples the table (bicubic) to the model's grid. A
    fine-tune or an evaluation at a new resolution asks for exactly that, so it is not refused even when strict; but
    the scored table is not the file's, so the returned record ({'pos_embed_resampled': '2x2->4x4'}) and line say so,
    with both grids ({} and '' for none)."""
    key = "pos_embed"
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if key not in state or key not in own or grid is None:
        return {}, ""
    if state[key].dim() != own[key].dim():  # no table of tokens to resample (a scalar has no token count to read)
        raise ModelError(f"{path}: '{key}' has shape {tuple(state[key].shape)}, the model expects "
                         f"{tuple(own[key].shape)}: a checkpoint of another model?")
    converted = state[key].shape[1] - _entries_folded(state)  # the table as timm's filter resizes it
    if converted == own[key].shape[1]:
        return {}, ""
    prefix = own[key].shape[1] - grid[0] * grid[1]  # class/register tokens held in the table (0 for no_embed_class)
    tokens = converted - prefix
    side = int(tokens ** 0.5)
    square = side * side == tokens
    theirs, mine = f"{side}x{side}" if square else f"{tokens}-patch", f"{grid[0]}x{grid[1]}"
    return ({"pos_embed_resampled": f"{theirs}->{mine}"},
            f"{path}: position table of a {theirs} grid resampled to the model's {mine} (timm's bicubic resize; "
            f"{_grid_cause(state, own, model, side if square else None)})")


def _grid_cause(state: dict, own: dict, model: nn.Module, side) -> str:
    """Why the file's position table has another grid than the model's: another patch size (the file's patch
    embedding, named on the line of its resize too) over the same pixels, another img_size, or both (the file's
    pixels, `side` of its square grid times its patch, unknown for a grid of no square: None)."""
    key = "patch_embed.proj.weight"
    if key not in state or key not in own or state[key].shape[-2:] == own[key].shape[-2:]:
        return "the weights were trained at another img_size than model.img_size"
    (ph, pw), (mh, mw) = state[key].shape[-2:], own[key].shape[-2:]
    pixels = tuple(model.patch_embed.img_size)
    patches = f"the weights were trained with another patch size, {ph}x{pw}, than the model's {mh}x{mw}"
    if side is None:
        return patches
    if (side * ph, side * pw) == pixels:
        return f"{patches}, at the same img_size ({pixels[0]} pixels)"
    return f"{patches}, and at another img_size ({side * ph} pixels) than the model's ({pixels[0]})"


def _entries_folded(state: dict) -> int:
    """Entries of the file's position table that timm's filter takes out before it compares the table with the
    model's and resizes it: DINOv2's official layout with registers (mask_token and register_tokens beside it) holds
    the class token's entry, which timm's `_convert_dinov2` adds to cls_token, its model's table holding the
    patches alone. A position table is compared in the layout the filter gives it, not the file's."""
    return 1 if "mask_token" in state and "register_tokens" in state else 0


def relative_table_resize(state: dict, own: dict, model: nn.Module, path: str) -> tuple[dict, str]:
    """A Swin file of another window size (model.kwargs.window_size): timm's filter resamples each attention's
    relative position bias table ((2w-1)^2 rows, one column per head) to the model's window, even when strict. As
    for a ViT's position table (`position_table_resize`) that is what loading at another window asks for, but the
    scored tables are not the file's: the returned record ({'relative_position_bias_resampled': '7x7->4x4'}) and
    line say so, with both windows ({} and '' for none). timm also shrinks a window to its stage's feature map, so a
    file trained at a larger img_size has larger windows in the late stages than the model at the same
    window_size: the line names those tables' cause as model.img_size (`_window_shrunk_to`)."""
    resized = [k for k in state if k.endswith("relative_position_bias_table") and k in own
               and state[k].shape != own[k].shape and state[k].shape[1:] == own[k].shape[1:]]
    if not resized:  # a table of another head count is no resize: the shape check names it
        return {}, ""
    shrunk = {k: m for k in resized if (m := _window_shrunk_to(model, k, _window_side(state[k].shape[0])))}
    parts = []
    if other_window := [k for k in resized if k not in shrunk]:
        parts.append(_tables_resized(other_window, state, own, "the weights were trained with another window size "
                                                               "than the model's, model.kwargs.window_size"))
    if shrunk:
        (height, width), pixels = next(iter(shrunk.values())), model.patch_embed.img_size
        parts.append(_tables_resized(list(shrunk), state, own, f"timm shrinks a window to its stage's feature map, "
                                     f"{height}x{width} at an input of {pixels[0]}x{pixels[1]} pixels "
                                     f"(model.img_size): the weights were trained at a larger img_size"))
    key = resized[0]
    return ({"relative_position_bias_resampled": f"{_window(state[key].shape[0])}->{_window(own[key].shape[0])}"},
            f"{path}: " + "; ".join(parts))


def _tables_resized(keys: list, state: dict, own: dict, cause: str) -> str:
    """The log line's account of the relative position bias tables `keys` resampled for one `cause`."""
    return (f"relative position bias tables of {len(keys)} attention layer(s) (e.g. '{keys[0]}') of "
            f"{_window(state[keys[0]].shape[0])} windows resampled to the model's {_window(own[keys[0]].shape[0])} "
            f"(timm's resize; {cause})")


def _window_side(rows: int):
    """The side w of the square window of a relative position bias table of (2w-1)^2 rows; None for another count."""
    side = int(round(rows ** 0.5))
    return (side + 1) // 2 if side * side == rows and side % 2 else None


def _window(rows: int) -> str:
    """A table's window as logged and recorded: '4x4', or '40-row' for a table of no square window."""
    side = _window_side(rows)
    return f"{side}x{side}" if side else f"{rows}-row"


def _window_shrunk_to(model: nn.Module, key: str, file_side) -> tuple:
    """The feature map (h, w) of the Swin block of the table `key` when timm shrank the block's window to it and the
    file's window (`file_side`) is larger: no window_size setting gives the model the file's window there, only a
    larger img_size does. () otherwise (and for a block of no such attributes)."""
    try:
        block = model.get_submodule(key.rpartition(".")[0].rpartition(".")[0])  # layers.1.blocks.0(.attn.<table>)
    except AttributeError:
        return ()
    window, feature_map = getattr(block, "window_size", None), getattr(block, "input_resolution", None)
    if file_side is None or window is None or feature_map is None or getattr(block, "always_partition", False):
        return ()
    return tuple(feature_map) if any(w == r < file_side for w, r in zip(window, feature_map)) else ()


# the advice for weights whose classifier does not fit model.num_classes (a local file's or the hub's)
NEW_CLASSIFIER = "only fine-tuning, with model.pretrained_strict=false, replaces it by a new classifier"


def classifier_mismatch(head: str, state: dict, own: dict, path: str) -> str:
    """The error line for a file whose classifier (the keys under `head`, e.g. 'head.') has other shapes than the
    model's: another number of outputs alone is a setting (model.num_classes); another input width (or outputs that
    its own keys disagree on) is a classifier of other features, which no setting of the classifier fixes."""
    keys = [k for k in state if k.startswith(head) and k in own]
    differ = [k for k in keys if state[k].shape != own[k].shape]
    outputs = {state[k].shape[0] for k in keys if state[k].dim()}
    refit = f" ({NEW_CLASSIFIER})"
    if len(outputs) == 1 and all(state[k].shape[1:] == own[k].shape[1:] for k in differ):
        key = differ[0]
        return (f"{path}: its classifier '{key}' has {state[key].shape[0]} outputs, model.num_classes="
                f"{own[key].shape[0]}: set model.num_classes={state[key].shape[0]} to use it as it is{refit}")
    shapes = "; ".join(f"'{k}' has shape {tuple(state[k].shape)}, the model expects {tuple(own[k].shape)}"
                       for k in differ)
    what = ("takes other features than the model's" if any(state[k].shape[1:] != own[k].shape[1:] for k in differ)
            else f"has no one number of outputs ({', '.join(map(str, sorted(outputs)))})")
    return (f"{path}: its classifier {what} ({shapes}), which no model.num_classes fixes: weights of another "
            f"model?{refit}")


def check_dropped(dropped: list[str], strict: bool, path: str, model: nn.Module) -> list[str]:
    """The file's tensors timm's conversion left out (`dropped_by_filter`: a layer the model lacks, e.g. an old
    in21k ViT's pre-logits layer): the model would not compute what the file's did. An evaluation (strict) is
    refused; fine-tuning loads the rest, the returned line naming every key left out ([] for none)."""
    if not dropped:
        return []
    if strict:
        raise ModelError(f"{path}: timm's conversion of these weights to {type(model).__name__} leaves out "
                         f"{len(dropped)} tensor(s) the model has no place for ({_few(dropped)}), so the model would "
                         f"not compute what the file's did: give weights of this model, or fine-tune from them "
                         f"without those tensors (model.pretrained_strict=false)")
    return [f"{path}: {len(dropped)} tensor(s) of the file have no place in {type(model).__name__} and were left "
            f"out by timm's conversion (a layer the model lacks, e.g. an old in21k ViT's pre-logits layer): "
            f"{', '.join(dropped)}"]


def check_tied_weights(model: nn.Module, state: dict, path: str) -> None:
    """Parameters the model shares under several names (GPT's token embedding and LM head) must hold one value
    in the file: loading would keep whichever came last and lose the other without a word."""
    names_of: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for names in names_of.values():
        held = [n for n in names if n in state]
        if len(held) > 1 and not all(torch.equal(state[held[0]], state[n]) for n in held[1:]):
            raise ModelError(f"{path}: {' and '.join(held)} differ in the file, but the model ties them (one "
                             f"parameter): a checkpoint of a model with an untied head?")


def _keys_off(state: dict, own: dict, strict: bool, head_prefixes: tuple) -> tuple[list, list]:
    """(the model's keys the file lacks, the file's keys the model lacks), less what loading tolerates when not
    strict: a classifier (a new one is made) and attention-sink parameters (their zero init)."""
    tolerated = (lambda k: not strict and (k.startswith(head_prefixes) or k.rpartition(".")[2] in SINK_PARAMS))
    return [k for k in own if k not in state and not tolerated(k)], [k for k in state if k not in own]


def _refuse_another_architecture(state: dict, own: dict, strict: bool, head_prefixes: tuple, path: str,
                                 model: nn.Module) -> None:
    """Raise ModelError naming the keys that differ when the file's keys are not the model's (`_keys_off`): a size
    setting's advice (model.num_classes=N) would only lead to the next refusal for such a file."""
    absent, extra = _keys_off(state, own, strict, head_prefixes)
    if absent or extra:
        differ = "; ".join(([f"the model's {_few(absent)} are not in it"] if absent else [])
                           + ([f"its {_few(extra)} are not in the model"] if extra else []))
        raise ModelError(f"{path}: weights of another architecture than {type(model).__name__} ({differ}): "
                         + (_other_kind(state, model) or "give weights of this model"))


# keys only one kind of model has: models/gpt.py's token and position embeddings, a timm vision model's patch
# embedding (ViT, DeiT, Swin)
LANGUAGE_KEYS = ("wte.weight", "wpe.weight")
VISION_KEYS = ("patch_embed.proj.weight",)


def _other_kind(state: dict, model: nn.Module) -> str:
    """What the file `state` is, and the weights to give instead, when it is of the other kind of model than
    `model` (a language model's weights for a vision model, or the reverse); '' otherwise."""
    language = all(k in model.state_dict() for k in LANGUAGE_KEYS)
    if not language and all(k in state for k in LANGUAGE_KEYS):
        return ("a language model's weights (models/gpt.py's token and position embeddings); give a vision "
                "checkpoint instead (a train.py run of an image model, or timm weights of model.name)")
    if language and any(k in state for k in VISION_KEYS):
        return ("a vision model's weights (a patch embedding); give a language model's instead (a train.py run of "
                "a GPT, or nanoGPT / transformers GPT-2 weights)")
    return ""


def _few(keys: list) -> str:
    """Up to five of `keys`, '...' marking those left out."""
    return str(keys[:5]) + ("..." if len(keys) > 5 else "")


def classifier_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Parameter-name prefixes of the classifier, as timm records it ('head.' for ViT, 'head.fc.' for Swin, 'head.' and
    'head_dist.' for a distilled DeiT's two heads); engine/start_weights.py's `classifier_keys` reads it too."""
    names = getattr(model, "pretrained_cfg", {}).get("classifier", "head")
    names = names if isinstance(names, (list, tuple)) else [names]
    return tuple(n + "." for n in names)
