"""scripts.decode: a run on tiny random models, and one clear error per bad input.

Every problem a user can cause is one `error: ...` line on stderr naming the
input and the fix, exit status 1, and (but for file contents found while
loading) comes before any model is loaded. Each CLI case is a process of
its own: the runs that decode are `python -m scripts.decode`; the refusals
are forks of one process that has imported the CLI (importing it takes
seconds per process on 2 cores; a refusal, well under one), each checked for
its exit status and everything on stdout and stderr, import included.
Message-only cases of the same code path run in-process.
"""

import json
import os
import select
import shutil
import subprocess
import sys

import pytest

TINY_WORDS = 90  # words of the test tokenizer; the tiny checkpoints have vocab_size 97


def test_decode_tiny_writes_json(tmp_path, capsys):
  from configs import tiny
  from scripts.decode import print_result, run
  c = tiny.get_config()
  c.selection.policy = "dustin"
  r = run(c)
  print_result(r)
  out = capsys.readouterr().out
  assert "tokens/s" in out and "tau" in out
  assert len(r["sequences"]) == c.batch_size
  assert all(len(s["tokens"]) == c.max_new_tokens for s in r["sequences"])
  assert 1.0 <= r["stats"]["tau"] <= c.gamma + 1
  json.dumps(r)  # serialisable as written by --config.output_json


def _run_cli(*args, config="configs/tiny.py"):
  cmd = [sys.executable, "-m", "scripts.decode"] + ([f"--config={config}"] if config else [])
  return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=600)


# A process that imports scripts.decode once (what it prints doing so is
# kept), then per request forks a child that runs the CLI as `python -m`
# would (argv[0] the script, app.run with its flag parser, SystemExit and
# uncaught exceptions turned into the exit status and stderr the interpreter
# gives, atexit handlers run) and answers with its exit status and output.
_FORK_SERVER = r"""
import atexit, json, os, sys, tempfile, traceback
channel = os.fdopen(os.dup(1), "w")
def captured(files):
  os.dup2(files[0].fileno(), 1)
  os.dup2(files[1].fileno(), 2)
def text(f):
  f.seek(0)
  return f.read().decode("utf-8", "replace")
imported = [tempfile.TemporaryFile() for _ in range(2)]
captured(imported)
from absl import app
import scripts.decode as cli
sys.stdout.flush()
sys.stderr.flush()
before = [text(f) for f in imported]
for line in sys.stdin:
  files = [tempfile.TemporaryFile() for _ in range(2)]
  pid = os.fork()
  if pid == 0:
    code = 1
    try:
      captured(files)
      sys.argv = [cli.__file__] + json.loads(line)
      try:
        app.run(cli.main, flags_parser=cli.parse_flags)
        code = 0
      except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
          code = e.code or 0
        else:
          print(e.code, file=sys.stderr)
      except BaseException:
        traceback.print_exc()
      atexit._run_exitfuncs()
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
  _, status = os.waitpid(pid, 0)
  out, err = (b + text(f) for b, f in zip(before, files))
  channel.write(json.dumps(dict(returncode=os.waitstatus_to_exitcode(status), stdout=out,
                                stderr=err)) + "\n")
  channel.flush()
"""


class _ForkedCLI:
  """scripts.decode runs forked from one process (`_FORK_SERVER`)."""

  def __init__(self):
    self.proc = None

  def __call__(self, argv, timeout=600) -> subprocess.CompletedProcess:
    if self.proc is None:
      self.proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
    self.proc.stdin.write(json.dumps(argv) + "\n")
    self.proc.stdin.flush()
    if not select.select([self.proc.stdout], [], [], timeout)[0]:
      self.close()
      raise subprocess.TimeoutExpired(argv, timeout)
    line = self.proc.stdout.readline()
    assert line, f"the fork server exited with status {self.proc.wait()}"
    r = json.loads(line)
    return subprocess.CompletedProcess(argv, r["returncode"], r["stdout"], r["stderr"])

  def close(self):
    if self.proc is not None:
      self.proc.kill()
      self.proc.wait()
      self.proc = None


