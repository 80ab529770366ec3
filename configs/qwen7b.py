"""Paper shape: Qwen2.5-7B target, Qwen2.5-0.5B draft.

Random weights of the real shapes by default (benchmarks); point
`target.checkpoint` / `draft.checkpoint` at real checkpoints to decode text.
"""

from configs import shapes
from configs.base import base_config


def get_config():
  c = base_config()
  c.random_weights = True
  c.target.hf_config = dict(shapes.QWEN25_7B)
  c.draft.hf_config = dict(shapes.QWEN25_05B)
  c.batch_size = 16
  c.prompt_len = 32768 - 512
  c.max_len = 32768
  c.max_new_tokens = 64
  c.gamma = 4
  c.draft_kv = "streaming"
  c.dustin.policy = "dustin"
  c.dustin.budget = 512
  return c
