"""Hugging Face config.json fields of the paper's models (real shapes).

With `random_weights=True` these give benchmarks of the exact sizes without
the checkpoints; with a `checkpoint` the checkpoint's own config.json wins.
"""

QWEN25_05B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True,
                  rms_norm_eps=1e-6, eos_token_id=151643)
QWEN25_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=False,
                 rms_norm_eps=1e-6, eos_token_id=151643)
QWEN25_72B = dict(model_type="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                  num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                  rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=False,
                  rms_norm_eps=1e-5, eos_token_id=151643)

_LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, max_position_embeddings=131072,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
                 eos_token_id=[128001, 128008, 128009])
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)
LLAMA32_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                  num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                  rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                  rope_scaling=dict(_LLAMA31_ROPE, factor=32.0), tie_word_embeddings=True,
                  bos_token_id=128000, eos_token_id=[128001, 128008, 128009])

# the benchmarks' (target, draft) pairs, by the name their flags take
PAIRS = {"qwen7b": (QWEN25_7B, QWEN25_05B),
         "llama3_8b": (LLAMA3_8B, LLAMA32_1B),
         "qwen72b": (QWEN25_72B, QWEN25_05B)}
