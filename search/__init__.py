"""Partune's search: partition rules, candidates, the DP, auto-tuning choices,
refinement, and the session that runs them in order."""
