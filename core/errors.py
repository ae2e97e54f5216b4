"""Errors a user can cause: each carries a one-line message; the CLI exits 2 on them."""


class PartuneError(Exception):
    """Bad input from the user (model, plan, options). One line, no traceback."""


class PlanError(PartuneError):
    """A plan that does not fit the model or names what does not exist."""


class ModelError(PartuneError):
    """A model that cannot be found, read or imported."""


def last_line(e: BaseException, limit: int = 300) -> str:
    """The last line of an exception's message (where TVM and ORT put the reason), or its type."""
    return (str(e).strip().splitlines() or [type(e).__name__])[-1][:limit]
