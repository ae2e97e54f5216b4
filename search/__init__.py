"""Partune's search: graphs, SEScopes, partition rules, candidates, plans."""
