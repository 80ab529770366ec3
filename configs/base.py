"""Every field a run can set, with its default; the other configs start here.

Unknown keys are refused by ml_collections' config flags, so a misspelled
`--config.selection.budgett=512` fails instead of being ignored.
"""

import ml_collections


def model_config(**kw) -> ml_collections.ConfigDict:
  """Where a model comes from: `asset` (an offline model of
  dustin_jax.assets), `checkpoint` (a Hugging Face directory, a .gguf file or
  an orbax directory of dustin_jax.weights.save_params), or `hf_config` (a
  config.json dict; with random_weights=True, real shapes for benchmarks)."""
  c = ml_collections.ConfigDict()
  c.asset = ""
  c.checkpoint = ""
  c.hf_config = None
  c.num_layers = 0          # > 0: keep only the first layers (benchmarks)
  c.update(kw)
  return c


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.target = model_config()
  c.draft = model_config()
  c.random_weights = False
  c.dtype = "bfloat16"            # params and KV caches: bfloat16 | float32
  c.seed = 0

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1                 # data-parallel ways (batch)
  c.mesh.model = 0                # tensor-parallel ways; 0: all remaining devices
  c.mesh.distributed = False      # multi-host: call jax.distributed.initialize() first
  c.mesh.device_memory_gib = 0.0  # 0: ask the device; set it to plan for other hardware

  c.method = "speculative"        # speculative | vanilla
  c.gamma = 4
  c.temperature = 0.0             # 0: greedy
  c.top_k = 0
  c.top_p = 1.0
  c.draft_kv = "full"             # full | streaming (MagicDec: sink + window)
  c.draft_sink = 16
  c.draft_window = 2032
  c.draft_mlp = "auto"            # the draft's MLPs: auto | xla | kernel (one kernel per layer
                                  # pass, Hopper, one device) | kernel_prefetch (the kernel,
                                  # sending the next layer's q/k/v and o to L2) | seam
                                  # (streaming draft: o, MLP and next q/k/v as one
                                  # resident kernel per layer, opt-in) | seam_mosaic
                                  # (the seam, the attention a Mosaic GPU kernel); auto:
                                  # kernel_prefetch wherever it runs
  c.draft_head = "int8"           # the draft's LM head: int8 (int8 rows, per-row scales: half
                                  # the bytes; the target still verifies every token) |
                                  # native (its own matrix)

  c.selection = ml_collections.ConfigDict()
  # which KV rows the target verifies against (dustin_jax.selection.policies)
  c.selection.policy = "full"     # full | dustin | dustin_target | dustin_draft | streaming | quest | oracle
  # unset (None): from the SRH file, else 512 / 16 / 64 / half the free budget
  c.selection.budget = ml_collections.FieldReference(None, field_type=int)
  c.selection.n_sink = ml_collections.FieldReference(None, field_type=int)
  c.selection.n_window = ml_collections.FieldReference(None, field_type=int)
  c.selection.m = ml_collections.FieldReference(None, field_type=int)
  c.selection.srh_file = ""       # JSON from scripts/profile_srh.py; "" = documented default heads

  c.prompt = ""
  c.prompt_file = ""              # a text file: one prompt
  c.prompts_jsonl = ""            # one {"prompt": ...} per line: a batch
  c.chat_template = False
  c.batch_size = 1                # random-weights runs: that many random prompts
  c.prompt_len = 128              # random-weights runs: their length
  c.max_len = 4096
  c.max_new_tokens = 64
  c.prefill_block = 8192         # tokens per tile of the prefill's per-token work (memory)
  c.impl = "auto"                 # attention kernels: auto | reference | gpu | tpu
  c.output_json = ""
  # persistent XLA compilation cache: "auto" = <cache root>/xla (the cache
  # root: $DUSTIN_JAX_CACHE, else ~/.cache/dustin_jax), a path, or "" (off)
  c.compile_cache = "auto"
  c.progress = True
  # appended to XLA_FLAGS before JAX starts its backend (scripts.decode only);
  # the flags measured on the H200 and what they did: results/h200/README.md
  c.xla_flags = ""
  # share of each accelerator's memory XLA's allocator may take (0: its
  # default, 75%); the memory plan checks against it. Qwen2.5-72B on 2 H200s
  # needs ~0.95 (results/h200x2/README.md)
  c.mem_fraction = 0.0
  return c


def paper_shape_config(target_hf: dict, draft_hf: dict) -> ml_collections.ConfigDict:
  """A paper-shape run: random weights of the real shapes (benchmarks) unless
  `target.checkpoint` / `draft.checkpoint` point at real checkpoints; 32k
  context, batch 16, the method with a streaming draft cache."""
  c = base_config()
  c.random_weights = True
  c.target.hf_config = dict(target_hf)
  c.draft.hf_config = dict(draft_hf)
  c.batch_size = 16
  c.prompt_len = 32768 - 512
  c.max_len = 32768
  c.max_new_tokens = 64
  c.gamma = 4
  c.draft_kv = "streaming"
  c.selection.policy = "dustin"
  c.selection.budget = 512
  return c
