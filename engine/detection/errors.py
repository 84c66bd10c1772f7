"""The one exception of the detection task: bad input reported as one `error:` line before any work. Its own
module so that every other module of the package can raise it without importing each other."""
from __future__ import annotations


class DetectionError(ValueError):
    """Bad detection input (config, data root, checkpoint), reported as one line before any work."""
