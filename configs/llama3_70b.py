"""Paper shape: Llama-3(.3)-70B target, Llama-3.2-1B draft.

Random weights of the real shapes by default (benchmarks); point
`target.checkpoint` / `draft.checkpoint` at real checkpoints to decode text.
"""

from configs import shapes
from configs.base import base_config


def get_config():
  c = base_config()
  c.random_weights = True
  c.target.hf_config = dict(shapes.LLAMA3_70B)
  c.draft.hf_config = dict(shapes.LLAMA32_1B)
  c.batch_size = 16
  c.prompt_len = 32768 - 512
  c.max_len = 32768
  c.max_new_tokens = 64
  c.gamma = 4
  c.draft_kv = "streaming"
  c.dustin.policy = "dustin"
  c.dustin.budget = 512
  return c
