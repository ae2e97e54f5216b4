"""Errors a user can cause: each carries a one-line message; the CLI exits 2 on them."""


class PartuneError(Exception):
    """Bad input from the user (model, plan, options). One line, no traceback."""


class PlanError(PartuneError):
    """A plan that does not fit the model or names what does not exist."""


class ModelError(PartuneError):
    """A model that cannot be found, read or imported."""
