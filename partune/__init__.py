"""Partune: measure-driven partitioning of deep-learning models across backends."""

__version__ = "0.1.0"
