"""Recording: the per-thread tape stack, the fast-path recorder (Cython),
every TF hook (one install()/uninstall()), and which tensors each gradient
reads. Imports only the gradients layer and the core below it."""