_forked = _ForkedCLI()


@pytest.fixture(scope="module", autouse=True)
def _close_the_fork_server():
  yield
  _forked.close()


def _forked_cli(*args, config="configs/tiny.py"):
  return _forked(([f"--config={config}"] if config else []) + list(args))


def _cli(*overrides, config="configs/tiny.py", run=_forked_cli):
  """(exit status, last stderr line) of a run of scripts.decode."""
  p = run(*overrides, config=config)
  return p.returncode, p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""


def _refused(*overrides, config="configs/tiny.py"):
  """The one error line of a run that must fail: stderr holds nothing else
  (no traceback), the exit status is 1."""
  p = _forked_cli(*overrides, config=config)
  lines = p.stderr.strip().splitlines()
  assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr
  assert "=== stats ===" not in p.stdout  # nothing was decoded
  return lines[0]


@pytest.mark.parametrize("override,message", [
    ("--config.gamma=0", "gamma must be >= 1"),
    ("--config.selection.polcy=dustin", 'Did you mean "policy"'),
    ("--config.selection.budget=8", "selection.budget=8 is smaller than"),
    ("--config.mem_fraction=1.5", "mem_fraction=1.5 must be in (0, 1]"),
    ("--config.draft_mlp=fused",
     "draft_mlp must be one of ('auto', 'xla', 'kernel', 'kernel_prefetch', 'seam', "
     "'seam_mosaic'), got 'fused'"),
    ("--config.draft_head=fp4", "draft_head must be one of ('native', 'int8'), got 'fp4'"),
    # the tiny draft: hidden size 64, f32
    ("--config.draft_mlp=kernel", "draft_mlp='kernel' runs on one device with hidden_size % 128"),
])
def test_bad_config_fails_with_one_clear_message(override, message):
  args = [override] + (["--config.selection.policy=dustin"] if "budget" in override else [])
  code, last = _cli(*args)
  assert code != 0 and message in last and last.startswith("error:")


@pytest.mark.parametrize("args,message", [
    (["--config.batch_size=0"], "error: batch_size must be >= 1, got 0"),
    (["--config.target.num_layers=-1"],
     "error: target.num_layers must be >= 0 (0 keeps every layer), got -1"),
    (["--config.target.num_layers=99"],
     "error: target.num_layers=99, but target.hf_config has 4 layers: set target.num_layers to "
     "at most 4 (0 keeps them all)"),
    (["--config.impl=tpu"],
     "error: impl='tpu' runs Pallas kernels for a TPU, but JAX runs on 'cpu' here: set "
     "--config.impl=auto (or reference)"),
    (["--config.prompt=hello", "--config.chat_template=True"],
     "error: random_weights=True decodes random token prompts (batch_size x prompt_len) without "
     "a tokenizer, so prompt and chat_template would be ignored: drop it, or set "
     "random_weights=False with real checkpoints"),
    (["--config.prompt_len=300"],  # longer than the cache
     "error: prompt of 300 tokens + 32 new tokens (+5 rows of work space) needs a cache of 336 "
     "rows, but max_len is 256: raise max_len, shorten the prompt or generate fewer tokens"),
    (["stray"], "error: unexpected argument 'stray': settings are flags, e.g. "
     "--config.prompt='...'"),
])
def test_bad_input_is_refused_before_loading(args, message):
  if "impl=tpu" in args[0]:
    import jax
    if jax.default_backend() != "cpu":
      pytest.skip("the message names this machine's backend")
  assert _refused(*args) == message


def test_missing_config_file():
  assert _refused(config="configs/nope.py") == "error: --config file 'configs/nope.py' does not exist"


