"""How much each quantization detail that the CD paper leaves open moves W4A4 accuracy on one checkpoint.

Every variant is one `evaluate.py` run on the same float checkpoint, written to its own JSON in --out
(existing files are reused as evaluate.py reuses them: a variant already computed is not run again):

    official         every pipeline's default (the official code where it speaks)
    first_last=w8a8  stem and head at W8A8 in every pipeline (the QwT / RepQ-ViT lab's convention)
    calib=train      percentile / repq calibrated on training-augmented images (QwT's batch)
    gplq operands    GPLQ with float attention matmuls (q, k, v, softmax output unquantized)
    gplq lsq lr      GPLQ with the LSQ scales at lr 1e-4 instead of the weight lr
    gplq w32a4 / teacher   QwT fitted towards the stage-1 block with its activation quantizers, or the
                     original float model, instead of the fully float stage-1 block
    gplq stage2 eval QwT images with the eval transform instead of a training augmentation

`--with-aphq` adds APHQ to the variants that concern it (official, first_last=w8a8); it is the slow one
(tens of minutes per run on a CPU even at quant.aphq.iters=500).

    python scripts/quant_sensitivity.py --checkpoint runs/vit_digits/best.pt --out runs/vit_digits/sens
    python scripts/quant_sensitivity.py --checkpoint runs/vit_digits/best.pt --out runs/vit_digits/sens \
        --with-aphq quant.aphq.iters=500

Prints a markdown table (variant x pipeline, top-1 and the change from `official`) and writes
sensitivity_<bits>.json (a summary of those JSONs; an existing one is replaced only with --overwrite).
A SIGTERM / SIGINT during a GPLQ stage 1 saves it and exits 75, as evaluate.py does; the same command continues.
Extra `key=value` overrides go to every run (e.g. quant.gplq.steps=50); one of a key that a variant varies
is refused, and so is one that no run would read: the options of a pipeline that no variant runs
(quant.aphq.* without --with-aphq), and quant.pipelines / quant.bits, which the variants and --bits set.
The options of one pipeline go to the variants that run it only (evaluate.py refuses them elsewhere), and an
option that a variant's own setting switches off (quant.gplq.matmul_percentile under `gplq operands float`) is left
out of that variant, with a note line.
Every variant's command is checked as evaluate.py checks it before the first evaluation. The variants are this
command's list, not settings the user gives: one whose own setting the checkpoint cannot take (calib=train or gplq
stage2 eval on synthetic images, which no transform prepares) is skipped, with a warning line, and listed under
"skipped" in the summary. A variant whose JSON in --out holds results of other weights (an earlier run of this
command with another --checkpoint, or of a checkpoint trained again since) or its pipelines computed with other
settings (an earlier run with other overrides) is refused before the first evaluation: give --out another folder,
or move that JSON away.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import evaluate  # noqa: E402
from configs import Config, ConfigError, apply_overrides  # noqa: E402
from configs.cli import OneLineParser, first_line, passed_on_epilog  # noqa: E402
from configs.loader import READ_ONLY_WHEN, decider_keys, overlapping_keys, override_keys, unread_by_rules  # noqa: E402
from engine.checkpoint import run_checkpoint_config, weights_fingerprint  # noqa: E402
from engine.eval_results import ResultsError, settings_change  # noqa: E402
from engine.quant_settings import quant_settings  # noqa: E402
from engine.preemption import EXIT_PREEMPTED, Preempted, ignore_sigterm_until_exit  # noqa: E402
from engine.outputs import refuse_others_files, write_json  # noqa: E402
from engine.run_dir import refuse_existing_outputs  # noqa: E402
from quant.plan import planned  # noqa: E402
from quant.spec import parse_bits  # noqa: E402

ALL = ["percentile", "repq", "gplq"]
# By these --overwrite knows its own summary (engine.outputs.refuse_others_files): the keys of the JSON it writes
SOURCE = "scripts/quant_sensitivity.py"
SUMMARY_KEYS = ("checkpoint", "bits", "overrides", "top1")
APHQ_VARIANTS = ("official", "first_last=w8a8")  # the open details that apply to APHQ
VARIANTS = {
    "official": (ALL, []),
    "first_last=w8a8": (ALL, ["quant.first_last=w8a8"]),
    "calib=train": (["percentile", "repq"], ["quant.calib_transform=train"]),
    "gplq operands float": (["gplq"], ["quant.gplq.matmul_operands=false"]),
    "gplq lsq lr 1e-4": (["gplq"], ["quant.gplq.scale_lr=1e-4"]),
    "gplq qwt w32a4": (["gplq"], ["quant.gplq.qwt_target=w32a4"]),
    "gplq qwt teacher": (["gplq"], ["quant.gplq.qwt_target=teacher"]),
    "gplq stage2 eval": (["gplq"], ["quant.gplq.stage2_train_transform=false"]),
}


def run(checkpoint: str, out_dir: str, overrides: list[str], bits: str, variants: dict) -> dict:
    """{variant: {pipeline: top-1}} for every one of `variants` (`checked_variants`)."""
    table = {}
    for variant, (pipelines, extra) in variants.items():
        result = evaluate.main(variant_args(checkpoint, out_dir, overrides, bits, variant, pipelines, extra))
        table[variant] = {p: result["quant"][p][bits]["top1"] for p in pipelines}
    return table


def variant_args(checkpoint: str, out_dir: str, overrides: list[str], bits: str, variant: str,
                 pipelines: list[str], extra: list[str]):
    """evaluate.py's arguments for `variant` running `pipelines` with its settings `extra`, into its own JSON in
    `out_dir`. The overrides come before --bits and --quant, whose lists (nargs="*") would take a word of theirs."""
    path = os.path.join(out_dir, variant.replace(" ", "_").replace("=", "-") + ".json")
    return evaluate.parse_args(["--checkpoint", checkpoint, "--out", path,
                                *variant_overrides(overrides, pipelines, extra), *extra, "--bits", bits,
                                "--quant", *pipelines])


def checked_variants(checkpoint: str, out_dir: str, overrides: list[str], bits: str,
                     with_aphq: bool) -> tuple[dict, dict]:
    """({variant: (pipelines, its settings)} to run, {variant: why it is skipped}), every variant's command checked
    as evaluate.py checks it, before the first evaluation. The variants are this command's list, not the user's
    ask: one whose own setting this checkpoint cannot take (calib=train or gplq stage2 eval on synthetic
    images, which no transform prepares) is skipped. Any other refusal (of the overrides given) is raised, and so
    is a variant whose JSON in --out holds its pipelines computed with other settings (`refuse_other_settings`). A
    checkpoint that is not one of train.py is left to evaluate.py's own refusal."""
    variants = {v: ([*pipelines, "aphq"] if with_aphq and v in APHQ_VARIANTS else pipelines, extra)
                for v, (pipelines, extra) in VARIANTS.items()}
    if not os.path.isfile(checkpoint) or run_checkpoint_config(checkpoint) is None:
        return variants, {}
    skipped, printed = {}, {}
    for variant, (pipelines, extra) in list(variants.items()):
        args = variant_args(checkpoint, out_dir, overrides, bits, variant, pipelines, extra)
        try:
            cfg, payload = evaluate.resolve_config(args)
        except ConfigError as e:
            if not extra:
                raise
            # refused without the variant's own setting too: the overrides given are what is refused
            evaluate.resolve_config(variant_args(checkpoint, out_dir, overrides, bits, variant, pipelines, []))
            skipped[variant] = f"evaluate.py refuses its {' '.join(extra)} for {checkpoint} ({e})"
            del variants[variant]
            continue
        refuse_other_settings(args.out, cfg, variant, out_dir, checkpoint,
                              lambda: weights_print(printed, cfg, payload, args))
    return variants, skipped


