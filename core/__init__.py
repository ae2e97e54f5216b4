"""Partune's vocabulary, below every other layer: errors, SEScopes and CompilationConfigs,
the dataflow graph and its sub-graphs, plans, how a plan is applied to a Relax module,
and the keys under which measurements are stored."""