def test_oracle_decodes_and_writes_json_atomically_into_a_new_directory(tmp_path):
  out = tmp_path / "new" / "dir" / "out.json"  # its directory is made before decoding
  p = _run_cli("--config.selection.policy=oracle",
               "--config.max_new_tokens=8", f"--config.output_json={out}")
  assert p.returncode == 0, p.stderr
  assert "=== sequence 1 (8 tokens) ===" in p.stdout and "policy oracle" in p.stdout
  r = json.loads(out.read_text())
  assert r["policy"] == "oracle" and [len(s["tokens"]) for s in r["sequences"]] == [8, 8]
  assert os.listdir(out.parent) == ["out.json"]  # no temporary file left


def test_output_json_is_checked_before_loading(tmp_path):
  (tmp_path / "file").write_text("x")
  assert _refused(f"--config.output_json={tmp_path}/file/out.json") == (
      f"error: output_json '{tmp_path}/file/out.json': '{tmp_path}/file' is a file, not a "
      "directory: choose another path")
  assert _refused(f"--config.output_json={tmp_path}") == (
      f"error: output_json '{tmp_path}' is a directory: give a file name, e.g. "
      f"'{tmp_path}/out.json'")
  if os.geteuid() != 0:  # root writes anywhere
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert _refused(f"--config.output_json={ro}/out.json") == (
        f"error: output_json '{ro}/out.json': cannot write in '{ro}' (Permission denied): "
        "choose a writable directory")


def test_write_json_replaces_the_file_whole(tmp_path, monkeypatch):
  from scripts.decode import check_output, write_json
  out = tmp_path / "a" / "out.json"
  check_output(str(out))
  assert out.parent.is_dir()
  write_json(str(out), {"x": 1})
  assert json.loads(out.read_text()) == {"x": 1}
  def boom(*a, **k):
    raise RuntimeError("interrupted")
  monkeypatch.setattr(json, "dump", boom)
  with pytest.raises(RuntimeError):
    write_json(str(out), {"x": 2})
  assert json.loads(out.read_text()) == {"x": 1}  # the old file, whole
  assert os.listdir(out.parent) == ["out.json"]


def test_xla_flags_reach_xla(tmp_path):
  dump = tmp_path / "dump"
  code, last = _cli(f"--config.xla_flags=--xla_dump_to={dump}", "--config.method=vanilla",
                    "--config.max_new_tokens=2",
                    "--config.progress=False", run=_run_cli)
  assert code == 0, last
  assert any(f.name.endswith(".txt") for f in dump.iterdir())  # XLA dumped the programs


def test_missing_checkpoint(tmp_path):
  code, last = _cli("--config.random_weights=False", f"--config.target.checkpoint={tmp_path}/x",
                    f"--config.draft.checkpoint={tmp_path}/y", "--config.prompt=hi")
  assert code != 0 and "does not exist" in last


def test_vanilla_method_ignores_the_policy():
  from configs import tiny
  from scripts.decode import run
  c = tiny.get_config()
  c.method, c.selection.policy = "vanilla", "dustin"
  r = run(c)
  assert r["stats"]["tau"] == 1.0 and all(len(s["tokens"]) == c.max_new_tokens
                                          for s in r["sequences"])


def test_int8_draft_head_decodes_the_same_tokens():
  """--config.draft_head=int8: the draft proposes through int8 rows, the
  target verifies, so greedy decoding emits what the native head's does."""
  from configs import tiny
  from scripts.decode import run
  out = {}
  for head in ("native", "int8"):
    c = tiny.get_config()
    c.draft_head = head
    out[head] = run(c)
  assert ([s["tokens"] for s in out["int8"]["sequences"]]
          == [s["tokens"] for s in out["native"]["sequences"]])
  assert out["int8"]["stats"]["tau"] > 1.0


_SKIP_TEMP = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
_CONCURRENT = "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"


