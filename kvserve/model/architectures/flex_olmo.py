"""FlexOlmo: OLMo 2's layers (a norm on each sublayer's output only, q/k norms over the whole projections) with
OLMoE's experts in every layer."""

from kvserve.model.architectures import Architecture, register
from kvserve.model.architectures.olmo2 import OLMO2_WEIGHTS
from kvserve.model.architectures.olmoe import olmoe_config

register(Architecture("FlexOlmoForCausalLM", lambda d: {**olmoe_config(d), "norm_layout": "post"},
                      weights=OLMO2_WEIGHTS))
