"""Paper shape: Qwen2.5-7B target, Qwen2.5-0.5B draft (see configs.base.paper_shape_config)."""

from configs import shapes
from configs.base import paper_shape_config


def get_config():
  return paper_shape_config(shapes.QWEN25_7B, shapes.QWEN25_05B)
