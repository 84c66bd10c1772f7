"""Whether the ranks of a run agree on what each read or resolved on its own node: the settings (paths and a node's
own resources aside), a data set's fingerprint, a checkpoint's start (engine/snapshots.py). One all-reduce of digests
per check; nothing in one process.

    differ = differing_between_ranks({"train": ..., "val": ...}, device)   # the keys whose values differ
    check_same_settings_on_every_rank(config_to_dict(cfg), device)  # a ConfigError on every rank
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import torch
import torch.distributed as dist

from configs import ConfigError

from .distributed import all_reduce, world_size


# the int64 slots of differing_between_ranks' all-reduce: one tensor of this fixed size on every rank, whatever
# each passes, so that ranks running other versions of the code (another schema: other sections) still meet in
# one all-reduce of one size (tensors of other sizes abort gloo's process, and leave NCCL's hanging)
COMPARED_SLOTS = 64


def digest(value: Any) -> int:
    """A 56-bit digest of `value`'s JSON (keys sorted): exact in int64, positive, so that its negation is too."""
    text = json.dumps(_text_keys(value), sort_keys=True, default=str).encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.sha256(text).digest()[:7], "big")


def _text_keys(value: Any) -> Any:
    """`value` with every mapping's keys as text, a key of another type tagged with it (1 -> "int:1", kept apart
    from "1"): json.dumps cannot sort keys of mixed types (a YAML `model.kwargs: {1: 2, a: 3}`), which ended the
    comparison with a TypeError before the setting's own one-line error."""
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else f"{type(k).__name__}:{k!r}": _text_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_text_keys(v) for v in value]
    return value


def differing_between_ranks(values: Mapping[str, Any], device: torch.device) -> list[str]:
    """The keys of `values` whose value (JSON-able) is not the same on every rank, in the mapping's order; [] without
    a process group. One all-reduce of COMPARED_SLOTS digests and their negations: the keys' own (in order), then
    each value's, zeros after; the maximum of a digest and of its negation are the maximum and minus the minimum,
    equal exactly when every rank has that digest. Ranks that pass other keys (another version of the code) get a
    ConfigError on every rank that says so."""
    keys = list(values)
    if len(keys) >= COMPARED_SLOTS:  # the same keys on every rank in any legitimate call: raised on each
        raise ValueError(f"differing_between_ranks compares at most {COMPARED_SLOTS - 1} values, got {len(keys)}")
    if world_size() == 1:  # one process: no hashing, nothing made on (or read back from) the device
        return []
    digests = [digest(keys)] + [digest(value) for value in values.values()]
    digests += [0] * (COMPARED_SLOTS - len(digests))
    # read back in one copy: an element at a time is a device sync each on CUDA
    both = all_reduce(torch.tensor(digests + [-d for d in digests], dtype=torch.int64, device=device),
                      op="max").tolist()
    differ = [i for i in range(COMPARED_SLOTS) if both[i] != -both[COMPARED_SLOTS + i]]
    if differ and differ[0] == 0:
        raise ConfigError(f"the processes compare other items (rank {dist.get_rank()}: {', '.join(keys)}): the "
                          "nodes run other versions of the code; give every node the same checkout")
    return [keys[i - 1] for i in differ]


# settings that name where a file is, not what is computed: a node may reach its own copy by another path (whose
# content train.py and evaluate.py compare across ranks where they read it: data, resume checkpoint, weights)
PATH_SETTINGS = ("out_dir", "data.root", "train.resume", "model.pretrained")
# settings of a node's own resources, which no result depends on (data/samplers.py seeds each sample's augmentation
# whatever the number of workers; the progress bar is the main rank's): a launch script may size them per node, e.g.
# data.num_workers=$CPUS_PER_TASK on nodes with other CPU counts
NODE_SETTINGS = ("data.num_workers", "data.pin_memory", "data.timeout", "log.progress")


SAME_SETTINGS_FIX = "give every node the same checkout of the configs and the same command line"


def check_same_settings_on_every_rank(settings: Mapping[str, Any], device: torch.device,
                                      fix: str = SAME_SETTINGS_FIX) -> None:
    """A ConfigError on every rank when the ranks resolved other settings (`settings`: the resolved config by
    section, and an entry point's own options), paths and a node's resources aside (PATH_SETTINGS,
    NODE_SETTINGS): a node whose checkout holds other
    config files, or that was given another command line, would train or score under other settings, or not meet
    the others at the same collectives (another train.max_steps, another validation cadence). One all-reduce,
    before anything is read or written. `fix`: the error's advice (evaluate.py's settings hold its checkpoint's).
    The error's text is the same on every rank (the sections all-reduced; no rank number), so that the entry points
    print it once (engine.distributed.say_once), not once per rank."""
    compared = {section: dict(value) if isinstance(value, Mapping) else value for section, value in settings.items()}
    for dotted in PATH_SETTINGS + NODE_SETTINGS:
        section, _, key = dotted.rpartition(".")
        (compared.get(section, {}) if section else compared).pop(key, None)
    differ = differing_between_ranks(compared, device)
    if differ:
        raise ConfigError(f"the processes resolved other settings in {', '.join(differ)}: {fix}")