def weights_print(cache: dict, cfg, payload, args) -> str:
    """The fingerprint evaluate.py records of the checkpoint's weights (every variant's), computed once into
    `cache`: the float model is built only for a result file that records one."""
    if "fingerprint" not in cache:
        cache["fingerprint"] = weights_fingerprint(evaluate.load_float_model(cfg, payload, args).state_dict())
    return cache["fingerprint"]


def refuse_other_settings(path: str, cfg, variant: str, out_dir: str, checkpoint: str, fingerprint) -> None:
    """A ResultsError when the variant's JSON holds results of other weights (`other_weights`: an earlier run of
    this command into the same --out with another --checkpoint, or a checkpoint trained again in place), or one of
    its (pipeline, bits) computed with other settings than `cfg` (its resolved config) gives: a setting changed
    since an earlier run into the same --out. evaluate.py would refuse it only once the variants before it were
    computed, offering its own fixes (--recompute, another --out file: the file names are this command's), which
    this command has not. A file evaluate.py cannot read is left to it."""
    try:
        with open(path) as f:
            data = json.load(f)
        quant = data["quant"]
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or not a result file
        return
    other = other_weights(data, checkpoint, fingerprint)
    if other:
        raise ResultsError(f"{path} holds results of another evaluation ({other}) by an earlier run of this command "
                           f"into --out {out_dir}: give --out another folder, or move {path} away")
    for pipeline, bits in planned(cfg):
        entries = quant.get(pipeline) if isinstance(quant, dict) else None
        entry = entries.get(bits) if isinstance(entries, dict) else None
        change = (settings_change(entry, quant_settings(cfg, pipeline), pipeline, bits=bits) if isinstance(entry, dict)
                  else None)
        if change is not None:
            raise ResultsError(f"{path} holds {pipeline} {bits} of variant '{variant}' computed with other settings "
                               f"({change}) by an earlier run of this command into --out {out_dir}: give --out "
                               f"another folder, or move {path} away to compute the variant again")


