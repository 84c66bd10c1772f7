"""What one COCO annotation file lists, against what a detection config reads it with: its images against the
loader's image folder, its categories against the config's classes. Functions of the parsed file only: each file
is read once, whole, by data_checks.check_annotations, which turns their findings into one error line."""
from __future__ import annotations

import os
from collections import Counter
from typing import List, Optional, Sequence


def missing_images(images: Sequence[dict], folder: str) -> List[str]:
    """The file_name of each of `images` (an annotation file's images[]) that is no file under `folder`, where
    MMDetection's CocoDataset reads it (data_prefix.img joined with file_name), in the file's order.

    The folder is listed once and a name is looked up in that listing: only a name not found there (one in a
    subfolder, an absolute path, another case on a case-insensitive disk) costs a stat of its own. For train2017's
    118,287 names in a folder of as many files (local disk, warm cache) that took 0.25-0.30 s on a 2-core AMD EPYC
    VM, a stat per name 0.90-0.97 s (docs/measurements.md); the sample's 16 names about 60 us."""
    present = set()
    if os.path.isdir(folder):
        with os.scandir(folder) as entries:
            # is_file() follows a symlink (a broken one is no image) and needs no stat for a plain file
            present = {entry.name for entry in entries if entry.is_file()}
    names = [str(image["file_name"]) for image in images]
    return [name for name in names if name not in present and not os.path.isfile(os.path.join(folder, name))]


def label_names(categories: Sequence[dict], classes: Sequence[str]) -> List[str]:
    """The class each label means where MMDetection's CocoDataset and CocoMetric read a file with `categories`
    for the config's `classes`: label i is the i-th of the FILE's categories whose name is a class (pycocotools'
    getCatIds keeps the file's order), which is classes[i] only where the file lists them in that order."""
    return [str(c.get("name")) for c in categories if c.get("name") in classes]


def dropped_objects(categories: Sequence[dict], annotations: Sequence[dict], classes: Sequence[str]) -> dict:
    """{category shown: count} of the `annotations` whose category is none of the config's `classes`, which
    MMDetection's CocoDataset drops while it reads the file (neither trained on nor scored), in the order of the
    file's categories; an id the file does not list as a category is shown as `category_id N` (not listed)."""
    names = {c.get("id"): str(c.get("name")) for c in categories}
    kept = {c.get("id") for c in categories if c.get("name") in classes}
    counts = Counter(a["category_id"] for a in annotations if a["category_id"] not in kept)
    order = [i for i in names if i in counts] + sorted((i for i in counts if i not in names), key=str)
    return {names[i] if i in names else f"category_id {i} (not listed)": counts[i] for i in order}


def _shown(names: Sequence[str], most: int = 6) -> str:
    """The first `most` of `names` for an error line (COCO has 80 categories)."""
    return ", ".join(names[:most]) + (" ..." if len(names) > most else "")


def category_problems(categories: Sequence[dict], annotations: Sequence[dict],
                      classes: Sequence[str]) -> Optional[str]:
    """What is wrong with a file of `categories` and `annotations` for the config's `classes` (to follow "{file},
    which "), or None when MMDetection reads it as the config means: each label i holds the objects of classes[i]
    (`label_names`) and no object is dropped (`dropped_objects`; a category of no object drops nothing)."""
    names = label_names(categories, classes)
    listed = _shown([str(c.get("name")) for c in categories])
    if not names:
        return f"has none of the config's classes ({', '.join(classes)}); its categories are {listed}"
    absent = [c for c in classes if c not in names]
    # a file naming a class twice numbers more labels than the config has classes
    meant = list(classes) + ["no class of the config"] * max(0, len(names) - len(classes))
    swapped = [f"label {i} ({meant[i]}) would hold {name}'s objects" for i, name in enumerate(names)
               if name != meant[i]]
    dropped = dropped_objects(categories, annotations, classes)
    if not (absent or swapped or dropped):
        return None
    problems = ([f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not among them"] if absent else [])
    problems += swapped
    if dropped:
        shown = [f"{count} object{'' if count == 1 else 's'} of {name}" for name, count in dropped.items()]
        problems.append(f"{_shown(shown)} would be dropped")
    why = ((["MMDetection numbers the config's classes in the file's order"] if absent or swapped else []) +
           (["its CocoDataset drops the objects of other categories"] if dropped else []))
    return (f"lists the categories {listed} where the config's classes are {', '.join(classes)}: "
            f"{'; '.join(problems)} ({'; '.join(why)})")
