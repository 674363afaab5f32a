"""synthetic_ende: English-like sentences from a probabilistic grammar, translated into German.

A sentence is first drawn as a small tree (`Sentence` of `Clause`s of `NP`s);
`english(tree)` renders it deterministically and `german(tree, rng)` translates
it with the grammar of `lexicon_ende`: gender and case agreement of articles
and adjective endings, verb-second order after a fronted adverb, verb-final
order in subordinate clauses, the perfect with its participle at the end,
noun compounds ("kitchen table" -> "Küchentisch"), preposition contractions,
and weighted synonym and tense choices (`lexicon_ende.PERFECT_PROB`), so the
reference translation of one source is a distribution, not a single string.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional, Sequence

from spec_decode.data.synthetic import lexicon_ende as lex

SENTENCE_KINDS = ("simple", "adverb", "coord", "subord", "that")
SENTENCE_WEIGHTS = (0.3, 0.2, 0.15, 0.2, 0.15)
VERB_KINDS = ("intransitive", "transitive", "ditransitive")
VERB_WEIGHTS = (0.25, 0.55, 0.2)
_VERBS = {"intransitive": lex.INTRANSITIVE_VERBS, "transitive": lex.TRANSITIVE_VERBS,
          "ditransitive": lex.DITRANSITIVE_VERBS, "clause": lex.CLAUSE_VERBS}


@dataclasses.dataclass(frozen=True)
class NP:
  """A noun phrase. kind: 'animate' | 'object' | 'place'; index into that table.

  modifier: index into COMPOUND_MODIFIERS (objects whose noun is a compound head) or None.
  """
  kind: str
  index: int
  definite: bool
  adjective: Optional[int] = None
  modifier: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Clause:
  """subject, verb (kind, index), optional objects and a prepositional phrase.

  pp: (preposition index or -1 for "in" + place, NP) or None.
  """
  subject: NP
  verb_kind: str
  verb: int
  tense: str
  indirect: Optional[NP] = None
  direct: Optional[NP] = None
  pp: Optional[tuple[int, NP]] = None


@dataclasses.dataclass(frozen=True)
class Sentence:
  """kind in SENTENCE_KINDS; connector: adverb / coordinator / subordinator index (or -1)."""
  kind: str
  clauses: tuple[Clause, ...]
  connector: int = -1


# ----------------------------------------------------------------------------- sampling trees
def _noun_phrase(rng: random.Random, kind: str) -> NP:
  table = {"animate": lex.ANIMATE_NOUNS, "object": lex.OBJECT_NOUNS, "place": lex.PLACES}[kind]
  index = rng.randrange(len(table))
  definite = kind == "place" or rng.random() < 0.65
  adjective = rng.randrange(len(lex.ADJECTIVES)) if rng.random() < 0.35 else None
  modifier = None
  if kind == "object" and table[index][0] in lex.COMPOUND_HEADS and rng.random() < 0.3:
    modifier = rng.randrange(len(lex.COMPOUND_MODIFIERS))
  return NP(kind, index, definite, adjective, modifier)


def _clause(rng: random.Random, tense: str, verb_kind: Optional[str] = None) -> Clause:
  if verb_kind is None:
    verb_kind = rng.choices(VERB_KINDS, VERB_WEIGHTS)[0]
  verb = rng.randrange(len(_VERBS[verb_kind]))
  subject = _noun_phrase(rng, "animate")
  indirect = _noun_phrase(rng, "animate") if verb_kind == "ditransitive" else None
  direct = None
  if verb_kind in ("transitive", "ditransitive"):
    direct = _noun_phrase(rng, "object" if rng.random() < 0.75 else "animate")
  pp = None
  if verb_kind != "clause" and rng.random() < 0.3:
    if rng.random() < 0.6:
      pp = (-1, _noun_phrase(rng, "place"))
    else:
      pp = (rng.randrange(len(lex.PREPOSITIONS)),
            _noun_phrase(rng, "animate" if rng.random() < 0.5 else "object"))
  return Clause(subject, verb_kind, verb, tense, indirect, direct, pp)


def sample_sentence(rng: random.Random) -> Sentence:
  """Draws a sentence tree from the grammar."""
  kind = rng.choices(SENTENCE_KINDS, SENTENCE_WEIGHTS)[0]
  tense = lambda: "past" if rng.random() < 0.4 else "present"
  if kind == "simple":
    return Sentence(kind, (_clause(rng, tense()),))
  if kind == "adverb":
    adverb = rng.randrange(len(lex.ADVERBS))
    return Sentence(kind, (_clause(rng, rng.choice(lex.ADVERBS[adverb][2])),), adverb)
  if kind == "coord":
    return Sentence(kind, (_clause(rng, tense()), _clause(rng, tense())),
                    rng.randrange(len(lex.COORDINATORS)))
  if kind == "subord":
    return Sentence(kind, (_clause(rng, tense()), _clause(rng, tense())),
                    rng.randrange(len(lex.SUBORDINATORS) + 1))  # last = "when"
  return Sentence(kind, (_clause(rng, tense(), "clause"), _clause(rng, tense())))


# ----------------------------------------------------------------------------- English
def _np_table(np_: NP):
  return {"animate": lex.ANIMATE_NOUNS, "object": lex.OBJECT_NOUNS, "place": lex.PLACES}[np_.kind]


def _english_np(np_: NP) -> list[str]:
  words = []
  if np_.adjective is not None:
    words.append(lex.ADJECTIVES[np_.adjective][0])
  if np_.modifier is not None:
    words.append(lex.COMPOUND_MODIFIERS[np_.modifier][0])
  words.append(_np_table(np_)[np_.index][0])
  article = "the" if np_.definite else ("an" if words[0][0] in "aeiou" else "a")
  return [article] + words


def _english_clause(c: Clause) -> list[str]:
  en_present, en_past, _ = _VERBS[c.verb_kind][c.verb]
  words = _english_np(c.subject) + [en_past if c.tense == "past" else en_present]
  if c.indirect is not None:
    words += _english_np(c.indirect)
  if c.direct is not None:
    words += _english_np(c.direct)
  if c.pp is not None:
    prep, np_ = c.pp
    words += ["in" if prep < 0 else lex.PREPOSITIONS[prep][0]] + _english_np(np_)
  return words


def english(s: Sentence) -> str:
  """The source sentence (deterministic)."""
  first = _english_clause(s.clauses[0])
  if s.kind == "simple":
    words = first
  elif s.kind == "adverb":
    words = [lex.ADVERBS[s.connector][0]] + first
  elif s.kind == "coord":
    words = first + [lex.COORDINATORS[s.connector][0]] + _english_clause(s.clauses[1])
  elif s.kind == "subord":
    conj = "when" if s.connector == len(lex.SUBORDINATORS) else lex.SUBORDINATORS[s.connector][0]
    words = first + [conj] + _english_clause(s.clauses[1])
  else:
    words = first + ["that"] + _english_clause(s.clauses[1])
  return _sentence_text(words)


# ----------------------------------------------------------------------------- German
def _pick(rng: random.Random, alternatives: Sequence[tuple]) -> tuple:
  """One alternative, drawn with the weights in each alternative's last field."""
  return rng.choices(alternatives, [a[-1] for a in alternatives])[0]