def other_weights(data: dict, checkpoint: str, fingerprint) -> str:
    """'field: file's value in the file, ours now' for each of the result file `data`'s checkpoint, weights (raw:
    the command evaluates no EMA) and fingerprint that is not those of `checkpoint`, as evaluate.py's identity
    records them ('' when none differs; a field the file lacks is left to evaluate.py). `fingerprint`: () -> the
    weights' fingerprint, called only when the file records one."""
    now = {"checkpoint": lambda: os.path.abspath(checkpoint), "weights": lambda: "raw", "fingerprint": fingerprint}
    differ = [(key, data[key], value()) for key, value in now.items() if key in data]
    return "; ".join(f"{key}: {then!r} in the file, {value!r} now" for key, then, value in differ if then != value)


def refuse_variant_keys(overrides: list[str]) -> None:
    """An override for every run of a key that a variant sets would make `official` that variant (and the
    variant's change +0.00): the table would compare a setting with itself under the names of two."""
    variant_keys = {k for _, extra in VARIANTS.values() for o in extra for k in override_keys(o)}
    for item in overrides:
        keys = overlapping_keys(item, sorted(variant_keys))
        if keys:
            raise ConfigError(f"{item} sets {keys[0]}, which a variant varies ({', '.join(sorted(variant_keys))}): "
                              "the 'official' row would be computed with it; drop it (evaluate.py --out runs one "
                              "setting on its own)")


def refuse_language_model(checkpoint: str) -> None:
    """The variants run the image pipelines (percentile, repq, gplq, aphq): a language model's checkpoint was
    refused by evaluate.py as a bad quant.pipelines, a setting the user never gave; say what the command is for."""
    config = run_checkpoint_config(checkpoint) if os.path.isfile(checkpoint) else None  # its config, no tensors
    if config is None:  # missing, or not a checkpoint of train.py: evaluate.py's refusal says what is wrong with it
        return
    dataset = (config.get("data") or {}).get("dataset", "folder")
    if evaluate.task_for(dataset).language:
        raise ConfigError(f"{checkpoint} is a language model (data.dataset={dataset}): quant_sensitivity.py varies "
                          "the W4A4 details of the image pipelines (percentile, repq, gplq, aphq); evaluate it with "
                          f"evaluate.py --checkpoint {checkpoint} --quant rtn gptq smoothquant smoothquant_strict "
                          "and their quant.<pipeline>.* options")


def pipelines_run(with_aphq: bool) -> set[str]:
    """The pipelines that some variant runs (APHQ only with --with-aphq)."""
    return {p for pipelines, _ in VARIANTS.values() for p in pipelines} | ({"aphq"} if with_aphq else set())


