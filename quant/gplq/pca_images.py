"""Whether GPLQ's `pca_images` is the caller's count or the default.

The default (10,000 images per rank) is capped at one epoch of the training loader, so that a small split (the
digits demo's 1,437 images) takes it: checkpoints, result files and stage-1 identities of every release record
10000. A count the caller chose is used as it is, so one above the full batches of a rank's epoch is refused
(evaluate.py before any work, fit_pca when it runs out of images) instead of giving a smaller PCA subset than asked.

Chosen means: a key of an options mapping (even one naming 10000), or a dataclass value other than the default (a
dataclass cannot say whether its default was named). The pipeline parses a mapping into a dataclass before it
runs, so `GPLQPipeline.__call__` records the answer for the call (`given_for_this_call`), and the PCA reads it
(`pca_images_exact`).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator, Mapping, Optional

from configs.quant import GPLQOptions

DEFAULT_PCA_IMAGES = GPLQOptions().pca_images

# the answer for the pipeline call in progress; None: `run` reached without `__call__` (the dataclass decides)
_GIVEN: ContextVar[Optional[bool]] = ContextVar("gplq_pca_images_given", default=None)


def pca_images_given(options: Any) -> bool:
    """Whether the caller chose `options`' pca_images (None: the defaults; a mapping; a GPLQOptions)."""
    if options is None:
        return False
    if isinstance(options, Mapping):
        return "pca_images" in options
    return options.pca_images != DEFAULT_PCA_IMAGES


@contextmanager
def given_for_this_call(options: Any) -> Iterator[None]:
    """Record, for the pipeline call inside, whether the options as the caller passed them chose pca_images."""
    token = _GIVEN.set(pca_images_given(options))
    try:
        yield
    finally:
        _GIVEN.reset(token)


def pca_images_exact(options: GPLQOptions) -> bool:
    """Whether the PCA must get all of `options.pca_images` (a count chosen) rather than at most that many."""
    given = _GIVEN.get()
    return pca_images_given(options) if given is None else given
