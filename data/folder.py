"""ImageNet-style folders (`root/<split>/<class>/<image>`) through timm's ImageDataset, checked early.

A missing root, a missing split folder (or a link to one), a class folder that is a link to nothing or a split
without class folders is a clear error here rather than an exception from inside a DataLoader worker (or a class
that drops out without a word). The classes are the split's sub-folders, each holding its images directly: an
image elsewhere, an empty class folder or two class folders that are one (a link to the other) is an error
(`check_class_folders`), as each would change the classes silently. timm's reader also accepts a .tar per split,
checked by the same rules: its class folders are the tar's top-level folders, or the class tars it holds
(ImageNet's train tar), below the folders all its images share, if any (`tar cf train.tar train/` stores
train/<class>/<image>).

The images are exactly the files timm's reader reads (its extensions, `read_extensions`): what is checked,
counted and reported is what is read. An image file that timm would skip without a word (a .webp, .bmp,
.tif, ... that PIL could open) is refused with its name (`check_skipped_images`).

Every per-sample failure is handled one way (`ImageFolderDataset`): whatever PIL raises while reading or
decoding an image (a truncated file, garbage bytes, its decompression-bomb limit, ...), the sample comes
back as a blank image with a negative target, `unreadable_target(index)`; the evaluation leaves it out,
the training loop replaces it by another image of its batch, and both name and count it (engine/loop.py).
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import tarfile
import unicodedata
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageFile
from timm.data import ImageDataset
from timm.data.readers.img_extensions import get_img_extensions


class DataError(ValueError):
    """A missing or malformed data set."""


class ClassCountError(DataError):
    """A data set with another number of classes than model.num_classes (`found`)."""

    def __init__(self, message: str, found: int):
        super().__init__(message)
        self.found = found


def read_extensions() -> tuple[str, ...]:
    """The file extensions timm's folder and tar readers read (lower case; timm compares `ext.lower()`)."""
    return tuple(get_img_extensions())


def skipped_image_extensions() -> frozenset[str]:
    """Extensions of images PIL can open that timm's readers skip (.webp, .bmp, .tif, ...); PIL's stub
    formats (HDF5, GRIB, WMF, ...), which it cannot decode by itself, are not images here."""
    def decodes(factory) -> bool:  # a plugin class, or a factory function (JPEG's)
        return not (isinstance(factory, type) and issubclass(factory, ImageFile.StubImageFile))

    openable = {ext for ext, fmt in Image.registered_extensions().items()
                if fmt in Image.OPEN and decodes(Image.OPEN[fmt][0])}
    return frozenset(openable - set(read_extensions()))


def check_skipped_images(path: str) -> None:
    """Refuse a split (folder or .tar) holding images that timm's reader would skip without a word: the
    counts, the class checks and the evaluation would silently be of fewer images than the folder holds."""
    skipped_ext = skipped_image_extensions()
    if os.path.isdir(path):
        names = [os.path.relpath(os.path.join(folder, f), path)
                 for folder, _, files in os.walk(path, followlinks=True)  # as timm walks it
                 for f in files if os.path.splitext(f)[1].lower() in skipped_ext]
    else:
        names = [n for n in tar_file_names(path) if os.path.splitext(n)[1].lower() in skipped_ext]
    if names:
        names.sort()
        raise DataError(f"{path}: {len(names)} image file(s) that timm's reader skips (it reads only "
                        f"{', '.join(read_extensions())}), e.g. {', '.join(names[:3])}: they would be left out "
                        f"of every count and score without a word. Convert them to .png or .jpg, or move "
                        f"them out of {path}")


def tar_file_names(path: str):
    """The names of the files in the tar `path` as timm's tar reader sees them, lazily: its members, and for a member
    .tar (ImageNet's train tar holds one tar per class) the files in that, as `<member>.tar/<name>` (timm reads
    one level of tars within the tar)."""
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            if os.path.splitext(member.name)[1].lower() != ".tar":
                yield member.name
                continue
            inner_file = tar.extractfile(member)
            check_uncompressed_tar(path, inner_file, f"{path}/{member.name}")
            inner_file.seek(0)
            with tarfile.open(fileobj=inner_file, mode="r:") as inner:
                yield from (f"{member.name}/{m.name}" for m in inner if m.isfile())


