"""LongBench-style task builders: deterministic, checkable, within budget."""


import pytest

from dustin_jax.eval import tasks
from dustin_jax.profiling.runtime import ByteTokenizer

TOK = ByteTokenizer()
CTX = 3000


@pytest.fixture(scope="module")
def texts():
  from dustin_jax.eval.texts import read_text
  try:
    return {"kjv": read_text("kjv", progress=False),
            "python-stdlib": read_text("python-stdlib", progress=False)}
  except Exception as e:  # a missing optional text source
    pytest.skip(f"texts not available: {e}")


def build(task, texts, seed=0, n=3, ctx=CTX):
  return tasks.build_task(task, TOK, ctx, n, seed=seed, text=texts[tasks.DEFAULT_TEXT[task]])


@pytest.mark.parametrize("task", tasks.TASKS)
def test_deterministic_within_budget_and_gold_scores_one(texts, task):
  a, b = build(task, texts), build(task, texts)
  assert [(x.prompt, x.answer) for x in a] == [(x.prompt, x.answer) for x in b]
  c = build(task, texts, seed=1)
  assert [x.prompt for x in c] != [x.prompt for x in a]
  for it in a:
    assert len(it.prompt_ids) <= CTX
    assert list(it.prompt_ids) == TOK.encode(it.prompt)
    assert len(it.prompt_ids) > 0.9 * CTX   # the budget is used, not wasted
    assert it.score(" " + it.answer + "\n") == 1.0
    assert it.score(" something else entirely\n") < 1.0


@pytest.mark.parametrize("task", ["passkey", "needle", "multikey"])
def test_the_answer_is_in_the_context_at_its_depth(texts, task):
  for it in build(task, texts, n=5):
    body = it.prompt[len(tasks.INTRO):]
    at = body.find(it.answer)
    assert at >= 0, it.answer
    if task != "multikey":
      assert abs(at / len(body) - it.meta["depth"]) < 0.1
    # the question itself does not reveal the answer
    assert it.answer not in it.prompt.rsplit("\n\n", 1)[1]


def test_qa_quote_once_and_gold_chapter_heading_before_it(texts):
  for it in build("qa", texts, n=4, ctx=4000):
    body = it.prompt[len(tasks.QA_INTRO):]
    quote = it.meta["quote"]
    assert body.count(quote) == 2   # once in the text, once in the question
    at = body.find(quote)
    heads = [(m.start(), f"{m.group(1)} {m.group(2)}") for m in tasks._HEADING.finditer(body)]
    assert [name for p, name in heads if p < at][-1] == it.answer
    assert it.score(" Genesis 99.") == 0.0 or it.answer == "Genesis 99"


def test_code_gold_is_the_next_line_of_the_real_file(texts):
  src = texts["python-stdlib"]
  for it in build("code", texts, n=3):
    off = it.meta["offset"]
    assert src[:off].endswith(it.prompt)
    assert src[off:].split("\n", 1)[0].strip() == it.answer


def test_scorers():
  assert tasks.score_number("12345 is it", "12345") == 1.0
  assert tasks.score_number("it is 1234", "12345") == 0.0
  assert tasks.score_word(' "ab12cd34".', "ab12cd34") == 1.0
  assert tasks.score_word(" ab12cd35", "ab12cd34") == 0.0
  assert tasks.score_contains("\n  Lucia likes the Cello.\nbanjo", "cello") == 1.0
  assert tasks.score_contains("violoncellos", "cello") == 0.0
  assert tasks.score_chapter(" Song of Solomon 3.", "Song of Solomon 3") == 1.0
  assert tasks.score_chapter(" 1 Kings 12, verse 4", "1 Kings 12") == 1.0
  assert tasks.score_chapter(" 1 Kings 13", "1 Kings 12") == 0.0


def test_edit_similarity():
  es = tasks.edit_similarity
  assert es("abc", "abc") == 1.0 and es("", "") == 1.0
  assert es("abc", "") == 0.0
  assert tasks.levenshtein("kitten", "sitting") == 3
  assert es("kitten", "sitting") == pytest.approx(1 - 3 / 7)
  assert es("return x + 1", "return x + 2") > es("return x + 1", "pass")
  assert tasks.score_edit_sim("\n    return x + 1  \nmore", "return x + 1") == 1.0


def test_unknown_task():
  with pytest.raises(ValueError, match="unknown task"):
    tasks.build_task("summarise", TOK, 100, 1, text="x")
