"""A helper of the sweep tests: the one error line a sweep refuses with before any run starts."""
import pytest

import sweep  # noqa: E402  (scripts/, on the path of the tests)


def refused_at_start(path: str, *flags: str) -> str:
    """The one error line of `sweep.py path --run --evaluate flags` (SystemExit before anything starts) for a sweep
    whose run 'a' is refused."""
    with pytest.raises(SystemExit) as stop:
        sweep.main([path, "--run", "--evaluate", *flags])
    message = str(stop.value.code)
    assert message.startswith("error: sweep run 'a': ") and "\n" not in message, message
    return message