@pytest.mark.parametrize("jaxlib, preset, extra, want", [
    ((0, 11, 2), "", "--a=1", f"{_SKIP_TEMP} {_CONCURRENT} --a=1"),
    ((0, 12, 0), "--b=2", "", f"{_SKIP_TEMP} {_CONCURRENT} --b=2"),
    ((0, 10, 2), "--b=2", "--a=1", f"{_CONCURRENT} --b=2 --a=1"),  # 0.10 rejects SKIP_TEMP
    ((0, 9, 0), "", "", None),  # a jaxlib older than both: XLA_FLAGS untouched
    ((0, 11, 2), "", "--xla_gpu_command_buffer_update_mode=X",  # a mode set already wins
     f"{_CONCURRENT} --xla_gpu_command_buffer_update_mode=X"),
    ((0, 11, 2), "--xla_gpu_command_buffer_scheduling_mode=SERIALIZE", "",
     f"{_SKIP_TEMP} --xla_gpu_command_buffer_scheduling_mode=SERIALIZE"),
])
def test_append_xla_flags_adds_the_graph_modes_where_jaxlib_knows_them(
    monkeypatch, jaxlib, preset, extra, want):
  from dustin_jax import config
  monkeypatch.setattr(config, "_jaxlib_version", lambda: jaxlib)
  monkeypatch.setenv("XLA_FLAGS", preset)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
  if not preset:
    monkeypatch.delenv("XLA_FLAGS")
  config.append_xla_flags(extra)
  assert os.environ.get("XLA_FLAGS") == want
  # an update mode (SKIP_TEMP, or the "X" set above) runs on XLA's VMM allocator
  vmm = "--xla_gpu_command_buffer_update_mode=" in (want or "")
  assert os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR") == ("vmm" if vmm else None)


def test_append_xla_flags_leaves_a_chosen_allocator_and_always_update_alone(monkeypatch):
  from dustin_jax import config
  monkeypatch.setattr(config, "_jaxlib_version", lambda: (0, 11, 2))
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
  config.append_xla_flags("")
  assert os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] == "platform"
  monkeypatch.delenv("XLA_FLAGS")
  monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR")
  config.append_xla_flags("--xla_gpu_command_buffer_update_mode=ALWAYS_UPDATE")
  assert "XLA_PYTHON_CLIENT_ALLOCATOR" not in os.environ


def test_benchmarks_know_when_the_graph_runs_phases_side_by_side(monkeypatch):
  from dustin_jax import config
  from scripts.benchmarking import graph_mode
  monkeypatch.setattr(config, "_jaxlib_version", lambda: (0, 11, 2))
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  config.append_xla_flags("")
  assert graph_mode() == "concurrent"
  monkeypatch.delenv("XLA_FLAGS")
  config.append_xla_flags("--xla_gpu_command_buffer_scheduling_mode=SERIALIZE")
  assert graph_mode() == "serial"


def test_this_jaxlib_version_is_read():
  import jax
  from dustin_jax import config
  assert config._jaxlib_version()[:2] == tuple(int(x) for x in jax.__version__.split(".")[:2])


def test_tokenizer_larger_than_the_model_vocab_is_refused(tiny_llama, tmp_path):
  ckpt = tmp_path / "ckpt"
  shutil.copytree(tiny_llama[0], ckpt)  # a checkpoint of vocab_size 97
  _word_tokenizer(200).save_pretrained(ckpt)
  assert _refused(*_real(ckpt)) == ("error: target vocab_size=97 is smaller than the "
                                    "tokenizer's 201 tokens: wrong model or tokenizer")


# ------------------------------------------------------- real inputs
def _word_tokenizer(n: int):
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast
  words = {f"w{i}": i for i in range(n)}
  words["[UNK]"] = n
  tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_llama, tmp_path_factory):
  """The tiny Llama checkpoint (3 layers, vocab 97) with a word tokenizer."""
  ckpt = tmp_path_factory.mktemp("tiny_ckpt")
  shutil.copytree(tiny_llama[0], ckpt, dirs_exist_ok=True)
  _word_tokenizer(TINY_WORDS).save_pretrained(ckpt)
  return ckpt