# what a run would do with quant.pipelines / quant.bits: the command sets them itself
SET_BY_COMMAND = {"quant.pipelines": "drop it (--with-aphq adds APHQ)", "quant.bits": "give --bits instead"}


def refuse_unread_keys(overrides: list[str], with_aphq: bool) -> None:
    """An override that no run reads would be recorded in the summary as a setting of results computed
    without it: a pipeline's options (quant.<pipeline>.*) where no variant runs that pipeline, and the keys
    that the command sets itself. An override of one pipeline's options goes to the variants that run it
    (`variant_overrides`), so it must set nothing else."""
    ran = sorted(pipelines_run(with_aphq))
    for item in overrides:
        for key in override_keys(item):
            if key in SET_BY_COMMAND:
                raise ConfigError(f"{item}: the variants and --bits set {key}; {SET_BY_COMMAND[key]}")
    for item, pipeline in evaluate.pipeline_options_unread(overrides, ran):
        fix = "add --with-aphq to run APHQ" if pipeline == "aphq" else f"drop it (the variants run {', '.join(ran)})"
        raise ConfigError(f"{item}: no run of this command quantizes with {pipeline}, so the override would be "
                          f"ignored; {fix}")
    for item in overrides:  # quant={gplq: {steps: 50}, calib_images: 64}: a variant would read half of it
        sections = {tuple(key.split(".")[:2]) for key in override_keys(item)}
        if evaluate.pipeline_options_unread([item], []) and len(sections) > 1:
            raise ConfigError(f"{item}: give the options of a pipeline as overrides of their own (quant.<pipeline>"
                              ".<option>=...): they go to the variants that run that pipeline only")


def variant_overrides(overrides: list[str], pipelines: list[str], extra: Sequence[str] = ()) -> list[str]:
    """The overrides a variant running `pipelines` with its settings `extra` reads: all but the options of the
    pipelines it does not run, the calibration batch's where none of them reads it (evaluate.py refuses those; the
    `calib=train` variant runs no GPLQ, and GPLQ on a classifier draws its own images, for example), and the
    options that the variant's own switch leaves unread (`switched_off`)."""
    unread = {item for item, _ in evaluate.pipeline_options_unread(overrides, pipelines)}
    unread |= set(evaluate.calibration_overrides_unread(overrides, pipelines, language=False))
    unread |= set(switched_off(overrides, extra))
    return [o for o in overrides if o not in unread]


def switched_off(overrides: list[str], extra: Sequence[str]) -> list[str]:
    """The overrides whose every key the variant's settings `extra` leave unread by a rule that they alone decide
    (configs/loader.py READ_ONLY_WHEN): quant.gplq.matmul_percentile under the `gplq operands float` variant's
    quant.gplq.matmul_operands=false. An option for every GPLQ run has no meaning in the variant that switches it
    off, and evaluate.py would refuse the pair; the variant runs without it (`main` says so)."""
    return [item for item in overrides if override_keys(item) and
            switched_off_keys(item, extra) == set(override_keys(item))]


def switched_off_keys(item: str, extra: Sequence[str]) -> set[str]:
    """The keys of the override `item` that the variant's settings `extra` leave unread by a rule they alone decide."""
    own = {key for setting in extra for key in override_keys(setting)}
    rules = [rule for rule in READ_ONLY_WHEN if set(decider_keys(rule[1])) <= own]
    if not rules or not override_keys(item):
        return set()
    cfg = apply_overrides(Config(), extra)
    return {key for key, *_ in unread_by_rules(cfg, override_keys(item), rules)}


def refuse_partly_switched_off(overrides: list[str]) -> None:
    """A section override (quant.gplq={matmul_percentile: 0.999, steps: 50}) of which a variant's own switch leaves
    some keys unread and reads the others can be neither dropped from that variant nor given to it whole (evaluate.py
    refuses the unread key): refused, naming the keys to give as overrides of their own."""
    for variant, (_, extra) in VARIANTS.items():
        for item in overrides:
            unread = switched_off_keys(item, extra)
            if unread and unread != set(override_keys(item)):
                raise ConfigError(f"{item}: the '{variant}' variant's {' '.join(extra)} leaves "
                                  f"{', '.join(sorted(unread))} unread and reads the rest; give "
                                  f"{', '.join(sorted(unread))} as an override of its own (key=value), which that "
                                  "variant runs without")


