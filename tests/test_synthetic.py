"""The synthetic tasks: determinism, sizes, disjoint splits, grammar, vocabulary, probabilities."""

import collections
import random
import re

import numpy as np
import pytest

from spec_decode.data import synthetic_tasks
from spec_decode.data.synthetic import cnndm, ende, splits, vocab
from spec_decode.data.synthetic import lexicon_ende as lex


def _within(count: int, n: int, p: float, sigmas: float = 4.5) -> bool:
  return abs(count - n * p) <= sigmas * np.sqrt(n * p * (1 - p))


def test_generators_are_deterministic_and_seed_dependent():
  for make in (ende.example, cnndm.example):
    assert make("seed-a") == make("seed-a")
    assert make("seed-a") != make("seed-b")
  first = splits.examples("synthetic_ende", "validation", size=50)
  splits._generator.cache_clear()
  assert splits.examples("synthetic_ende", "validation", size=50) == first


def test_split_sizes_and_disjointness():
  for task in splits.GENERATORS:
    test = splits.examples(task, "test")
    val = splits.examples(task, "validation")
    train = splits.examples(task, "train", size=2000)
    assert len(test) == splits.SPLIT_SIZES[task]["test"]
    assert len(val) == splits.SPLIT_SIZES[task]["validation"]
    src = [set(ex["inputs"] for ex in s) for s in (test, val, train)]
    assert len(src[0]) == len(test) and len(src[1]) == len(val) and len(src[2]) == len(train)
    assert not (src[0] & src[1]) and not (src[0] & src[2]) and not (src[1] & src[2])
  with pytest.raises(ValueError, match="unknown split"):
    splits.examples("synthetic_ende", "dev")
  with pytest.raises(ValueError, match="unknown synthetic task"):
    splits.examples("wmt", "test")
  with pytest.raises(ValueError, match="size must be"):
    splits.examples("synthetic_ende", "test", size=10**6)


def test_cnndm_lengths_and_salient_content():
  for ex in splits.examples("synthetic_cnndm", "validation", size=200):
    words = ex["inputs"].split()
    assert cnndm.MIN_WORDS <= len(words) <= cnndm.MAX_WORDS
    cost = re.search(r"cost about (\d+) million", ex["inputs"]).group(1)
    assert f"cost {cost} million dollars" in ex["targets"]  # the summary restates the fact
    assert len(ex["targets"].split()) < len(words) / 4


def _tree(**clause):
  man = ende.NP("animate", 0, True, adjective=2)  # "the old man"
  base = dict(subject=man, verb_kind="transitive", verb=3, tense="present",
              direct=ende.NP("object", 0, False))  # reads a book
  base.update(clause)
  return ende.Clause(**base)


def test_grammar_agreement_and_word_order():
  rng = random.Random(0)
  s = ende.Sentence("simple", (_tree(),))
  assert ende.english(s) == "The old man reads a book."
  assert ende.german(s, rng) == "Der alte Mann liest ein Buch."
  # Accusative masculine object, dative contraction, mixed adjective ending.
  obj = ende.NP("animate", 0, False, adjective=2)  # an old man
  s = ende.Sentence("simple", (_tree(direct=obj, pp=(-1, ende.NP("place", 0, True))),))
  assert ende.english(s) == "The old man reads an old man in the park."
  assert ende.german(s, rng) == "Der alte Mann liest einen alten Mann im Park."
  # Verb second after a fronted adverb; verb final after a subordinator; compounds.
  s = ende.Sentence("adverb", (_tree(),), connector=0)  # today
  assert ende.german(s, rng) == "Heute liest der alte Mann ein Buch."
  table = ende.NP("object", 4, True, modifier=2)  # the kitchen table
  s = ende.Sentence("subord", (_tree(), _tree(direct=table)), connector=1)  # although
  assert ende.english(s) == ("The old man reads a book although the old man reads the "
                             "kitchen table.")
  assert ende.german(s, rng) == ("Der alte Mann liest ein Buch, obwohl der alte Mann den "
                                 "Küchentisch liest.")
  # Ditransitive: dative before accusative.
  woman = ende.NP("animate", 1, True)
  s = ende.Sentence("simple", (_tree(verb_kind="ditransitive", verb=1, indirect=woman),))
  assert ende.german(s, rng) == "Der alte Mann zeigt der Frau ein Buch."