def _real(ckpt, *extra, prompt="w1 w2 w3"):
  return ("--config.random_weights=False", f"--config.target.checkpoint={ckpt}",
          f"--config.draft.checkpoint={ckpt}", *([f"--config.prompt={prompt}"] if prompt else []),
          *extra)


def test_prompt_file_problems_name_the_file_and_line(tiny_ckpt, tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "w1 w2"}\n{"prompt": "w1\n')
  assert _refused(*_real(tiny_ckpt, f"--config.prompts_jsonl={bad}", prompt=None)) == (
      f'error: {bad}:2: not valid JSON (Unterminated string starting at, column 12): each line '
      'must be one JSON object, e.g. {"prompt": "..."}')
  # an empty prompt is refused, also where a chat template would wrap it in tokens
  empty = tmp_path / "empty_prompt.jsonl"
  empty.write_text('{"prompt": "w1 w2"}\n\n{"prompt": "  "}\n')
  assert _refused(*_real(tiny_ckpt, f"--config.prompts_jsonl={empty}",
                         "--config.chat_template=True", prompt=None)) == (
      f"error: {empty}:3: the prompt is empty: give the text to continue or answer")


def test_prompt_file_contents_in_process(tmp_path):
  from configs import tiny
  from dustin_jax.config import ConfigError
  from dustin_jax.run import prompt_texts, validate
  c = tiny.get_config()
  c.random_weights = False
  c.target.checkpoint = c.draft.checkpoint = str(tmp_path)
  cases = {
      b"": "prompts_jsonl '{p}' has no prompts: write one JSON object per line, e.g. "
           '{{"prompt": "..."}}',
      b'{"prompt": "a"}\n{"prompt": 42}\n': "{p}:2: 'prompt' must be a string, got int 42: "
                                              "quote the text",
      b'{"prompt": "a"}\n["a"]\n': "{p}:2: expected a JSON object with key 'prompt', e.g. "
                                   '{{"prompt": "..."}}, got a list',
      b'{"prompt": "caf\xe9"}\n': "{p}:1: not UTF-8 text (column 16): save the file as UTF-8",
  }
  for i, (data, want) in enumerate(cases.items()):
    p = tmp_path / f"p{i}.jsonl"
    p.write_bytes(data)
    c.prompts_jsonl = str(p)
    with pytest.raises(ConfigError) as e:
      prompt_texts(c)
    assert str(e.value) == want.format(p=p)
  c.prompts_jsonl = str(tmp_path)
  with pytest.raises(ConfigError) as e:
    validate(c)
  assert str(e.value) == f"prompts_jsonl '{tmp_path}' is a directory: give the path of a file"
  c.prompts_jsonl, c.prompt_file = "", str(tmp_path / "latin.txt")
  (tmp_path / "latin.txt").write_bytes(b"line one\ncaf\xe9\n")
  with pytest.raises(ConfigError) as e:
    prompt_texts(c)
  assert str(e.value) == f"{tmp_path}/latin.txt:2: not UTF-8 text (byte 12): save the file as UTF-8"


def test_srh_file_that_is_not_json(tmp_path):
  srh = tmp_path / "srh.json"
  srh.write_text("not json")
  assert _refused("--config.selection.policy=dustin", f"--config.selection.srh_file={srh}") == (
      f"error: SRH file '{srh}' is not valid JSON: Expecting value: line 1 column 1 (char 0)")


def test_checkpoint_without_tokenizer_is_named(tiny_llama):
  path = tiny_llama[0]  # model files only
  assert _refused(*_real(path)) == (
      f"error: checkpoint '{path}' has no tokenizer (none of tokenizer.json, "
      "tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt, spiece.model): copy the "
      "model's tokenizer files into it")


def test_num_layers_beyond_the_checkpoint(tiny_ckpt):
  from configs import tiny
  from dustin_jax.config import ConfigError
  from dustin_jax.run import model_config
  c = tiny.get_config()
  c.random_weights = False
  c.target.checkpoint, c.target.num_layers = str(tiny_ckpt), 99
  with pytest.raises(ConfigError) as e:
    model_config(c.target, c, "target")
  assert str(e.value) == (f"target.num_layers=99, but {tiny_ckpt} has 3 layers: set "
                          "target.num_layers to at most 3 (0 keeps them all)")
  c.target.num_layers = 2
  assert model_config(c.target, c, "target").num_layers == 2


def test_corrupt_checkpoints_name_the_file_and_tensor(tiny_ckpt, tmp_path):
  # a truncated GGUF: found when its header is read, before anything loads
  from gguf import GGUFWriter
  import numpy as np
  gguf = tmp_path / "cut.gguf"
  w = GGUFWriter(str(gguf), "qwen2")
  w.add_tensor("token_embd.weight", np.zeros((97, 64), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  size = gguf.stat().st_size
  with open(gguf, "r+b") as f:
    f.truncate(size - 1000)
  start = size - 97 * 64 * 4
  assert _refused(*_real(gguf)) == (
      f"error: {gguf}: tensor 'token_embd.weight' needs bytes [{start}, {size}) but the file has "
      f"{size - 1000}: the file is truncated or corrupt: download or convert it again")
  # a safetensors file of garbage
  junk = tmp_path / "junk"
  shutil.copytree(tiny_ckpt, junk)
  (junk / "model.safetensors").write_bytes(b"\xff" * 4096)
  assert _refused(*_real(junk)) == (
      f"error: {junk}/model.safetensors: not a valid safetensors file (a header of "
      f"{2**64 - 1} bytes in a file of 4096): it is truncated or corrupt; download or save it "
      "again")
  # weights of another shape than config.json says
  odd = tmp_path / "odd"
  shutil.copytree(tiny_ckpt, odd)
  cfg = json.loads((odd / "config.json").read_text())
  cfg["intermediate_size"] = 100
  (odd / "config.json").write_text(json.dumps(cfg))
  assert _refused(*_real(odd)) == (
      f"error: {odd}: tensor 'model.layers.0.mlp.down_proj.weight' has shape (64, 96), expected "
      "(64, 100) for this config: the weights and config.json are of different models")


def test_truncated_safetensors_in_process(tiny_ckpt, tmp_path):
  from dustin_jax.config import CheckpointError
  from dustin_jax.weights import safetensors_index
  cut = tmp_path / "cut.safetensors"
  data = (tiny_ckpt / "model.safetensors").read_bytes()
  cut.write_bytes(data[:len(data) // 2])
  with pytest.raises(CheckpointError, match=r"cut.safetensors: not a valid safetensors file "
                     r"\(tensor '.*' of shape .* needs bytes .*\): it is truncated or corrupt"):
    safetensors_index(str(cut))


def test_compile_cache_setting_places_or_turns_off_the_cache(tmp_path):
  """--config.compile_cache: a directory keeps the run's compiled programs
  there (and the run says so), '' keeps none and says 'off'."""
  where = tmp_path / "xla"
  # plain decoding of 2 tokens: fewer programs to compile, the same cache setting
  short = ("--config.method=vanilla", "--config.max_new_tokens=2", "--config.progress=False")
  p = _run_cli(f"--config.compile_cache={where}", *short)
  assert p.returncode == 0, p.stderr[-2000:]
  assert f"(compilation cache: {where})" in p.stdout
  assert len(list(where.iterdir())) > 0  # the programs of the run
  env = dict(os.environ, DUSTIN_JAX_CACHE=str(tmp_path / "root"))
  off = subprocess.run([sys.executable, "-m", "scripts.decode", "--config=configs/tiny.py",
                        "--config.compile_cache=", *short],
                       capture_output=True, text=True, timeout=600, env=env)
  assert off.returncode == 0, off.stderr[-2000:]
  assert "(compilation cache: off)" in off.stdout
  assert not (tmp_path / "root" / "xla").exists()