def markdown(table: dict, bits: str) -> str:
    base = table["official"]
    columns = ALL + [p for p in base if p not in ALL]
    lines = [f"| variant ({bits}) | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for variant, row in table.items():
        cells = []
        for p in columns:
            if p not in row:
                cells.append("")
            elif variant == "official":
                cells.append(f"{row[p]:.2f}")
            else:
                # the change of the two figures printed: of the unrounded top-1s it could differ from it by 0.01
                cells.append(f"{row[p]:.2f} ({float(f'{row[p]:.2f}') - float(f'{base[p]:.2f}'):+.2f})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = OneLineParser(description=first_line(__doc__))
    parser.add_argument("--checkpoint", required=True, help="best.pt written by train.py")
    parser.add_argument("--out", required=True, help="folder for the per-variant JSONs and the summary")
    parser.add_argument("--bits", default="w4a4",
                        help="the one bit-width every variant is evaluated at, e.g. w4a4 or w3a3 (default: w4a4); "
                             "the summary is sensitivity_<bits>.json")
    parser.add_argument("--with-aphq", action="store_true", help="also APHQ (official, first_last=w8a8)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    parser.add_argument("--overwrite", action="store_true", help="replace the summary JSON this script wrote in --out")
    parser.epilog = passed_on_epilog(parser, evaluate.build_parser(), "evaluate.py")
    args = parser.parse_args(argv)
    try:  # a usage error (status 2), as argparse's, not evaluate.py's refusal of the first variant's quant.bits
        # evaluate.py's name of the bit-width, the key of its results: the parsed form (quant/plan.py), so w04a4 or
        # "W4A4 " is w4a4 there, which lowercasing alone missed
        args.bits = str(parse_bits(args.bits))
    except ValueError as e:
        parser.error(f"--bits {args.bits}: {e}")
    word = next((o for o in args.overrides if "=" not in o), None)
    if word is not None:  # `--bits w4a4 w3a3`: w3a3 lands here, and evaluate.py's --bits list would take it
        parser.error(f"{word!r} is not a key=value override; --bits takes one bit-width per invocation: run the "
                     f"script once for each bit-width")
    refuse_variant_keys(args.overrides)
    refuse_unread_keys(args.overrides, args.with_aphq)
    refuse_partly_switched_off(args.overrides)
    refuse_language_model(args.checkpoint)
    summary = os.path.join(args.out, f"sensitivity_{args.bits}.json")
    refuse_existing_outputs([summary], args.overwrite)  # before the variants' evaluations
    if args.overwrite:  # a JSON of another's at this fixed name is not this script's to replace
        refuse_others_files([summary], SOURCE, json_keys=SUMMARY_KEYS)
    variants, skipped = checked_variants(args.checkpoint, args.out, args.overrides, args.bits, args.with_aphq)
    for variant, why in skipped.items():
        print(f"warning: variant '{variant}' skipped: {why}", file=sys.stderr)
    for variant, (_, extra) in variants.items():
        for item in switched_off(args.overrides, extra):
            print(f"note: variant '{variant}' runs without {item}, which its {' '.join(extra)} leaves unread",
                  file=sys.stderr)
    table = run(args.checkpoint, args.out, args.overrides, args.bits, variants)
    print(markdown(table, args.bits))
    # never over a summary another command wrote since this one started (RunDirError: one error line)
    if args.overwrite:  # nor over another's that another command put there meanwhile
        refuse_others_files([summary], SOURCE, json_keys=SUMMARY_KEYS)
    write_json(summary, {"checkpoint": os.path.abspath(args.checkpoint), "bits": args.bits,
                         "overrides": args.overrides, "top1": table, **({"skipped": skipped} if skipped else {})},
               args.overwrite, indent=1)
    return table


if __name__ == "__main__":
    try:
        main()
    except evaluate.USER_ERRORS as e:
        sys.exit(f"error: {e}")
    except Preempted:  # a signal in a GPLQ stage 1 (logged); its checkpoint and the variants done so far are kept
        ignore_sigterm_until_exit()  # as evaluate.py: under torchrun every rank exits 75, none -15
        sys.exit(EXIT_PREEMPTED)
