"""Gradients: the TF vector space (ones/zeros, aggregation, TF's registered
gradients), the fast rules, the JVP rules, the compiled backward, and the one
place for TF-version differences (_tf_compat). Imports only the core below."""
