"""LongBench-style tasks built from the project's real offline texts.

Every builder is deterministic from `(seed, text)` and fits a context budget
in tokens (measured with the tokenizer that will be used): the prompt of an
item has at most `ctx` tokens. Each item carries the prompt, the expected
answer and the scorer that grades a generated continuation. Prompts end with
a completion cue (e.g. "The pass key is"), so a plain continuation of the
prompt is the answer; no chat template is needed.

| task      | context                                | question / gold                         | scorer   |
|-----------|----------------------------------------|-----------------------------------------|----------|
| passkey   | real text (KJV) + "The pass key is N"  | the 5-digit number N, needle at a depth | number   |
| needle    | real text + one invented fact sentence | the fact's value (a word), at a depth   | contains |
| multikey  | real text + 8 key/value lines spread   | the value of one key (hex strings)      | word     |
| qa        | consecutive KJV chapters (with their   | "which chapter contains this passage?"  | chapter  |
|           | "<Book> <n>" headings)                 | the heading of the chapter quoted       |          |
| code      | a real stdlib source (python-stdlib),  | the next line of code (LongBench LCC)   | edit_sim |
|           | up to a line start                     |                                         |          |

Scorers (all in [0, 1]; the gold answer scores 1.0):

* number: the first integer in the output equals the gold;
* word: the first word (``[A-Za-z0-9_-]+``) of the output equals the gold;
* contains: the gold word occurs (case-insensitive, whole word) in the first
  non-empty output line;
* chapter: the first "<Book> <n>" in the output's first line is the gold;
* edit_sim: LongBench LCC's edit similarity of the first non-empty output
  line with the gold line (both stripped): 1 - Levenshtein / max length.

The QA task is checkable and honest: the quoted passage (a run of ~12 words
of one verse) is checked to occur exactly once in the context, and the gold
is the heading of the chapter that holds it, which is itself in the context.
The depth of the passage is chosen by the seed.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import numpy as np

from dustin_jax.eval.texts import read_text

TASKS = ("passkey", "needle", "multikey", "qa", "code")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
MAX_NEW = {"passkey": 8, "needle": 8, "multikey": 12, "qa": 10, "code": 24}
DEFAULT_TEXT = {"passkey": "kjv", "needle": "kjv", "multikey": "kjv", "qa": "kjv",
                "code": "python-stdlib"}


@dataclasses.dataclass(frozen=True)
class Item:
  task: str
  prompt: str
  prompt_ids: tuple[int, ...]
  answer: str
  scorer: str
  max_new_tokens: int
  meta: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)

  def score(self, output: str) -> float:
    return SCORERS[self.scorer](output, self.answer)


# ------------------------------------------------------------------ scorers
def _first_line(text: str) -> str:
  for line in text.splitlines():
    if line.strip():
      return line.strip()
  return ""


def score_number(output: str, gold: str) -> float:
  m = re.search(r"\d+", output)
  return float(m is not None and m.group(0) == gold)


def score_word(output: str, gold: str) -> float:
  m = re.search(r"[A-Za-z0-9_-]+", output)
  return float(m is not None and m.group(0) == gold)


def score_contains(output: str, gold: str) -> float:
  line = _first_line(output)
  return float(re.search(rf"(?<![A-Za-z0-9]){re.escape(gold)}(?![A-Za-z0-9])", line,
                         re.IGNORECASE) is not None)


_CHAPTER = re.compile(r"((?:[1-3] )?[A-Z][A-Za-z]+(?: of [A-Z][A-Za-z]+| [A-Z][a-z]+)*) (\d+)")


def score_chapter(output: str, gold: str) -> float:
  m = _CHAPTER.search(_first_line(output))
  return float(m is not None and f"{m.group(1)} {m.group(2)}" == gold)


def levenshtein(a: str, b: str) -> int:
  """Edit distance (insertions, deletions, substitutions of one character)."""
  if len(a) < len(b):
    a, b = b, a
  prev = list(range(len(b) + 1))
  for i, ca in enumerate(a, 1):
    cur = [i]
    for j, cb in enumerate(b, 1):
      cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
    prev = cur
  return prev[-1]


def edit_similarity(a: str, b: str) -> float:
  """1 - Levenshtein(a, b) / max(len); 1.0 for two empty strings."""
  if not a and not b:
    return 1.0
  return 1.0 - levenshtein(a, b) / max(len(a), len(b))


def score_edit_sim(output: str, gold: str) -> float:
  return edit_similarity(_first_line(output), gold.strip())


SCORERS: dict[str, Callable[[str, str], float]] = {
    "number": score_number, "word": score_word, "contains": score_contains,
    "chapter": score_chapter, "edit_sim": score_edit_sim}


# ------------------------------------------------------------------ fitting
def _haystack(tok, text: str, rng, n_tokens: int) -> str:
  """About `n_tokens` tokens of `text` from a random paragraph start."""
  span = max(64, n_tokens * 8)
  start = int(rng.integers(0, max(1, len(text) - span)))
  nl = text.find("\n", start)
  start = nl + 1 if nl >= 0 else 0
  ids = tok.encode(text[start:start + span])[:n_tokens]
  return tok.decode(ids)


def _insert_at(hay: str, depth: float, sentence: str) -> str:
  """`sentence` inserted at the first sentence end after `depth` of `hay`."""
  pos = int(len(hay) * depth)
  m = re.compile(r"[.;:!?]\s").search(hay, pos)
  cut = m.end() if m else pos
  return hay[:cut] + sentence + " " + hay[cut:]


def _fit(tok, ctx: int, build: Callable[[int], str]) -> tuple[str, list[int]]:
  """The prompt `build(n)` with the largest haystack size n that fits `ctx`
  tokens (shrinks n by the overshoot until it fits)."""
  n = ctx
  for _ in range(50):
    prompt = build(n)
    ids = tok.encode(prompt)
    if len(ids) <= ctx:
      return prompt, ids
    n -= max(4, len(ids) - ctx)
    if n <= 0:
      break
  raise ValueError(f"cannot fit a prompt into {ctx} tokens")


# ------------------------------------------------------------------ builders
INTRO = ("Below is a long text. Somewhere in it there is a piece of information you will be "
         "asked about. Read it carefully.\n\n")

_NAMES = ("Ingrid", "Tomasz", "Amara", "Keiko", "Rafael", "Olusegun", "Freya", "Dmitri",
          "Lucia", "Hamid", "Saoirse", "Mateo", "Yuki", "Anneliese", "Kwame", "Priya")
_THINGS = {
    "colour": ("turquoise", "crimson", "ochre", "magenta", "teal", "amber", "lilac", "scarlet"),
    "fruit": ("mango", "apricot", "papaya", "gooseberry", "pomegranate", "kiwi", "lychee",
              "quince"),
    "instrument": ("cello", "oboe", "banjo", "harpsichord", "trombone", "ukulele", "sitar",
                   "clarinet"),
    "city": ("Lisbon", "Nairobi", "Osaka", "Reykjavik", "Montevideo", "Tallinn", "Hanoi",
             "Quito"),
}


def _rng(seed: int, task: str, i: int):
  return np.random.default_rng([seed, TASKS.index(task), i])


def passkey(tok, text: str, ctx: int, n: int, seed: int = 0) -> list[Item]:
  items = []
  for i in range(n):
    rng = _rng(seed, "passkey", i)
    key = str(int(rng.integers(10000, 100000)))
    depth = DEPTHS[i % len(DEPTHS)]
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    question = "\n\nWhat is the pass key? The pass key is"
    hay_rng_state = rng.bit_generator.state

    def build(m, needle=needle, question=question, state=hay_rng_state, depth=depth):
      r = np.random.default_rng()
      r.bit_generator.state = state
      return INTRO + _insert_at(_haystack(tok, text, r, m), depth, needle) + question

    prompt, ids = _fit(tok, ctx, build)
    items.append(Item("passkey", prompt, tuple(ids), key, "number", MAX_NEW["passkey"],
                      dict(depth=depth)))
  return items


def needle(tok, text: str, ctx: int, n: int, seed: int = 0) -> list[Item]:
  items = []
  for i in range(n):
    rng = _rng(seed, "needle", i)
    name = _NAMES[int(rng.integers(len(_NAMES)))]
    thing = sorted(_THINGS)[int(rng.integers(len(_THINGS)))]
    value = _THINGS[thing][int(rng.integers(len(_THINGS[thing])))]
    depth = DEPTHS[i % len(DEPTHS)]
    fact = f"{name}'s favourite {thing} is {value}."
    question = f"\n\nQuestion: what is {name}'s favourite {thing}?\nAnswer: {name}'s favourite {thing} is"
    state = rng.bit_generator.state

    def build(m, fact=fact, question=question, state=state, depth=depth):
      r = np.random.default_rng()
      r.bit_generator.state = state
      return INTRO + _insert_at(_haystack(tok, text, r, m), depth, fact) + question

    prompt, ids = _fit(tok, ctx, build)
    items.append(Item("needle", prompt, tuple(ids), value, "contains", MAX_NEW["needle"],
                      dict(depth=depth, fact=fact)))
  return items


def multikey(tok, text: str, ctx: int, n: int, seed: int = 0, n_keys: int = 8) -> list[Item]:
  items = []
  for i in range(n):
    rng = _rng(seed, "multikey", i)
    keys = [f"{int(rng.integers(16**6)):06x}" for _ in range(n_keys)]
    vals = [f"{int(rng.integers(16**8)):08x}" for _ in range(n_keys)]
    if len(set(keys)) < n_keys:
      keys = [f"{k}{j}" for j, k in enumerate(keys)]
    ask = int(rng.integers(n_keys))
    lines = [f'The value of key "{k}" is "{v}".' for k, v in zip(keys, vals)]
    question = f'\n\nWhat is the value of key "{keys[ask]}"? The value of key "{keys[ask]}" is "'
    state = rng.bit_generator.state

    def build(m, lines=lines, question=question, state=state):
      r = np.random.default_rng()
      r.bit_generator.state = state
      hay = _haystack(tok, text, r, m)
      # insert from the deepest first so earlier depths keep their positions
      for j in reversed(range(len(lines))):
        hay = _insert_at(hay, (j + 0.5) / len(lines), lines[j])
      return INTRO + hay + question

    prompt, ids = _fit(tok, ctx, build)
    items.append(Item("multikey", prompt, tuple(ids), vals[ask], "word", MAX_NEW["multikey"],
                      dict(depth=(ask + 0.5) / n_keys, key=keys[ask], n_keys=n_keys)))
  return items


_HEADING = re.compile(r"^((?:[1-3] )?[A-Z][A-Za-z]+(?: of [A-Z][A-Za-z]+| [A-Z][a-z]+)*) (\d+)$",
                      re.MULTILINE)

QA_INTRO = ("Below are consecutive chapters of the Bible; each chapter starts with a line "
            "giving its book and chapter number.\n\n")


def qa(tok, text: str, ctx: int, n: int, seed: int = 0, quote_words: int = 12) -> list[Item]:
  """Which chapter (of those in the context) contains a quoted passage."""
  heads = [(m.start(), f"{m.group(1)} {m.group(2)}") for m in _HEADING.finditer(text)]
  if len(heads) < 2:
    raise ValueError("qa needs a text with '<Book> <chapter>' heading lines (kjv, web-bible)")
  items = []
  for i in range(n):
    rng = _rng(seed, "qa", i)
    for _attempt in range(20):
      h0 = int(rng.integers(0, len(heads) - 1))
      start = heads[h0][0]

      def build(m, start=start):
        ids = tok.encode(text[start:start + max(64, m * 8)])[:m]
        return tok.decode(ids)

      # the document alone first, then the question around the fitted size
      doc = build(ctx)
      in_doc = [(p - start, name) for p, name in heads if start <= p < start + len(doc)]
      depth = DEPTHS[i % len(DEPTHS)]
      target = int(depth * len(doc))
      cands = [(p, name) for p, name in in_doc if p <= target]
      if not cands:
        continue
      p, gold = cands[-1]
      body_start = doc.find("\n", p) + 1
      nxt = [q for q, _ in in_doc if q > p]
      body = doc[body_start:(nxt[0] if nxt else len(doc))]
      words = body.split()
      if len(words) < quote_words + 4:
        continue
      w0 = int(rng.integers(0, len(words) - quote_words))
      quote = " ".join(words[w0:w0 + quote_words])
      question = (f'\n\nQuestion: which chapter of the text above contains the passage "{quote}"?'
                  "\nAnswer: The passage is in")

      def full(m, start=start, question=question):
        return QA_INTRO + build(m) + question

      prompt, ids = _fit(tok, ctx, full)
      body_text = prompt[len(QA_INTRO):len(prompt) - len(question)]
      if body_text.count(quote) != 1 or gold not in body_text:
        continue
      items.append(Item("qa", prompt, tuple(ids), gold, "chapter", MAX_NEW["qa"],
                        dict(depth=depth, quote=quote,
                             n_chapters=len(_HEADING.findall(body_text)))))
      break
    else:
      raise ValueError(f"qa: no checkable item {i} in 20 attempts (context {ctx} too short?)")
  return items


# a statement, not prose or a data table: a keyword or a name that is assigned or called
_CODE_LINE = re.compile(r"(return|if|elif|for|while|def|class|with|raise|yield|assert|"
                        r"import|from|try|except)\b|[A-Za-z_][\w.]*(\[[^]]*\])?\s*(=|\(|\+=)")


def code(tok, text: str, ctx: int, n: int, seed: int = 0, min_chars: int = 12) -> list[Item]:
  """LongBench LCC: the next line of real source code after a long context."""
  items = []
  for i in range(n):
    rng = _rng(seed, "code", i)
    for _attempt in range(200):
      pos = int(rng.integers(ctx * 8, len(text) - 200))
      pos = text.find("\n", pos) + 1
      end = text.find("\n", pos)
      gold = text[pos:end].strip()
      if len(gold) < min_chars or "=====" in gold or not _CODE_LINE.match(gold):
        continue
      prefix = text[max(0, pos - ctx * 8):pos]
      ids = tok.encode(prefix)
      if len(ids) > ctx:
        ids = ids[len(ids) - ctx:]
      prompt = tok.decode(ids)
      ids = tok.encode(prompt)
      while len(ids) > ctx:   # decode/encode may merge differently at the cut
        prompt = tok.decode(ids[len(ids) - ctx:])
        ids = tok.encode(prompt)
      if not prompt.endswith("\n"):
        continue
      items.append(Item("code", prompt, tuple(ids), gold, "edit_sim", MAX_NEW["code"],
                        dict(offset=pos)))
      break
    else:
      raise ValueError(f"code: no item {i} in 200 attempts")
  return items


BUILDERS = {"passkey": passkey, "needle": needle, "multikey": multikey, "qa": qa, "code": code}


def build_task(task: str, tok, ctx: int, n: int, seed: int = 0, text: str | None = None):
  """`n` items of `task` for a `ctx`-token budget; `text` defaults to the
  task's real text (DEFAULT_TEXT, read with dustin_jax.eval.texts)."""
  if task not in BUILDERS:
    raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
  if text is None:
    text = read_text(DEFAULT_TEXT[task], progress=False)
  return BUILDERS[task](tok, text, ctx, n, seed)


def mean_score(items: Sequence[Item], outputs: Sequence[str]) -> float:
  return float(np.mean([it.score(o) for it, o in zip(items, outputs)])) if items else 0.0
