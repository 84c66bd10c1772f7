"""Which weights a training run started from, recorded in its checkpoints so that runs of other starts are told apart.

`model.pretrained` is a path, a setting of the machine (the same file lies elsewhere on another one), so the recipe
leaves it out (engine/run_dir.py ENVIRONMENT_KEYS); but what a run computes depends on the weights it loaded from
there, or on whether it loaded any. train.py records them in checkpoint.pt and best.pt under `START_WEIGHTS`:

    {"pretrained": "file" | "hub" | None,     # a model.pretrained file, timm's hub weights, or a random init
     "fingerprint": "<16 hex digits>" | None, # `start_fingerprint` of the model as loaded; None for a random init
     "classifier": "<16 hex digits>" | None,  # a file's only: `classifier_fingerprint`, None for a new classifier
     "trained_on": [{"data": {...}, "data_fingerprint": {...} | None}, ...]}  # a run checkpoint's only (TRAINED_ON)

`trained_on`, where the file is a checkpoint of this code base, is the data the start's weights learned: the data.*
settings and `data_fingerprint` of the file's own run, then those of the weights that run started from, and so on
(`start_lineage`, nearest first). train.py refuses a val split that reads any of them (train.py
check_pretrained_data and check_resume), as evaluate.py --checkpoint refuses to score one
(evaluate.check_held_out_from_starts, the one check of both): a fine-tune of a fine-tune (C from B from A) must not
validate on, nor be scored on, A's training data either, which B's own record alone does not name.

A resumed run carries its start's record over (it loads no pretrained weights itself); one that trains on other data
than its checkpoint (train.allow_changed_config=true: another data.train_split, data.root or digits / kjv val
fraction) puts the checkpoint's data first in `trained_on`, marked `EARLIER_TRAINING` (`resumed_record`): its
config.yaml names the new data only, and its weights learned both. A marked entry is data learned by the same run as
the entry before it (at the front: the checkpoint's own run), not by a start further back. evaluate.py adds the record
to the recipe it writes (`recipe_entries`: `start.pretrained`, `start.fingerprint`, `start.classifier`), which the
readers that average seeds compare (engine/eval_results.py recipe_difference): runs fine-tuned from other weights
(another backbone, or another classifier kept from the file), or one trained from scratch beside fine-tuned ones, are
no seeds of one experiment. A checkpoint written before the record has none, and its result no such recipe keys: it
is not compared on them, as any setting an older result could not record; one written before `classifier` was
recorded is compared on the other two. Hub weights record no `classifier`: the classifier timm keeps is that of
model.name's weights, which the recipe names.
scripts/dose_report.py rebuilds its "start" model from the runs' model.pretrained file and refuses a file whose
weights are no longer those the runs started from (`check_start_file`).
"""
from __future__ import annotations

import os
from typing import Optional

import torch.nn as nn

from configs.schema import DataConfig
from models.pretrained import classifier_prefixes

from .checkpoint import weights_fingerprint

START_WEIGHTS = "start_weights"  # the entry of checkpoint.pt and best.pt
TRAINED_ON = "trained_on"  # the record's list of the data its start's weights learned, nearest first
# a `TRAINED_ON` entry's mark (True): data its run learned before a resume changed the training data, learned by the
# run of the entry before it (the checkpoint's own run where it is first), not by the start that run fine-tuned
EARLIER_TRAINING = "before_resume"
# the data.* settings that name what a run trains on, per data.dataset (a change of any on resume is other data)
TRAINING_DATA_KEYS = {"folder": ("root", "train_split"), "tokens": ("root", "train_split"),
                      "digits": ("digits_val_fraction",), "kjv": ("kjv_val_fraction",)}


