"""Layer 1 of 8, ``partune.core``: the vocabulary every other layer speaks.

Errors a user can cause, SEScope and CompilationConfig, the dataflow graph and its
sub-graphs, plans, applying a plan to a Relax module, the keys measurements are stored
under, and version fingerprints. Imports TVM and nothing of Partune
(see docs/architecture.md).
"""
