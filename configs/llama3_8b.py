"""Paper shape: Llama-3(.1)-8B target, Llama-3.2-1B draft (see configs.base.paper_shape_config)."""

from configs import shapes
from configs.base import paper_shape_config


def get_config():
  return paper_shape_config(shapes.LLAMA3_8B, shapes.LLAMA32_1B)