def test_stochastic_choices_have_their_stated_probabilities():
  car = ende.NP("object", [e for e, _ in lex.OBJECT_NOUNS].index("car"), True)
  clause = _tree(direct=car, tense="past")
  s = ende.Sentence("simple", (clause,))
  n, rng = 4000, random.Random(1)
  outs = [ende.german(s, rng) for _ in range(n)]
  auto = sum("das Auto" in o for o in outs)
  wagen = sum("den Wagen" in o for o in outs)
  assert auto + wagen == n
  assert _within(auto, n, 0.75)
  perfect = sum(o.endswith("gelesen.") and " hat " in o for o in outs)
  assert sum(" las " in o for o in outs) == n - perfect
  assert _within(perfect, n, lex.PERFECT_PROB)
  # Summary paraphrases of one article.
  counts = collections.Counter()
  for i in range(n):
    summary = cnndm.article_and_summary(random.Random("article"), random.Random(i))["targets"]
    counts["project" if "The project will cost" in summary else "expected"] += 1
  assert _within(counts["project"], n, 0.6)
  lex.check_lexicon()


def test_vocabulary_covers_the_tasks():
  v = vocab.Vocab()
  assert v.vocab_size == vocab.VOCAB_SIZE
  sp = v._sp
  assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
  for task in splits.GENERATORS:
    for ex in splits.examples(task, "test", size=300):
      for text in (ex["inputs"], ex["targets"]):
        ids = v.encode(text)
        assert vocab.UNK_ID not in ids
        assert v.decode(ids + [vocab.EOS_ID, 7]) == text
  # Every German word form of the dictionary occurs in the training targets.
  text = " ".join(ex["targets"] for ex in splits.examples("synthetic_ende", "train", size=20000))
  words = set(re.findall(r"\w+", text))
  for table in (lex.ANIMATE_NOUNS, lex.OBJECT_NOUNS, lex.PLACES):
    for _, alts in table:
      for noun, _, _ in alts:
        assert noun in words, noun
  for group in (lex.TRANSITIVE_VERBS, lex.DITRANSITIVE_VERBS, lex.INTRANSITIVE_VERBS,
                lex.CLAUSE_VERBS):
    for _, _, alts in group:
      for present, past, participle, _, _ in alts:
        assert {present, past, participle} <= words, (present, past, participle)


def test_offline_source_tokenizes_with_eos():
  source = synthetic_tasks.offline_source("synthetic_ende")
  split = source.tokenized("validation", 10)
  assert len(split) == 10 and all(t[-1] == 1 and 1 not in t[:-1] for t in split.targets)
  assert source.metric == "bleu"
  with pytest.raises(ValueError, match="unknown offline task"):
    synthetic_tasks.offline_source("nope")


@pytest.mark.parametrize("task,salt", [("synthetic_ende", "/de"), ("synthetic_cnndm", "/summary")])
def test_other_references_for_the_same_inputs(task, salt):
  examples = splits.examples(task, "test", size=40)
  # The example's own rng salt redraws exactly its reference.
  assert splits.references(task, "test", size=40, salt=salt) == [e["targets"] for e in examples]
  resampled = splits.references(task, "test", size=40)
  mode = splits.references(task, "test", size=40, mode="mode")
  assert mode == splits.references(task, "test", size=40, mode="mode")
  assert resampled != [e["targets"] for e in examples]  # stochastic choices differ somewhere
  assert len(set(mode)) == 40
  with pytest.raises(ValueError, match="mode"):
    splits.references(task, "test", size=2, mode="best")


def test_most_likely_rng_takes_the_heaviest_option():
  rng = splits.MostLikely(0)
  assert rng.choices(["a", "b", "c"], [0.2, 0.5, 0.3]) == ["b"]
  assert rng.random() == 0.5
  # 'Doktor' (weight 0.3) never wins against 'Arzt' (0.7) in mode references.
  mode = " ".join(splits.references("synthetic_ende", "test", size=200, mode="mode"))
  assert "Arzt" in mode and "Doktor" not in mode
