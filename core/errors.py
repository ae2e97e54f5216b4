"""Errors a user can cause: each carries a one-line message; the CLI exits 2 on them.

Also how any error reads to a person (``clean_error``): the stored text of a failed
measurement keeps what helps debugging (Python's class name, a scope in full), but a
reason shown to a user names the backend and says what went wrong, nothing more.
"""

import re


class PartuneError(Exception):
    """Bad input from the user (model, plan, options). One line, no traceback."""


class PlanError(PartuneError):
    """A plan that does not fit the model or names what does not exist."""


class ModelError(PartuneError):
    """A model that cannot be found, read or imported."""


def last_line(e: BaseException, limit: int = 300) -> str:
    """The last line of an exception's message (where TVM and ORT put the reason), or its type."""
    return (str(e).strip().splitlines() or [type(e).__name__])[-1][:limit]


# SEScope.__str__ (``tvm@cpu:*/*/*``, ``*@cpu:0/llvm/global``): a person knows the backend.
_SCOPE_TEXT = re.compile(r"(?:\b([\w.+-]+)|\*)@[\w*]+:[\w*]+/[\w*]+/[\w*]+")
# A Python class name before a message, at its start or after a label ("tvm: InternalError: ..."):
# ``RuntimeError: ``, ``tvm.error.InternalError: ``, ``BackendError: ``, ``Unsupported: ``.
_CLASS_PREFIX = re.compile(
    r"(?:^|(?<=: )|(?<=; )|(?<=\())(?:[A-Za-z_]\w*\.)*"
    r"(?:[A-Z]\w*(?:Error|Exception)|Unsupported)\s*:\s+"
)
# An error with no message is only its class name (``MemoryError``, ``tvm.error.TVMError``).
_BARE_CLASS = re.compile(
    r"(?:^|(?<=: )|(?<=; ))(?:[A-Za-z_]\w*\.)*([A-Z]\w*(?:Error|Exception))(?=$|;)"
)
_WORD = re.compile(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")  # MemoryError -> Memory|Error


def clean_error(error: str, limit: int = 160) -> str:
    """An error as a person reads it: its last line, scopes named by their backend, and no
    Python class names in front of the message."""
    line = (error.strip().splitlines() or [""])[-1]
    line = _SCOPE_TEXT.sub(lambda m: m.group(1) or "a scope", line)
    line = _CLASS_PREFIX.sub("", line).strip()
    line = _BARE_CLASS.sub(lambda m: _WORD.sub(" ", m.group(1)).lower(), line)  # -> "memory error"
    return line if len(line) <= limit else line[: limit - 3] + "..."
