"""The import rewrites, one module each; ``frontend.pipeline`` runs them in order.

Each module defines one or more ``ImportPass`` objects (a TVM module pass with a name, a
line on why, and a count of the places it rewrote).
"""
