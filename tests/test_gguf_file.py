"""Tests of dustin_jax.gguf_file: tiny GGUF round trips (the real SmolLM2 file: test_real_models.py)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, RopeScalingType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from dustin_jax import assets  # noqa: E402
from dustin_jax.gguf_file import read_gguf, read_gguf_config, unpermute_qk_rows  # noqa: E402

L, HIDDEN, HEADS, KV, HEAD_DIM, FFN, VOCAB = 2, 32, 4, 2, 8, 48, 50

_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """What llama.cpp's HF->GGUF converter does to llama Q/K rows: per head,
  the two rotary halves [2, D/2] are stored interleaved [D/2, 2]."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  t = {"model.embed_tokens.weight": r(VOCAB, HIDDEN), "model.norm.weight": r(HIDDEN)}
  if not tied:
    t["lm_head.weight"] = r(VOCAB, HIDDEN)
  for i in range(L):
    p = f"model.layers.{i}."
    t.update({
        p + "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": r(KV * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": r(KV * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": r(FFN, HIDDEN),
        p + "mlp.up_proj.weight": r(FFN, HIDDEN),
        p + "mlp.down_proj.weight": r(HIDDEN, FFN),
        p + "input_layernorm.weight": r(HIDDEN),
        p + "post_attention_layernorm.weight": r(HIDDEN),
    })
    if arch == "qwen2":
      t[p + "self_attn.q_proj.bias"] = r(HEADS * HEAD_DIM)
      t[p + "self_attn.k_proj.bias"] = r(KV * HEAD_DIM)
      t[p + "self_attn.v_proj.bias"] = r(KV * HEAD_DIM)
  return t


def gguf_name(hf: str) -> str:
  fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
  if hf in fixed:
    return fixed[hf]
  parts = hf.split(".")  # model.layers.{i}.<module...>.<kind>
  return f"blk.{parts[2]}.{_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


Q8_NAME = "model.layers.0.mlp.up_proj.weight"
F16_NAME = "model.layers.1.mlp.gate_proj.weight"


def write_tiny_gguf(path, arch: str, tensors: dict[str, np.ndarray], *, rope_scaling=False):
  w = GGUFWriter(str(path), arch)
  w.add_block_count(L)
  w.add_context_length(4096)
  w.add_embedding_length(HIDDEN)
  w.add_feed_forward_length(FFN)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV)
  w.add_rope_freq_base(500000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_bos_token_id(7)
  w.add_eos_token_id(9)
  if rope_scaling:
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(1024)
  for hf, arr in tensors.items():
    name = gguf_name(hf)
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
      arr = llama_cpp_permute(arr, HEADS if ".attn_q." in name else KV)
    if hf == Q8_NAME:
      w.add_tensor(name, quantize(arr, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    elif hf == F16_NAME:
      w.add_tensor(name, arr.astype(np.float16))
    else:
      w.add_tensor(name, arr)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


# ----------------------------------------------------------------------------
# tiny files
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("arch, tied", [("llama", True), ("llama", False), ("qwen2", False)])
def test_round_trip(tmp_path, arch, tied):
  ref = hf_tensors(arch, tied)
  path = tmp_path / "tiny.gguf"
  write_tiny_gguf(path, arch, ref)
  cfg, got = read_gguf(path, progress=False)

  assert set(got) == set(ref)
  assert ("lm_head.weight" in got) == (not tied)
  for name, want in ref.items():
    assert got[name].dtype == np.float32, name
    assert got[name].shape == want.shape, name
    if name == Q8_NAME:
      exact = dequantize(quantize(want, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
      np.testing.assert_array_equal(got[name], exact)
      # Q8_0: per block of 32, scale d = max|x|/127 (stored as f16); error <= d/2
      # plus the f16 rounding of d (<= 127 * d * 2**-11): below 0.6 d.
      tol = 0.6 * np.abs(want.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
      assert np.all(np.abs(got[name] - want).reshape(-1, 32) <= tol)
      assert not np.array_equal(got[name], want)
    elif name == F16_NAME:
      np.testing.assert_array_equal(got[name], want.astype(np.float16).astype(np.float32))
    else:
      np.testing.assert_array_equal(got[name], want, err_msg=name)

  assert cfg["model_type"] == arch
  assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
  assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
          cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
      VOCAB, HIDDEN, FFN, L, HEADS, KV, HEAD_DIM)
  assert cfg["rms_norm_eps"] == 1e-5  # float32 metadata reported as the original decimal
  assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"] is None
  assert cfg["max_position_embeddings"] == 4096
  assert cfg["tie_word_embeddings"] is tied
  assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (7, 9)


def test_llama_qk_rows_are_permuted_in_file_and_restored(tmp_path):
  ref = hf_tensors("llama", tied=True)
  path = tmp_path / "tiny.gguf"
  write_tiny_gguf(path, "llama", ref)
  raw = {t.name: np.array(t.data) for t in GGUFReader(str(path)).tensors}
  q_hf, k_hf = ref["model.layers.1.self_attn.q_proj.weight"], ref["model.layers.1.self_attn.k_proj.weight"]
  # The file holds the permuted rows (so the test is not vacuous) ...
  assert not np.array_equal(raw["blk.1.attn_q.weight"], q_hf)
  assert not np.array_equal(raw["blk.1.attn_k.weight"], k_hf)
  # ... and read_gguf gives back the Hugging Face rows.
  _, got = read_gguf(path, progress=False)
  np.testing.assert_array_equal(got["model.layers.1.self_attn.q_proj.weight"], q_hf)
  np.testing.assert_array_equal(got["model.layers.1.self_attn.k_proj.weight"], k_hf)
  # v is never permuted
  np.testing.assert_array_equal(got["model.layers.1.self_attn.v_proj.weight"],
                                ref["model.layers.1.self_attn.v_proj.weight"])


def test_unpermute_is_inverse_of_llama_cpp_permute():
  rng = np.random.default_rng(1)
  for heads, d in [(4, 8), (3, 64), (1, 2)]:
    w = rng.standard_normal((heads * d, 5)).astype(np.float32)
    b = rng.standard_normal(heads * d).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk_rows(llama_cpp_permute(w, heads), heads), w)
    np.testing.assert_array_equal(unpermute_qk_rows(llama_cpp_permute(b, heads), heads), b)
  # Explicit layout for one head of size 4: HF rows [a0 a1 b0 b1] -> GGUF [a0 b0 a1 b1].
  hf = np.arange(4.0)
  np.testing.assert_array_equal(llama_cpp_permute(hf, 1), [0.0, 2.0, 1.0, 3.0])
  np.testing.assert_array_equal(unpermute_qk_rows(np.array([0.0, 2.0, 1.0, 3.0]), 1), hf)
  with pytest.raises(ValueError):
    unpermute_qk_rows(np.zeros((6, 2)), 4)


def test_rope_scaling_metadata(tmp_path):
  path = tmp_path / "tiny.gguf"
  write_tiny_gguf(path, "qwen2", hf_tensors("qwen2", tied=False), rope_scaling=True)
  cfg = read_gguf_config(path)
  assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def test_unsupported_architecture(tmp_path):
  path = tmp_path / "gemma.gguf"
  w = GGUFWriter(str(path), "gemma3")
  w.add_block_count(1)
  w.add_embedding_length(8)
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match="gemma3"):
    read_gguf(path, progress=False)
  with pytest.raises(ValueError, match="unsupported GGUF architecture"):
    read_gguf_config(path)


def test_unknown_tensor_and_missing_tensor(tmp_path):
  ref = hf_tensors("llama", tied=True)
  # a file with a tensor whose name we do not know (a fused QKV projection)
  w = GGUFWriter(str(tmp_path / "odd.gguf"), "llama")
  w.add_block_count(L)
  w.add_embedding_length(HIDDEN)
  w.add_feed_forward_length(FFN)
  w.add_head_count(HEADS)
  w.add_tensor("token_embd.weight", ref["model.embed_tokens.weight"])
  w.add_tensor("blk.0.attn_qkv.weight", np.zeros((3 * HIDDEN, HIDDEN), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
    read_gguf(tmp_path / "odd.gguf", progress=False)
  # a file lacking a layer's tensors
  partial = {k: v for k, v in ref.items() if not k.startswith("model.layers.1.mlp.")}
  write_tiny_gguf(tmp_path / "partial.gguf", "llama", partial)
  with pytest.raises(ValueError, match="missing tensors"):
    read_gguf(tmp_path / "partial.gguf", progress=False)


# ----------------------------------------------------------------------------
# real files against transformers' own GGUF loader (SmolLM2-135M-Instruct:
# tests/test_real_models.py, which loads transformers' model once for this
# and the greedy comparison)
# ----------------------------------------------------------------------------
@pytest.mark.slow
def test_qwen_0_5b_matches_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF models")
  from transformers import AutoModelForCausalLM

  asset = assets.MODELS["qwen2.5-coder-0.5b-instruct"]
  if not all(assets._chunk_path(c) is not None for c in asset.chunks):
    pytest.skip(f"Qwen 0.5B packages not installed ({asset.install_hint})")
  path = assets.ensure_model(asset.name, tmp_path, progress=False)
  cfg, ours = read_gguf(path, progress=False)
  model = AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, local_files_only=True, dtype=torch.float32)
  theirs = model.state_dict()
  assert set(ours) == set(theirs)
  for name, want in theirs.items():
    np.testing.assert_allclose(ours[name], want.numpy(), rtol=0, atol=1e-6, err_msg=name)
  assert cfg["tie_word_embeddings"] is False and cfg["model_type"] == "qwen2"
  assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 1e6


def test_header_reader_equals_gguf_reader_and_refuses_cut_files(tmp_path):
  """Metadata of every value type and the tensor views (f32, f16, Q8_0) read
  by our header reader equal gguf.GGUFReader's; a file cut inside its
  metadata or tensor table is refused with one clear error."""
  from dustin_jax.config import CheckpointError
  from dustin_jax.gguf_file import read_gguf_metadata

  path = tmp_path / "t.gguf"
  w = GGUFWriter(str(path), "qwen2")
  w.add_block_count(L)
  w.add_string("test.text", "héllo ✓")
  w.add_bool("test.flag", True)
  w.add_float32("test.eps", 1e-5)
  w.add_float64("test.f64", 0.1)
  w.add_int64("test.i64", -(2 ** 40))
  w.add_array("test.words", ["a", "", "ünï", "Ġ Ġ"])
  w.add_array("test.ints", [3, -1, 7])
  w.add_array("test.floats", [0.5, 1e-5])
  tensors = hf_tensors("qwen2", tied=True)
  for hf, arr in tensors.items():
    if hf == Q8_NAME:
      w.add_tensor(gguf_name(hf), quantize(arr, GGMLQuantizationType.Q8_0),
                   raw_dtype=GGMLQuantizationType.Q8_0)
    elif hf == F16_NAME:
      w.add_tensor(gguf_name(hf), arr.astype(np.float16))
    else:
      w.add_tensor(gguf_name(hf), arr)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()

  meta = read_gguf_metadata(path, "test.")
  assert meta == {"test.text": "héllo ✓", "test.flag": True, "test.eps": 1e-05, "test.f64": 0.1,
                  "test.i64": -(2 ** 40), "test.words": ["a", "", "ünï", "Ġ Ġ"],
                  "test.ints": [3, -1, 7], "test.floats": [0.5, 1e-05]}
  from dustin_jax.gguf_file import _open_reader
  ours, theirs = _open_reader(path), GGUFReader(str(path))
  assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
  for a, b in zip(ours.tensors, theirs.tensors):
    assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape), a.name
    assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
  assert {t.tensor_type.name for t in ours.tensors} == {"F32", "F16", "Q8_0"}

  data = path.read_bytes()
  for cut in (10, 60, len(data) // 8):  # inside the counts, the metadata, the tensor table
    cut_path = tmp_path / f"cut{cut}.gguf"
    cut_path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match="not a readable GGUF file|needs bytes"):
      read_gguf_config(cut_path)
