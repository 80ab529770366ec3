"""Tiny random models (seconds, any machine): a smoke run of the engine."""

from configs.base import base_config


def tiny_hf(layers: int) -> dict:
  return dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=2048, tie_word_embeddings=True)


def get_config():
  c = base_config()
  c.random_weights = True
  c.target.hf_config = tiny_hf(4)
  c.draft.hf_config = tiny_hf(2)
  c.dtype = "float32"
  c.batch_size = 2
  c.prompt_len = 48
  c.max_len = 256
  c.max_new_tokens = 32
  c.selection.budget = 32
  c.selection.n_sink = 4
  c.selection.n_window = 8
  c.selection.m = 8
  c.progress = False
  return c
