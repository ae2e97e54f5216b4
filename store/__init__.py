"""The measurement store: every measurement kept in Optuna storage under a stable key,
and the claims that keep workers sharing a storage from taking one twice."""
