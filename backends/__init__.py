"""Backends: one module each, reached by the search only through ``registry``."""
