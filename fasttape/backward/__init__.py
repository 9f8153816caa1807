"""The backward passes behind GradientTape's methods: one pass for gradient()
(_gradient), the jacobians (_jacobians), per-example gradients, norms and
DP-SGD (_per_example). Above the diagnostics, below the public face."""
