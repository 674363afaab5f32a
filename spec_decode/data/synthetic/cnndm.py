"""synthetic_cnndm: long news-like articles whose summary restates their salient sentences.

An article (200-400 words) opens with an EVENT sentence and hides two more
salient sentences, a COST fact and an OUTCOME, among filler sentences
(background, quotes, weather, history, unrelated local news). The summary
restates EVENT, COST and OUTCOME in that order, each through one of several
paraphrase templates drawn with the weights in `PARAPHRASES`, so a summarizer
must find the salient sentences wherever they are and the reference has
controlled entropy. All names, places and templates were written for this project.
"""

from __future__ import annotations

import random

FIRST_NAMES = ("Anja", "Boris", "Carla", "Dario", "Elin", "Fabian", "Greta", "Hugo", "Ines",
               "Jonas", "Katrin", "Lukas", "Mira", "Niko", "Olga", "Pavel", "Rosa", "Stefan",
               "Tilda", "Viktor")
LAST_NAMES = ("Albrecht", "Brenner", "Castell", "Dorn", "Eckhart", "Falk", "Gruber", "Hollis",
              "Ivers", "Jansen", "Kessler", "Lind", "Morrow", "Norell", "Ostrov", "Pike",
              "Quist", "Rask", "Sorel", "Tamm")
TITLES = ("mayor", "minister", "director", "governor", "spokesperson", "chairman", "president")
PLACES = ("Valdoria", "Brennick", "Osterhal", "Millbrook", "Karsund", "Lenwick", "Tarnow",
          "Elmsby", "Rovigo", "Dunmere", "Halvik", "Pellham")
ORGS = ("the city council", "the regional government", "the health agency", "the rail company",
        "the university", "the water board", "the port authority", "the school district",
        "the energy company", "the football club")
ACTIONS = ("build a new bridge", "open a children's hospital", "close the old steel factory",
           "repair the main road", "expand the airport", "build a solar park",
           "renovate the central library", "open a new train line", "replace the water pipes",
           "build a sports stadium", "restore the harbor wall", "open a research center")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December")

# Weighted paraphrase templates of the three salient sentence types.
PARAPHRASES = {
    "event": (("{org_cap} will {action} , {title} {name} said .", 0.5),
              ("{title_cap} {name} said {org} will {action} .", 0.3),
              ("{org_cap} plans to {action} in {place} .", 0.2)),
    "cost": (("The project will cost {cost} million dollars .", 0.6),
             ("It is expected to cost {cost} million dollars .", 0.4)),
    "outcome": (("Work should be finished by {month} {year} .", 0.7),
                ("The work is due to end in {month} {year} .", 0.3)),
}

_ARTICLE = {
    "event": "{title_cap} {name} of {place} announced on {day} that {org} will {action} .",
    "cost": "According to officials , the plan will cost about {cost} million dollars "
            "and will be paid for by {payer} .",
    "outcome": "If everything goes to plan , the work will be completed in {month} {year} .",
}
_FILLERS = (
    "{place} has a population of about {n} thousand people and lies near the coast .",
    "\" This is a very important day for our community , \" said {other} , a local resident .",
    "The weather on {day} was {weather} , and many people stayed at home .",
    "The town was founded in {old_year} and is known for its old market square .",
    "Local shops reported a busy weekend as visitors arrived from nearby towns .",
    "{other} , who has lived in {place} for {k} years , said she had mixed feelings about it .",
    "Some residents have complained about traffic in the town center in recent months .",
    "The local newspaper first reported the plans last {month2} .",
    "Critics argue that the money could be spent on schools and public transport instead .",
    "A public meeting will be held at the town hall next week .",
    "Several similar projects in other towns were delayed by problems with funding .",
    "The football team of {place} won its last match {a} to {b} on {day2} .",
    "{other} , a teacher at the local school , said the children were excited .",
    "The police said the roads around the site would be closed for a few days .",
    "Last year , the town celebrated its annual summer festival with music and food .",
    "Experts say the region has seen strong growth in tourism over the past decade .",
)
_WEATHER = ("cold and windy", "warm and sunny", "wet and grey", "foggy", "mild")
_PAYERS = ("the national government", "private investors", "local taxes", "a European fund")
MIN_WORDS, MAX_WORDS = 200, 400


def _slots(rng: random.Random) -> dict[str, str]:
  person = lambda: f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
  title, org = rng.choice(TITLES), rng.choice(ORGS)
  name, other = person(), person()
  while other == name:
    other = person()
  return dict(title=title, title_cap=title.capitalize(), name=name, other=other,
              place=rng.choice(PLACES), org=org, org_cap=org[0].upper() + org[1:],
              action=rng.choice(ACTIONS), day=rng.choice(DAYS), day2=rng.choice(DAYS),
              cost=str(rng.randrange(2, 900)), payer=rng.choice(_PAYERS),
              month=rng.choice(MONTHS), month2=rng.choice(MONTHS),
              year=str(rng.randrange(2025, 2036)), old_year=str(rng.randrange(1100, 1900)),
              n=str(rng.randrange(5, 400)), k=str(rng.randrange(3, 60)),
              a=str(rng.randrange(0, 6)), b=str(rng.randrange(0, 6)),
              weather=rng.choice(_WEATHER))


def _words(sentences: list[str]) -> int:
  return sum(len(s.split()) for s in sentences)


def article_and_summary(rng: random.Random, summary_rng: random.Random) -> dict[str, str]:
  """One article (fillers drawn until it has 200-400 words) and one summary draw."""
  slots = _slots(rng)
  salient = {k: t.format(**slots) for k, t in _ARTICLE.items()}
  fillers = [f.format(**slots) for f in rng.sample(_FILLERS, len(_FILLERS))]
  body = [salient["cost"], salient["outcome"]]
  budget = rng.randrange(MIN_WORDS, MAX_WORDS - 40)
  used = 0
  while _words([salient["event"]] + body) < budget and used < len(fillers):
    body.insert(rng.randrange(len(body) + 1), fillers[used])
    used += 1
  article = " ".join([salient["event"]] + body)
  summary = []
  for kind in ("event", "cost", "outcome"):
    options = PARAPHRASES[kind]
    template = summary_rng.choices([t for t, _ in options], [w for _, w in options])[0]
    summary.append(template.format(**slots))
  return {"inputs": article, "targets": " ".join(summary)}


def example(seed: str) -> dict[str, str]:
  """The example named by `seed`."""
  return article_and_summary(random.Random(seed), random.Random(seed + "/summary"))


def reference(seed: str, rng: random.Random) -> str:
  """A summary of the article named by `seed`, its paraphrases drawn from `rng`."""
  return article_and_summary(random.Random(seed), rng)["targets"]