def find_split(root: str, split: str) -> str:
    """Path of `split` under `root` (a folder or a .tar); the error lists what is there."""
    if not root:
        raise DataError("data.root is empty: set it to a folder holding train/ and val/ class folders, "
                        "e.g. data.root=/datasets/imagenet (or use data.dataset=digits)")
    if not os.path.isdir(root):
        # name the fix, not only the fault: the newcomer's typical case is a path copied from the docs
        raise DataError(f"data.root '{root}' does not exist or is not a folder: set data.root to the folder that "
                        f"holds the {split}/ class folders (<split>/<class>/<image>), or use "
                        f"data.dataset=digits for the embedded set")
    if os.path.normpath(os.path.join(root, split)) == os.path.normpath(root):  # "", ".", "./": root's own folders
        raise DataError(f"the split name {split!r} names data.root itself, whose folders would be the classes: set "
                        f"data.train_split / data.val_split to the sub-folder of {root} that holds the class folders")
    folder, tar = os.path.join(root, split), os.path.join(root, split + ".tar")
    if os.path.exists(folder) and os.path.exists(tar):  # timm's reader would take the folder, without a word
        raise DataError(f"{root} holds both {folder} and {tar} for the '{split}' split: rename or remove one of them, "
                        f"so that the images read are not a guess")
    for candidate in (folder, tar):
        if os.path.exists(candidate):
            check_split_kind(candidate)
            return candidate
    for candidate in (os.path.join(root, split), os.path.join(root, split + ".tar")):
        check_link_target(candidate)  # listed by the error below, yet not there: name what is missing
    raise DataError(f"no '{split}' split in {root}: found {sorted(os.listdir(root))[:10]}; set "
                    f"data.train_split / data.val_split")


def check_link_target(path: str, meant: str = "the split's folder or .tar") -> None:
    """A split `path` (or a class folder: `meant` names what the link should lead to) that is a symbolic link to
    nothing (a moved data set, an unmounted disk) is a DataError naming the link's target; anything else passes."""
    if not os.path.islink(path) or os.path.exists(path):
        return
    target, end = os.readlink(path), os.path.realpath(path)
    via = "" if end == target else f", which leads to {end}"  # a relative target, or a chain of links
    raise DataError(f"{path} is a symbolic link to {target}{via}, which does not exist: mount or restore it, or "
                    f"point the link at {meant}")


def split_sub_folders(path: str) -> list[os.DirEntry]:
    """The sub-folders of the split folder `path` (links to folders count, as timm's walk follows them). An entry
    that is a symbolic link to nothing (`check_link_target`), such as a class folder on a disk no longer mounted, is
    a DataError: it is no folder to os.scandir or to timm's walk, so its class would drop out of the class set (and
    the class count a run is advised to set) without a word. Hidden entries are no classes and are not checked."""
    entries = list(os.scandir(path))
    for entry in entries:
        if not entry.name.startswith("."):
            # a dangling link's name cannot tell a class from another file (a metadata .csv beside the classes)
            check_link_target(entry.path, "the class's folder; or remove it if it was no class folder")
    return [entry for entry in entries if entry.is_dir()]


def check_split_kind(path: str) -> None:
    """A split is a folder or a .tar archive, as timm's reader takes them (a .tar by its extension, anything
    else as a folder): any other file would reach tarfile's or timm's own errors, or read as no images."""
    if os.path.isdir(path):
        return
    if path.endswith(".tar"):
        check_uncompressed_tar(path)
        return
    raise DataError(f"{path} is a file, not a folder: a split is a folder of class folders (<split>/<class>/<image>) "
                    f"or a <split>.tar of them; point data.root / data.train_split / data.val_split at one")


