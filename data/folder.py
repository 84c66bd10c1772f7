"""ImageNet-style folders (`root/<split>/<class>/<image>`) through timm's ImageDataset, checked early.

A missing root, a missing split folder or a split without class folders is a clear error here rather
than an exception from inside a DataLoader worker. The classes are the split's sub-folders, each holding
its images directly: an image elsewhere or an empty class folder is an error (`check_class_folders`), as
either would change the class set silently. timm's reader also accepts a .tar per split.
"""
from __future__ import annotations

import os

from PIL import Image
from timm.data import ImageDataset


class DataError(ValueError):
    """A missing or malformed data set."""


class ClassCountError(DataError):
    """A data set with another number of classes than model.num_classes (`found`)."""

    def __init__(self, message: str, found: int):
        super().__init__(message)
        self.found = found


IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def find_split(root: str, split: str) -> str:
    """Path of `split` under `root` (a folder or a .tar); the error lists what is there."""
    if not root:
        raise DataError("data.root is empty: set it to a folder holding train/ and val/ class folders, "
                        "e.g. data.root=/datasets/imagenet (or use data.dataset=digits)")
    if not os.path.isdir(root):
        raise DataError(f"data.root '{root}' does not exist or is not a folder")
    for candidate in (os.path.join(root, split), os.path.join(root, split + ".tar")):
        if os.path.exists(candidate):
            return candidate
    raise DataError(f"no '{split}' split in {root}: found {sorted(os.listdir(root))[:10]}; set "
                    f"data.train_split / data.val_split")


class EvalImageDataset(ImageDataset):
    """An ImageDataset for evaluation: an unreadable image is reported, never replaced.

    timm's ImageDataset replaces an image it cannot decode by the next one, which a validation set must
    not do (that image would be scored, and counted, twice). Here the sample comes back as a blank image
    with the target `unreadable_target(index)` (negative), which `engine.loop.evaluate` excludes from the
    counts and reports by file name.
    """

    def __getitem__(self, index: int):
        try:
            source, target = self.reader[index][:2]
            img = Image.open(source).convert("RGB")
        except (OSError, ValueError, SyntaxError):  # PIL: truncated, garbage bytes, bad headers
            img, target = Image.new("RGB", (8, 8)), unreadable_target(index)
        return (self.transform(img) if self.transform is not None else img), target


def unreadable_target(index: int) -> int:
    """The target an evaluation dataset returns for the unreadable sample `index`: -1 - index (< 0)."""
    return -1 - index


def build_folder_dataset(root: str, split: str, transform=None, strict: bool = False) -> ImageDataset:
    """`root/split` as an ImageDataset;
    `strict`: unreadable images are reported, not replaced (evaluation)."""
    path = find_split(root, split)
    if os.path.isdir(path):
        classes = [d for d in os.scandir(path) if d.is_dir()]
        if not classes:
            raise DataError(f"{path} has no class sub-folders (expected {path}/<class>/<image>)")
        if not any(f.lower().endswith(IMG_EXTENSIONS) for c in classes[:20] for f in os.listdir(c.path)):
            raise DataError(f"the class folders in {path} hold no images ({', '.join(IMG_EXTENSIONS)})")
    dataset = (EvalImageDataset if strict else ImageDataset)(path, transform=transform)
    if len(dataset) == 0:
        raise DataError(f"{path} holds no images")
    if os.path.isdir(path):
        check_class_folders(path, dataset)
    return dataset


def class_folders(path: str) -> list[str]:
    """The class names of the split folder `path` by the rule `check_class_folders` enforces: its sub-folders
    (hidden ones, such as .ipynb_checkpoints, aside), sorted as timm numbers them."""
    from timm.utils.misc import natural_key

    return sorted((d.name for d in os.scandir(path) if d.is_dir() and not d.name.startswith(".")),
                  key=natural_key)


def check_class_folders(path: str, dataset: ImageDataset) -> None:
    """The classes of a split are its sub-folders, each holding its images directly, or a DataError.

    timm makes a class of every folder that holds an image, at any depth, and of none that holds no image:
    an image directly under the split (class ''), one in a nested or hidden folder, or an empty class
    folder would change the class set, and so the meaning of every label, without a word.
    """
    reader = dataset.reader
    names = {index: name for name, index in reader.class_to_idx.items()}
    outside = [f for f, target in reader.samples if os.path.dirname(f) != os.path.join(path, names[target])
               or names[target].startswith(".")]
    if outside:
        raise DataError(f"{path}: {len(outside)} image(s) outside a class folder, e.g. "
                        f"{', '.join(os.path.relpath(f, path) for f in outside[:3])}: images must sit "
                        f"directly in {path}/<class>/; anywhere else timm would count them as a class of "
                        f"their own. Move them into their class folder or out of {path}")
    empty = [name for name in class_folders(path) if name not in reader.class_to_idx]
    if empty:
        raise DataError(f"{path}: class folder(s) {', '.join(empty[:5])} hold no images, so they would not "
                        f"be classes and every later label would shift: add their images or remove the "
                        f"folder(s)")


def class_names(dataset) -> list[str]:
    """Class names in label order (the folder names of an ImageNet-style split)."""
    class_to_idx = getattr(getattr(dataset, "reader", None), "class_to_idx", None) or {}
    return [name for name, _ in sorted(class_to_idx.items(), key=lambda item: item[1])]


def check_same_classes(train: list[str], val: list[str], where: str) -> None:
    """Train and val splits must name the same classes in the same order, or labels mean different things."""
    if train == val:
        return
    missing, extra = sorted(set(train) - set(val)), sorted(set(val) - set(train))
    detail = (f"val lacks {missing[:5]}" if missing else "") + ("; " if missing and extra else "") + \
        (f"val has classes train lacks: {extra[:5]}" if extra else "")
    raise DataError(f"{where}: the train and val splits have different class folders "
                    f"({detail or 'other order'}); label i would name different classes. Give both splits "
                    f"the same class folders")
