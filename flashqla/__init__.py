"""TileLang kernels for the chunked gated delta rule on Hopper, with a torch reference path."""
from flashqla.api import chunk_gated_delta_rule

__all__ = ["chunk_gated_delta_rule"]