# the leading bytes of the compressed files tarfile's auto-detection opens, and the tool that undoes each
COMPRESSIONS = ((b"\x1f\x8b", "gzip", "gunzip"), (b"BZh", "bzip2", "bunzip2"),
                (b"\xfd7zXZ\x00", "xz", "unxz"), (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"))


def check_uncompressed_tar(path: str, fileobj=None, name: str = "") -> None:
    """Refuse the split's tar `path`, or the class tar `fileobj` (its member `name`), unless it is an uncompressed tar,
    as timm's reader reads both (mode 'r|', no decompression): tarfile.is_tarfile and tarfile.open's default mode see
    through gzip, bzip2 and xz, so a `tar czf` archive would pass here and fail in timm's reader ('invalid header')."""
    try:
        with tarfile.open(None if fileobj is not None else path, "r:", fileobj=fileobj):
            return
    except tarfile.ReadError:
        pass
    if fileobj is None:
        with open(path, "rb") as f:
            head = f.read(8)
    else:
        fileobj.seek(0)
        head = fileobj.read(8)
    compressed = next(((kind, tool) for magic, kind, tool in COMPRESSIONS if head.startswith(magic)), None)
    if fileobj is not None:  # timm opens every .tar member of a split's tar as a class tar
        what = f"a {compressed[0]}-compressed tar" if compressed else "not a tar archive"
        raise DataError(f"{name} is {what}, while timm's reader reads each .tar in {path} as a class tar, uncompressed "
                        f"(<class>.tar of images): pack it again with `tar cf` (no z, j, J or --zstd), or take it out "
                        f"of {path}")
    if compressed is None:
        raise DataError(f"{path} is not a tar archive: a split is a folder of class folders (<split>/<class>/<image>) "
                        f"or a <split>.tar of them; point data.root / data.train_split / data.val_split at one")
    kind, tool = compressed
    raise DataError(f"{path} is a {kind}-compressed tar: timm's reader reads uncompressed tars only (it would fail on "
                    f"it with 'invalid header'); decompress it (`{tool} -c {path} > plain.tar`, then put plain.tar in "
                    f"its place) or pack it again with `tar cf` (no z, j, J or --zstd)")


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB of `img`. PIL's convert("RGB") clips 16-bit grayscale (mode I;16, a 16-bit PNG) to 0..255,
    which turns nearly every pixel white: its values are scaled to 8 bits instead (65535 -> 255). Pillow
    before 10.3 opens a 16-bit grayscale PNG as mode I, scaled the same way (a PNG holds at most 16 bits per
    sample). Other 32-bit integer and float pixels (modes I and F, e.g. a TIFF) carry no range to scale from:
    refused (ValueError), so the file is marked unreadable and named, never read as a guess."""
    if img.mode.startswith("I;16") or (img.mode == "I" and img.format == "PNG"):
        pixels = np.asarray(img).astype(np.float64) / 257.0
        return Image.fromarray(np.rint(pixels).astype(np.uint8)).convert("RGB")
    if img.mode in ("I", "F"):
        raise ValueError(f"{img.mode}-mode pixels (32-bit integer or float) have no 8-bit range to map to")
    return img.convert("RGB")


class ImageFolderDataset(ImageDataset):
    """An ImageDataset whose unreadable images are marked, never silently replaced or fatal.

    timm's ImageDataset replaces an image it cannot decode by the next one (uncounted; twice-scored in an
    evaluation) and lets any error other than OSError end the run from inside a DataLoader worker (PIL's
    DecompressionBombError, SyntaxError, ValueError, struct.error, ...). Here any exception while reading
    or decoding sample `index` gives a blank image with the target `unreadable_target(index)` (negative);
    engine/loop.py leaves it out of evaluations and replaces it in training batches, naming and counting
    it in both. The transform's own errors are not caught: they are bugs or settings, not a bad file.

    A folder's images that timm's natural-key order ties are put in the order of their names (`ties_in_name_order`);
    `moved_ties` counts those that take another place than the listing gave them (engine/resume.py note_moved_ties).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        samples, self.moved_ties = self.reader.samples, 0
        # a folder's (path, target) list; a .tar's samples (an array of members) tie in the tar's order, every copy's
        if isinstance(samples, list) and samples and isinstance(samples[0][0], str):
            self.reader.samples = ties_in_name_order(samples)
            self.moved_ties = sum(a is not b for a, b in zip(samples, self.reader.samples))

    def __getitem__(self, index: int):
        source = None
        try:
            source, target = self.reader[index][:2]
            with Image.open(source) as opened:
                img = to_rgb(opened)  # decodes the pixels: truncated data fails here, not later
        except Exception:  # noqa: BLE001 - whatever PIL raises for this one file, handled one way
            img, target = Image.new("RGB", (8, 8)), unreadable_target(index)
        finally:
            if hasattr(source, "close"):
                source.close()  # the reader opened it; PIL closes only the files it opened itself
        return (self.transform(img) if self.transform is not None else img), target


def ties_in_name_order(samples: list) -> list:
    """timm's (path, target) `samples` of a folder, sorted by natural_key, with each run of paths that natural_key
    ties (1.png and 01.png, x.png and X.png: lower case, numbers as numbers) in the order of the paths themselves.
    timm leaves a tie in the order of the directory listing, which another copy of the folder may change (ext4's
    follows its hash seed): index i would be another image on another node, or after a copy, while the sorted names
    of `folder_fingerprint` agree. A tie's paths are adjacent, and equal once lower-cased with their zeros taken out,
    which is checked first: natural_key is computed for those pairs only, not again for every image. A tie through
    leading zeros of another script's digits than ASCII's is left in timm's order."""
    from timm.utils.misc import natural_key

    def tied(a: str, b: str) -> bool:
        return a.lower().replace("0", "") == b.lower().replace("0", "") and natural_key(a) == natural_key(b)

    ordered, start = list(samples), 0
    for end in range(1, len(ordered) + 1):
        if end == len(ordered) or not tied(ordered[end - 1][0], ordered[end][0]):
            if end - start > 1:
                ordered[start:end] = sorted(ordered[start:end], key=lambda sample: sample[0])
            start = end
    return ordered


def unreadable_target(index: int) -> int:
    """The target a folder data set returns for the unreadable sample `index`: -1 - index (< 0)."""
    return -1 - index


def unreadable_replacer(dataset: ImageDataset):
    """(images, targets) -> (images, targets, names) for training batches of `dataset`: every sample it
    marked unreadable (`unreadable_target`) is replaced by a readable sample of the same batch (taken in
    turn), as timm replaces one by the next file, but named (absolute paths) for the caller to log and
    count. A batch without a single readable image is a DataError: that is a lost mount or a folder
    without read permission, not a bad file, unless it holds a few files several times (repeated augmentation),
    which the error names once each, as bad files to remove or repair."""
    def replace(images, targets):
        bad = targets < 0
        if not bad.any():
            return images, targets, []
        names = [dataset.filename(-1 - int(t), absolute=True) for t in targets[bad]]
        good, replaced = (~bad).nonzero().flatten(), bad.nonzero().flatten()
        if len(good) == 0:
            distinct = list(dict.fromkeys(names))  # repeated augmentation puts an image's repeats side by side
            shown = ", ".join(distinct[:3]) + (", ..." if len(distinct) > 3 else "")
            if len(distinct) < len(names):  # a few bad files read again and again, not a lost mount
                raise DataError(f"none of the {len(names)} images of a training batch could be read: they are "
                                f"{len(distinct)} distinct file(s), read {len(names)} times in all by repeated "
                                f"augmentation (data.repeated_aug): {shown}; remove or repair "
                                f"{'it' if len(distinct) == 1 else 'them'}")
            raise DataError(f"none of the {len(names)} images of a training batch could be read (e.g. {shown}): "
                            "check that the files are there and readable")
        source = good[torch.arange(len(replaced), device=good.device) % len(good)]
        images, targets = images.clone(), targets.clone()
        images[replaced], targets[replaced] = images[source], targets[source]
        return images, targets, names
    return replace


def build_folder_dataset(root: str, split: str, transform=None) -> ImageDataset:
    """`root/split` as an ImageFolderDataset (unreadable images marked, see its docstring)."""
    path = find_split(root, split)
    if os.path.isdir(path):
        classes = split_sub_folders(path)
        if not classes:
            raise DataError(f"{path} has no class sub-folders (expected {path}/<class>/<image>)")
    check_skipped_images(path)
    extensions = read_extensions()
    if os.path.isdir(path):
        if not any(f.lower().endswith(extensions) for c in classes[:20] for f in os.listdir(c.path)):
            raise DataError(f"the class folders in {path} hold no images ({', '.join(extensions)})")
    else:  # timm's tar reader fails on an archive without images with a bare 'not enough values to unpack'
        # stops at the first image, usually the first member (of the first class tar)
        if not any(n.lower().endswith(extensions) for n in tar_file_names(path)):
            raise DataError(f"{path} holds no images ({', '.join(extensions)})")
    dataset = ImageFolderDataset(path, transform=transform)
    if len(dataset) == 0:
        raise DataError(f"{path} holds no images")
    check_class_folders(path, dataset)
    return dataset


def folder_fingerprint(dataset: ImageDataset) -> dict:
    """What tells one split's images from another's wherever its folder lies (data.root may move between
    machines): the number of images and the SHA-256 of their sorted names relative to the split (class folder and
    file name; in a .tar, the member's name after the class tar holding it, if any), the images a resumed run must
    find again. Sorted by the names themselves, as the records of earlier runs are (the data set's own order, timm's
    natural-key order with ties in name order, `ties_in_name_order`, follows from the same names). Files replaced
    under the same names are not told apart: reading every image would cost minutes on ImageNet."""
    reader = dataset.reader
    if hasattr(reader, "root") and isinstance(reader.samples[0][0], str):  # a folder: absolute paths under root
        prefix = os.path.join(reader.root, "")  # os.walk joins onto root as given, trailing separator or not
        # sliced, not os.path.relpath: 0.7 s against 28 s for ImageNet's 1.28 M training images
        names = [path[len(prefix):] for path, _ in reader.samples]
    else:  # a .tar (timm's ReaderImageInTar): (member, tar file, class tar member) per image
        names = ["/".join(part for part in (tar_file, inner.name if inner else None, member.name) if part)
                 for member, tar_file, inner in reader.samples]
    # surrogateescape: a name the locale cannot decode is hashed as its bytes on disk, under any locale
    text = "\n".join(sorted(names)).encode("utf-8", "surrogateescape")
    return {"images": len(names), "names_sha256": hashlib.sha256(text).hexdigest()}


def class_folders(path: str) -> list[str]:
    """The class names of the split `path` by the rule `check_class_folders` enforces, sorted as timm numbers them:
    a folder's sub-folders (`split_sub_folders`: a link to nothing among them is an error), a .tar's top-level
    folders and the class tars it holds (`tar_class_folders`); hidden ones, such as .ipynb_checkpoints, aside."""
    names = [d.name for d in split_sub_folders(path)] if os.path.isdir(path) else tar_class_folders(path)
    return visible_in_label_order(names)


def visible_in_label_order(names) -> list[str]:
    """Folder names without the hidden ones, sorted as timm numbers the classes (natural_key)."""
    from timm.utils.misc import natural_key

    return sorted((name for name in set(names) if not name.startswith(".")), key=natural_key)


def tar_class_folders(path: str) -> set[str]:
    """The class folders of the tar split `path` (`tar_layout`)."""
    return tar_layout(path)[1]


def tar_layout(path: str) -> tuple[list[str], set[str]]:
    """(wrapper, class folders) of the tar split `path`. The wrapper is the folders every image's path starts with
    above its class folder, [] but for `tar cf train.tar train/` (members train/<class>/<image>), whose images timm
    labels by their last folder all the same. The class folders are the first folder below the wrapper of every
    member's path, and the name of each .tar directly in the wrapper (a class tar, read by timm as a folder of that
    name). Only the outer tar's headers are read: a pass over a tar of class tars skips over their contents."""
    images, others, extensions = [], [], read_extensions()
    with tarfile.open(path) as tar:
        for member in tar:
            parts = tar_path(member.name).split("/")
            if parts == ["."]:  # the tar's root, as `tar -C split .` stores it
                continue
            stem, ext = os.path.splitext(parts[-1])
            if member.isfile() and ext.lower() == ".tar":
                images.append(parts[:-1] + [stem, "<image>"])  # a class tar: a folder of its images
            elif member.isfile() and ext.lower() in extensions:
                images.append(parts)
            else:
                others.append(parts if member.isfile() else parts + ["<dir>"])
    wrapper = common_wrapper(images)
    depth = len(wrapper)
    folders = {parts[depth] for parts in images + others if len(parts) > depth + 1 and parts[:depth] == wrapper}
    return wrapper, folders


def common_wrapper(paths: list[list[str]]) -> list[str]:
    """The leading folders that all `paths` (split into parts) share with at least a class folder and a file below
    them: ['train'] for train/<class>/<image>, [] once two images sit in different top folders or one sits at most
    a folder deep."""
    depth = 0
    while paths and all(len(p) >= depth + 3 for p in paths) and len({p[depth] for p in paths}) == 1:
        depth += 1
    return paths[0][:depth] if paths else []


def tar_path(name: str) -> str:
    """A tar member's name as a path in the split, "./" and a leading "/" aside (`tar -C split .` writes ./cat/x)."""
    return posixpath.normpath(name).lstrip("/")


def images_outside_class_folders(path: str, dataset: ImageDataset, wrapper: Sequence[str] = ()) -> list[str]:
    """The images of the split `path` that do not sit directly in the class folder timm labels them with, as paths
    relative to the split (in a .tar, its members' names after their class tar's, as `folder_fingerprint`; below
    the tar's `wrapper` folders, see `tar_layout`)."""
    reader = dataset.reader
    if os.path.isdir(path):
        # each class's folder joined once, not per image (1.28 M images: about half the time); a hidden one never
        # matches
        folder_of = {index: os.path.join(path, name) for name, index in reader.class_to_idx.items()
                     if not name.startswith(".")}
        return [os.path.relpath(f, path) for f, target in reader.samples if os.path.dirname(f) != folder_of.get(target)]
    # a .tar: timm labels an image by the last folder of its path, a class tar counting as a folder of its name,
    # so an image at the root is class '' (or '.') and cat/nested/x.png class 'nested', merged with any other
    # nested/. Each image must be <class>/<image>, or <class>.tar holding <image>, and labelled <class>.
    outside = []
    for (member, _, inner), target in zip(reader.samples, reader.targets):
        folder = os.path.splitext(inner.name)[0] if inner is not None else ""
        parts = tar_path(posixpath.join(folder, member.name)).split("/")
        if wrapper and parts[:len(wrapper)] == list(wrapper):
            parts = parts[len(wrapper):]
        if len(parts) != 2 or parts[0].startswith(".") or parts[0] != reader.class_idx_to_name[int(target)]:
            outside.append("/".join(n.name for n in (inner, member) if n is not None))
    return outside


def images_in_class_tar_folders(dataset: ImageDataset) -> list[tuple[str, str]]:
    """(class tar, member) of each image of a tar split that sits in a folder inside its class tar, such as the ./0.png
    of `tar cf cat.tar -C cat .`: timm labels it by that folder ('.'), not by the class tar's name."""
    return [(inner.name, member.name) for member, _, inner in dataset.reader.samples
            if inner is not None and posixpath.dirname(member.name.lstrip("/"))]


def check_class_folders(path: str, dataset: ImageDataset) -> None:
    """The classes of a split (a folder or a .tar) are its class folders, each holding its images directly, or a
    DataError.

    timm makes a class of every folder that holds an image, at any depth (in a .tar, of the last folder's name), and
    of none that holds no image: an image directly under the split (class ''), one in a nested or hidden folder, or
    an empty class folder would change the class set, and so the meaning of every label, without a word. Two class
    folders that are one folder (a link to another class's) would label its images as both.
    """
    # a tar's headers are read once for both (a pass over a flat tar of ImageNet's images is not free)
    wrapper, folders = ([], class_folders(path)) if os.path.isdir(path) else tar_layout(path)
    folders = visible_in_label_order(folders)
    outside = images_outside_class_folders(path, dataset, wrapper)
    foldered = [] if os.path.isdir(path) or not outside else images_in_class_tar_folders(dataset)
    if foldered:  # the general advice below would name the class tar they are in as the place to put them
        (tar, member), *_ = foldered
        folder, stem = posixpath.dirname(member), posixpath.splitext(posixpath.basename(tar))[0]
        raise DataError(f"{path}: {len(foldered)} image(s) sit in a folder inside their class tar, e.g. "
                        f"{', '.join(f'{t}/{m}' for t, m in foldered[:3])}: timm labels such an image by that "
                        f"folder's name ('{posixpath.basename(folder)}' for {tar}/{member}), not by its tar's, so a "
                        f"class tar must hold its images at its top. Re-pack each class tar without the {folder}/ "
                        f"prefix, e.g. `tar cf {stem}.tar -C {stem} $(ls {stem})` in the folder holding {stem}/")
    if outside:
        where = (f"{path}/<class>/" if os.path.isdir(path) else
                 f"a top-level <class>/ folder or <class>.tar of {path} (or of one folder holding them all)")
        raise DataError(f"{path}: {len(outside)} image(s) outside a class folder, e.g. "
                        f"{', '.join(outside[:3])}: images must sit directly in {where}; anywhere else timm would "
                        f"count them as a class of their own. Move them into their class folder or out of {path}")
    from timm.utils.misc import natural_key
    keys: dict = {}
    for name in folders:  # timm sorts by natural_key; a tie's order would follow the hash seed
        keys.setdefault(tuple(natural_key(name)), []).append(name)
    tied = next((names for names in keys.values() if len(names) > 1), None)
    if tied:
        raise DataError(f"{path}: class folders {', '.join(tied)} sort as one name (case and leading zeros aside), "
                        f"so their label order would change from process to process: rename them apart")
    if os.path.isdir(path):  # a class folder linked to another (train/b -> a): one stat per class folder, via links
        seen: dict = {}
        for name in folders:
            stat = os.stat(os.path.join(path, name))
            first = seen.setdefault((stat.st_dev, stat.st_ino), name)
            if first != name:
                raise DataError(f"{path}: class folders {first} and {name} are one folder under two names "
                                f"({os.path.join(path, name)} is {os.path.join(path, first)}), so its images would "
                                f"be labelled as both classes: point the link at {name}'s own images, or remove it")
    labelled = set(class_names(dataset))
    empty = [name for name in folders if name not in labelled]
    if empty:
        raise DataError(f"{path}: class folder(s) {', '.join(empty[:5])} hold no images, so they would not "
                        f"be classes and every later label would shift: add their images or remove the "
                        f"folder(s)")


def class_names(dataset) -> list[str]:
    """Class names in label order (the folder names of an ImageNet-style split)."""
    reader = getattr(dataset, "reader", None)
    # timm's folder reader names it class_to_idx, its tar reader class_name_to_idx
    class_to_idx = getattr(reader, "class_to_idx", None) or getattr(reader, "class_name_to_idx", None) or {}
    return [name for name, _ in sorted(class_to_idx.items(), key=lambda item: item[1])]


def check_same_classes(train: list[str], val: list[str], where: str) -> None:
    """Train and val splits must name the same classes in the same order, or labels mean different things."""
    if train == val:
        return
    missing, extra = sorted(set(train) - set(val)), sorted(set(val) - set(train))
    # names that print alike but are other strings: a composed (NFC) and a decomposed (NFD) accent, as a copy between
    # file systems (macOS's, Linux's) may leave them
    composed = {unicodedata.normalize("NFC", v): v for v in extra}
    alike = [(t, composed[n]) for t in missing if (n := unicodedata.normalize("NFC", t)) in composed]
    if alike:
        shown = "; ".join(f"train {ascii(t)}, val {ascii(v)}" for t, v in alike[:5])
        raise DataError(f"{where}: the train and val splits name {len(alike)} class folder(s) with the same letters "
                        f"in other Unicode forms ({shown}), other names to the file system and to the labels: rename "
                        f"the folders of one split so that both spell them alike (e.g. in NFC: "
                        f"unicodedata.normalize('NFC', name))")
    detail = (f"val lacks {missing[:5]}" if missing else "") + ("; " if missing and extra else "") + \
        (f"val has classes train lacks: {extra[:5]}" if extra else "")
    raise DataError(f"{where}: the train and val splits have different class folders "
                    f"({detail or 'other order'}); label i would name different classes. Give both splits "
                    f"the same class folders")