def classifier_keys(model: nn.Module) -> set[str]:
    """The state-dict keys of the model's classifier, under the names timm records for it (models/pretrained.py
    `classifier_prefixes`, which loading a file drops a classifier of another shape by: 'head.' of a ViT, 'head.fc.'
    of a Swin, 'head.' and 'head_dist.' of a distilled DeiT, whose `get_classifier` gives both heads as a tuple);
    none for a model without a classifier (models/gpt.py: its LM head is its token embedding, loaded from the file)."""
    if not callable(getattr(model, "get_classifier", None)):
        return set()
    prefixes = classifier_prefixes(model)
    return {key for key in model.state_dict() if key.startswith(prefixes)}


def start_fingerprint(model: nn.Module) -> str:
    """engine.checkpoint.weights_fingerprint of `model`'s weights less its classifier: the backbone it starts from.
    A fine-tune to other classes starts from a new, random classifier (drawn with train.seed, so each seed's is
    another); a classifier kept from a file is fingerprinted on its own (`classifier_fingerprint`), so that the
    backbone's fingerprint is the one runs recorded before the classifier was."""
    leave_out = classifier_keys(model)
    return weights_fingerprint({k: v for k, v in model.state_dict().items() if k not in leave_out})


def classifier_fingerprint(model: nn.Module) -> Optional[str]:
    """engine.checkpoint.weights_fingerprint of the classifier tensors `model` took from its model.pretrained file:
    its `classifier_keys` less those models/pretrained.py drew anew (`pretrained_new_classifier`: the file's
    classifier was of other classes, or it had none); None where all were drawn anew, or it has no classifier."""
    kept = classifier_keys(model) - set(model.pretrained_new_classifier)
    return weights_fingerprint({k: v for k, v in model.state_dict().items() if k in kept}) if kept else None


def start_record(pretrained: str, model: nn.Module, trained_on: Optional[list] = None) -> dict:
    """The `START_WEIGHTS` record of a fresh run whose model was built with model.pretrained=`pretrained` ('' for
    a random init, 'hub', or a file) and holds those weights now, before its first update; a file's classifier
    where the model records which of its classifier tensors were drawn anew (models/pretrained.py); `trained_on`,
    where given (`start_lineage` of a run checkpoint), the data its weights learned."""
    if not pretrained:
        return {"pretrained": None, "fingerprint": None}
    record = {"pretrained": "hub" if pretrained == "hub" else "file", "fingerprint": start_fingerprint(model)}
    if pretrained != "hub" and hasattr(model, "pretrained_new_classifier"):
        record["classifier"] = classifier_fingerprint(model)
    if trained_on:
        record[TRAINED_ON] = trained_on
    return record


def ancestors_data(payload: Optional[dict]) -> list[dict]:
    """The `TRAINED_ON` entries of a checkpoint's record (`payload`: a checkpoint.pt or best.pt of this code base):
    the data the weights its run started from learned, nearest first; [] for a run of other weights (a random init,
    hub weights, a weights file) or a checkpoint written before the list was recorded."""
    record = (payload or {}).get(START_WEIGHTS)
    entries = record.get(TRAINED_ON) if isinstance(record, dict) else None
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("data"), dict)] if isinstance(
        entries, list) else []


def start_lineage(payload: Optional[dict]) -> list[dict]:
    """The data the weights of a run checkpoint `payload` (model.pretrained of this code base, read memory-mapped)
    learned, nearest first: its own run's data.* settings and `data_fingerprint`, then its `ancestors_data`; [] for
    a file that records no run config (timm's, DeiT's, nanoGPT's, a state dict)."""
    config = (payload or {}).get("config") if isinstance(payload, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("data"), dict):
        return []
    return [{"data": config["data"], "data_fingerprint": payload.get("data_fingerprint")}, *ancestors_data(payload)]


def trains_on_other_data(saved: dict, data) -> bool:
    """Whether a run of data settings `data` (a DataConfig) trains on other data than a checkpoint whose recorded
    data.* settings are `saved`: another data set, or another of its `TRAINING_DATA_KEYS` (a key `saved` predates
    holds its default); data.root compared as the paths they resolve to."""
    if saved.get("dataset") != data.dataset:
        return True
    defaults = DataConfig()
    for key in TRAINING_DATA_KEYS.get(data.dataset, ()):
        then, now = saved.get(key, getattr(defaults, key)), getattr(data, key)
        if (os.path.realpath(str(then)) != os.path.realpath(now)) if key == "root" else then != now:
            return True
    return False


