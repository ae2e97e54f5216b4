"""The ``partune`` subcommands, one module a group; ``partune.cli`` holds the parser and
``main``."""
