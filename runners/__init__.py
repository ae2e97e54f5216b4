"""Runners: build a plan or a region into something runnable, and time it."""