def resumed_record(payload: dict, data) -> Optional[dict]:
    """The `START_WEIGHTS` record a run resumed from the checkpoint `payload` with data settings `data` (a DataConfig)
    writes: the checkpoint's (None where it has none), and where the run trains on other data than the checkpoint
    (`trains_on_other_data`: train.allow_changed_config=true), the checkpoint's data.* and data_fingerprint first in
    its `TRAINED_ON`, marked `EARLIER_TRAINING`: the weights learned that data too, which the run's config.yaml no
    longer names, and a later val split (a resume's, a fine-tune's, evaluate.py's) must be held out from it. A
    checkpoint written before the record gets one of that list alone (nothing known of its start: `recipe_entries`
    leaves it out)."""
    record = payload.get(START_WEIGHTS)
    config = payload.get("config")
    saved = config.get("data") if isinstance(config, dict) else None
    if not isinstance(saved, dict) or not trains_on_other_data(saved, data):
        return record
    entry = {"data": saved, "data_fingerprint": payload.get("data_fingerprint"), EARLIER_TRAINING: True}
    return {**(record if isinstance(record, dict) else {}), TRAINED_ON: [entry, *ancestors_data(payload)]}


def recipe_entries(payload: Optional[dict]) -> dict:
    """The recipe keys (`start.pretrained`, `start.fingerprint`, and `start.classifier` where the record has it) of
    a checkpoint's record; {} for a checkpoint written before it (nothing known: left out of the comparison, not
    guessed), or one whose record holds the data it learned alone (`resumed_record`), or for a weights file."""
    record = (payload or {}).get(START_WEIGHTS)
    if not isinstance(record, dict) or "pretrained" not in record:  # none, or the data alone (`resumed_record`)
        return {}
    return {"start.pretrained": record.get("pretrained"), "start.fingerprint": record.get("fingerprint"),
            **({"start.classifier": record["classifier"]} if "classifier" in record else {})}


def check_start_file(payload: dict, checkpoint: str, pretrained: str, model: nn.Module) -> Optional[str]:
    """Why `model`, built now from model.pretrained=`pretrained` of the run whose best.pt is `checkpoint` (its
    `payload`), is not the start that run recorded: the file holds other weights now (overwritten, another copy
    under its name); None when it is, and when the checkpoint records no start (written before the record). The
    classifier is compared where the record has it (written since it was recorded)."""
    record = payload.get(START_WEIGHTS)
    if not isinstance(record, dict) or record.get("fingerprint") is None:
        return None
    now = start_fingerprint(model)
    if now != record["fingerprint"] and pretrained == "hub":
        return (f"model.pretrained=hub: timm's weights of model.name are not those the run of {checkpoint} started "
                f"from (fingerprint {now} now, {record['fingerprint']} recorded): another timm version or hub cache; "
                f"use the one the runs trained with")
    if now != record["fingerprint"]:
        return (f"model.pretrained={pretrained} is not the weights the run of {checkpoint} started from (fingerprint "
                f"{now} now, {record['fingerprint']} recorded: the file was replaced since); put the file the runs "
                f"started from back at that path")
    if "classifier" in record and hasattr(model, "pretrained_new_classifier"):
        head = classifier_fingerprint(model)
        if head != record["classifier"]:  # the backbone is the run's start: the classifier kept from the file is not
            return (f"model.pretrained={pretrained} holds another classifier than the run of {checkpoint} started "
                    f"from (classifier fingerprint {head} now, {record['classifier']} recorded; None: drawn anew, "
                    f"not the file's): the file was replaced since; put the file the runs started from back at that "
                    f"path")
    return None
