# Type information for fasttape.privacy (a stub, so that a type checker of
# the user's code reads no further into fasttape's untyped internals).
from typing import Any

RDP_ORDERS: list[float]

def compute_epsilon(*, noise_multiplier: float, batch_size: int,
                    num_examples: int, epochs: float, delta: float,
                    accountant: str = "rdp") -> float: ...
def compute_noise_multiplier(*, epsilon: float, batch_size: int,
                             num_examples: int, epochs: float, delta: float,
                             accountant: str = "rdp") -> float: ...
def make_private(model: Any, *, l2_norm_clip: float, noise_multiplier: float,
                 num_microbatches: int | None = None,
                 seed: int | None = None) -> Any: ...