def _german_np(np_: NP, case: str, rng: random.Random) -> list[str]:
  noun, gender, _ = _pick(rng, _np_table(np_)[np_.index][1])
  if np_.modifier is not None:
    noun = lex.COMPOUND_MODIFIERS[np_.modifier][1] + noun.lower()
  key = (case, gender)
  words = [lex.DEFINITE[key] if np_.definite else lex.INDEFINITE[key]]
  if np_.adjective is not None:
    stem = _pick(rng, lex.ADJECTIVES[np_.adjective][1])[0]
    ending = (lex.WEAK_ENDING if np_.definite else lex.MIXED_ENDING)[key]
    if stem.endswith("e") and ending.startswith("e"):
      ending = ending[1:]
    words.append(stem + ending)
  return words + [noun]


def _german_pp(pp: tuple[int, NP], rng: random.Random) -> list[str]:
  prep_index, np_ = pp
  if prep_index < 0:
    prep, case = "in", "dat"
  else:
    _, alts, case = lex.PREPOSITIONS[prep_index]
    prep = _pick(rng, alts)[0]
  words = _german_np(np_, case, rng)
  contracted = lex.CONTRACTIONS.get((prep, words[0]))
  return [contracted] + words[1:] if contracted else [prep] + words


def _german_clause(c: Clause, order: str, rng: random.Random) -> list[str]:
  """order: 'main' (subject first, verb second), 'inverted' (verb first), 'final'."""
  present, past, participle, aux, _ = _pick(rng, _VERBS[c.verb_kind][c.verb][2])
  perfect = c.tense == "past" and rng.random() < lex.PERFECT_PROB
  finite = aux if perfect else (past if c.tense == "past" else present)
  subject = _german_np(c.subject, "nom", rng)
  middle = []
  if c.indirect is not None:
    middle += _german_np(c.indirect, "dat", rng)
  if c.direct is not None:
    middle += _german_np(c.direct, "acc", rng)
  if c.pp is not None:
    middle += _german_pp(c.pp, rng)
  tail = [participle] if perfect else []
  if order == "main":
    return subject + [finite] + middle + tail
  if order == "inverted":
    return [finite] + subject + middle + tail
  return subject + middle + tail + [finite]


def german(s: Sentence, rng: random.Random) -> str:
  """One draw from the reference translation distribution of `s`."""
  first = s.clauses[0]
  if s.kind == "simple":
    words = _german_clause(first, "main", rng)
  elif s.kind == "adverb":
    adverb = _pick(rng, lex.ADVERBS[s.connector][1])[0]
    words = [adverb] + _german_clause(first, "inverted", rng)
  elif s.kind == "coord":
    conj = _pick(rng, lex.COORDINATORS[s.connector][1])[0]
    words = _german_clause(first, "main", rng) + ([conj] if conj == "und" else [",", conj])
    words += _german_clause(s.clauses[1], "main", rng)
  elif s.kind == "subord":
    if s.connector == len(lex.SUBORDINATORS):
      conj = lex.WHEN_PAST if s.clauses[1].tense == "past" else lex.WHEN_PRESENT
    else:
      conj = _pick(rng, lex.SUBORDINATORS[s.connector][1])[0]
    words = _german_clause(first, "main", rng) + [",", conj]
    words += _german_clause(s.clauses[1], "final", rng)
  else:
    words = _german_clause(first, "main", rng) + [",", lex.THAT]
    words += _german_clause(s.clauses[1], "final", rng)
  return _sentence_text(words)


def _sentence_text(words: list[str]) -> str:
  text = " ".join(words).replace(" ,", ",") + "."
  return text[0].upper() + text[1:]


def example(seed: str) -> dict[str, str]:
  """The example named by `seed`: its source tree and one reference draw."""
  return {"inputs": english(sample_sentence(random.Random(seed))),
          "targets": reference(seed, random.Random(seed + "/de"))}


def reference(seed: str, rng: random.Random) -> str:
  """A translation of the example named by `seed`, its choices drawn from `rng`."""
  return german(sample_sentence(random.Random(seed)), rng)
