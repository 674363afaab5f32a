"""The dictionary of the synthetic English -> German-like translation task.

Every German-side entry is a tuple of alternatives with weights: when a word
has several renderings (synonyms), the translator draws one with these exact
probabilities, so the reference distribution has controlled entropy. Weights of
one entry sum to 1 (checked by `check_lexicon`). Genders are 'm', 'f', 'n'.

Written for this project; only masculine and feminine nouns with regular
(strong) declension are used, so the article and the adjective ending are the
only case markers.
"""

from __future__ import annotations

# (english, ((german, gender, weight), ...)); animate nouns can be subjects.
ANIMATE_NOUNS = (
    ("man", (("Mann", "m", 1.0),)),
    ("woman", (("Frau", "f", 1.0),)),
    ("child", (("Kind", "n", 1.0),)),
    ("dog", (("Hund", "m", 1.0),)),
    ("cat", (("Katze", "f", 1.0),)),
    ("teacher", (("Lehrer", "m", 0.8), ("Lehrmeister", "m", 0.2))),
    ("doctor", (("Arzt", "m", 0.7), ("Doktor", "m", 0.3))),
    ("baker", (("Bäcker", "m", 1.0),)),
    ("cook", (("Koch", "m", 1.0),)),
    ("girl", (("Mädchen", "n", 1.0),)),
    ("friend", (("Freund", "m", 1.0),)),
    ("king", (("König", "m", 1.0),)),
    ("queen", (("Königin", "f", 1.0),)),
    ("bird", (("Vogel", "m", 1.0),)),
    ("horse", (("Pferd", "n", 0.8), ("Ross", "n", 0.2))),
    ("mouse", (("Maus", "f", 1.0),)),
    ("pupil", (("Schüler", "m", 1.0),)),
    ("painter", (("Maler", "m", 1.0),)),
    ("sister", (("Schwester", "f", 1.0),)),
    ("brother", (("Bruder", "m", 1.0),)),
    ("mother", (("Mutter", "f", 1.0),)),
    ("father", (("Vater", "m", 1.0),)),
    ("fisherman", (("Fischer", "m", 1.0),)),
    ("driver", (("Fahrer", "m", 1.0),)),
    ("singer", (("Sängerin", "f", 1.0),)),
    ("nurse", (("Pflegerin", "f", 0.6), ("Krankenschwester", "f", 0.4))),
)

OBJECT_NOUNS = (
    ("book", (("Buch", "n", 1.0),)),
    ("ball", (("Ball", "m", 1.0),)),
    ("apple", (("Apfel", "m", 1.0),)),
    ("letter", (("Brief", "m", 1.0),)),
    ("table", (("Tisch", "m", 1.0),)),
    ("chair", (("Stuhl", "m", 1.0),)),
    ("door", (("Tür", "f", 1.0),)),
    ("window", (("Fenster", "n", 1.0),)),
    ("car", (("Auto", "n", 0.75), ("Wagen", "m", 0.25))),
    ("bus", (("Bus", "m", 1.0),)),
    ("bread", (("Brot", "n", 1.0),)),
    ("cake", (("Kuchen", "m", 1.0),)),
    ("flower", (("Blume", "f", 1.0),)),
    ("key", (("Schlüssel", "m", 1.0),)),
    ("picture", (("Bild", "n", 0.8), ("Gemälde", "n", 0.2))),
    ("cup", (("Tasse", "f", 1.0),)),
    ("bag", (("Tasche", "f", 1.0),)),
    ("lamp", (("Lampe", "f", 1.0),)),
    ("newspaper", (("Zeitung", "f", 1.0),)),
    ("bicycle", (("Fahrrad", "n", 0.7), ("Rad", "n", 0.3))),
    ("bottle", (("Flasche", "f", 1.0),)),
    ("box", (("Kiste", "f", 0.6), ("Schachtel", "f", 0.4))),
    ("hat", (("Hut", "m", 1.0),)),
    ("coat", (("Mantel", "m", 1.0),)),
    ("ship", (("Schiff", "n", 1.0),)),
    ("boat", (("Boot", "n", 1.0),)),
    ("song", (("Lied", "n", 1.0),)),
    ("map", (("Karte", "f", 1.0),)),
    ("shoe", (("Schuh", "m", 1.0),)),
    ("glass", (("Glas", "n", 1.0),)),
    ("knife", (("Messer", "n", 1.0),)),
    ("spoon", (("Löffel", "m", 1.0),)),
    ("clock", (("Uhr", "f", 1.0),)),
    ("gift", (("Geschenk", "n", 1.0),)),
    ("stone", (("Stein", "m", 1.0),)),
)

# Nouns that take a compound modifier: "the kitchen table" -> "der Küchentisch".
COMPOUND_HEADS = ("table", "door", "bottle", "coat", "cake", "lamp", "chair", "key", "bag",
                  "map", "clock", "book", "bus", "hat", "glass", "window", "picture", "shoe")

# (english modifier, German combining stem)
COMPOUND_MODIFIERS = (
    ("school", "Schul"), ("house", "Haus"), ("kitchen", "Küchen"), ("garden", "Garten"),
    ("city", "Stadt"), ("water", "Wasser"), ("apple", "Apfel"), ("sun", "Sonnen"),
    ("rain", "Regen"), ("winter", "Winter"), ("summer", "Sommer"), ("night", "Nacht"),
    ("travel", "Reise"), ("birthday", "Geburtstags"),
)

# Places of "in the X" phrases: (english, ((german, gender, weight), ...)).
PLACES = (
    ("park", (("Park", "m", 1.0),)),
    ("garden", (("Garten", "m", 1.0),)),
    ("kitchen", (("Küche", "f", 1.0),)),
    ("city", (("Stadt", "f", 1.0),)),
    ("forest", (("Wald", "m", 0.85), ("Forst", "m", 0.15))),
    ("school", (("Schule", "f", 1.0),)),
    ("house", (("Haus", "n", 1.0),)),
    ("village", (("Dorf", "n", 1.0),)),
    ("market", (("Markt", "m", 1.0),)),
    ("street", (("Straße", "f", 0.8), ("Gasse", "f", 0.2))),
    ("station", (("Bahnhof", "m", 1.0),)),
    ("library", (("Bibliothek", "f", 1.0),)),
    ("office", (("Büro", "n", 1.0),)),
    ("castle", (("Schloss", "n", 0.7), ("Burg", "f", 0.3))),
    ("church", (("Kirche", "f", 1.0),)),
    ("harbor", (("Hafen", "m", 1.0),)),
    ("field", (("Feld", "n", 1.0),)),
    ("museum", (("Museum", "n", 1.0),)),
    ("hotel", (("Hotel", "n", 1.0),)),
)

# (english, ((German stem, weight), ...)); stems take the declension endings.
ADJECTIVES = (
    ("big", (("groß", 0.8), ("riesig", 0.2))),
    ("small", (("klein", 1.0),)),
    ("old", (("alt", 1.0),)),
    ("new", (("neu", 1.0),)),
    ("red", (("rot", 1.0),)),
    ("green", (("grün", 1.0),)),
    ("blue", (("blau", 1.0),)),
    ("young", (("jung", 1.0),)),
    ("happy", (("glücklich", 0.7), ("froh", 0.3))),
    ("tired", (("müde", 1.0),)),
    ("quiet", (("leise", 0.6), ("still", 0.4))),
    ("loud", (("laut", 1.0),)),
    ("beautiful", (("schön", 0.7), ("hübsch", 0.3))),
    ("cold", (("kalt", 1.0),)),
    ("warm", (("warm", 1.0),)),
    ("long", (("lang", 1.0),)),
    ("short", (("kurz", 1.0),)),
    ("heavy", (("schwer", 1.0),)),
    ("clever", (("klug", 0.6), ("schlau", 0.4))),
    ("brave", (("mutig", 1.0),)),
    ("strange", (("seltsam", 0.7), ("merkwürdig", 0.3))),
    ("friendly", (("freundlich", 1.0),)),
    ("rich", (("reich", 1.0),)),
    ("poor", (("arm", 1.0),)),
    ("fast", (("schnell", 0.8), ("rasch", 0.2))),
    ("slow", (("langsam", 1.0),)),
)

# Verbs: (en present 3sg, en past, ((de present 3sg, de past 3sg, participle, aux, weight), ...))
TRANSITIVE_VERBS = (
    ("sees", "saw", (("sieht", "sah", "gesehen", "hat", 0.8),
                     ("erblickt", "erblickte", "erblickt", "hat", 0.2))),
    ("finds", "found", (("findet", "fand", "gefunden", "hat", 1.0),)),
    ("buys", "bought", (("kauft", "kaufte", "gekauft", "hat", 0.85),
                        ("erwirbt", "erwarb", "erworben", "hat", 0.15))),
    ("reads", "read", (("liest", "las", "gelesen", "hat", 1.0),)),
    ("likes", "liked", (("mag", "mochte", "gemocht", "hat", 1.0),)),
    ("carries", "carried", (("trägt", "trug", "getragen", "hat", 1.0),)),
    ("paints", "painted", (("malt", "malte", "gemalt", "hat", 1.0),)),
    ("visits", "visited", (("besucht", "besuchte", "besucht", "hat", 1.0),)),
    ("hears", "heard", (("hört", "hörte", "gehört", "hat", 1.0),)),
    ("opens", "opened", (("öffnet", "öffnete", "geöffnet", "hat", 1.0),)),
    ("builds", "built", (("baut", "baute", "gebaut", "hat", 1.0),)),
    ("washes", "washed", (("wäscht", "wusch", "gewaschen", "hat", 1.0),)),
    ("holds", "held", (("hält", "hielt", "gehalten", "hat", 1.0),)),
    ("needs", "needed", (("braucht", "brauchte", "gebraucht", "hat", 1.0),)),
    ("takes", "took", (("nimmt", "nahm", "genommen", "hat", 1.0),)),
    ("loses", "lost", (("verliert", "verlor", "verloren", "hat", 1.0),)),
    ("draws", "drew", (("zeichnet", "zeichnete", "gezeichnet", "hat", 1.0),)),
    ("loves", "loved", (("liebt", "liebte", "geliebt", "hat", 1.0),)),
    ("sells", "sold", (("verkauft", "verkaufte", "verkauft", "hat", 1.0),)),
    ("catches", "caught", (("fängt", "fing", "gefangen", "hat", 1.0),)),
)

DITRANSITIVE_VERBS = (
    ("gives", "gave", (("gibt", "gab", "gegeben", "hat", 0.85),
                       ("schenkt", "schenkte", "geschenkt", "hat", 0.15))),
    ("shows", "showed", (("zeigt", "zeigte", "gezeigt", "hat", 1.0),)),
    ("sends", "sent", (("schickt", "schickte", "geschickt", "hat", 0.7),
                       ("sendet", "sandte", "gesandt", "hat", 0.3))),
    ("brings", "brought", (("bringt", "brachte", "gebracht", "hat", 1.0),)),
    ("offers", "offered", (("bietet", "bot", "geboten", "hat", 1.0),)),
)

INTRANSITIVE_VERBS = (
    ("sleeps", "slept", (("schläft", "schlief", "geschlafen", "hat", 1.0),)),
    ("laughs", "laughed", (("lacht", "lachte", "gelacht", "hat", 1.0),)),
    ("sings", "sang", (("singt", "sang", "gesungen", "hat", 1.0),)),
    ("waits", "waited", (("wartet", "wartete", "gewartet", "hat", 1.0),)),
    ("works", "worked", (("arbeitet", "arbeitete", "gearbeitet", "hat", 1.0),)),
    ("runs", "ran", (("läuft", "lief", "gelaufen", "ist", 0.7),
                     ("rennt", "rannte", "gerannt", "ist", 0.3))),
    ("comes", "came", (("kommt", "kam", "gekommen", "ist", 1.0),)),
    ("dances", "danced", (("tanzt", "tanzte", "getanzt", "hat", 1.0),)),
    ("swims", "swam", (("schwimmt", "schwamm", "geschwommen", "ist", 1.0),)),
    ("plays", "played", (("spielt", "spielte", "gespielt", "hat", 1.0),)),
)

# Verbs that take a "that"-clause: same layout as the verbs above.
CLAUSE_VERBS = (
    ("knows", "knew", (("weiß", "wusste", "gewusst", "hat", 1.0),)),
    ("says", "said", (("sagt", "sagte", "gesagt", "hat", 1.0),)),
    ("thinks", "thought", (("denkt", "dachte", "gedacht", "hat", 0.7),
                           ("glaubt", "glaubte", "geglaubt", "hat", 0.3))),
    ("hopes", "hoped", (("hofft", "hoffte", "gehofft", "hat", 1.0),)),
)

# Fronted adverbs trigger verb-second inversion. tense: which tenses they allow.
ADVERBS = (
    ("today", (("heute", 1.0),), ("present", "past")),
    ("yesterday", (("gestern", 1.0),), ("past",)),
    ("now", (("jetzt", 0.7), ("nun", 0.3)), ("present",)),
    ("often", (("oft", 1.0),), ("present", "past")),
    ("sometimes", (("manchmal", 1.0),), ("present", "past")),
    ("then", (("dann", 1.0),), ("present", "past")),
    ("suddenly", (("plötzlich", 1.0),), ("present", "past")),
)

# Prepositions: (english, ((german, weight), ...), governed case).
PREPOSITIONS = (
    ("with", (("mit", 1.0),), "dat"),
    ("for", (("für", 1.0),), "acc"),
    ("without", (("ohne", 1.0),), "acc"),
    ("behind", (("hinter", 1.0),), "dat"),
    ("near", (("bei", 1.0),), "dat"),
)

# Subordinators put the finite verb last; "when" depends on the tense.
SUBORDINATORS = (
    ("because", (("weil", 0.8), ("da", 0.2))),
    ("although", (("obwohl", 1.0),)),
    ("while", (("während", 1.0),)),
)
WHEN_PRESENT, WHEN_PAST = "wenn", "als"
COORDINATORS = (
    ("and", (("und", 1.0),)),
    ("but", (("aber", 0.85), ("doch", 0.15))),
)
THAT = "dass"

# Past tense: the German side uses the perfect with this probability, else the simple past.
PERFECT_PROB = 0.7

DEFINITE = {("nom", "m"): "der", ("nom", "f"): "die", ("nom", "n"): "das",
            ("acc", "m"): "den", ("acc", "f"): "die", ("acc", "n"): "das",
            ("dat", "m"): "dem", ("dat", "f"): "der", ("dat", "n"): "dem"}
INDEFINITE = {("nom", "m"): "ein", ("nom", "f"): "eine", ("nom", "n"): "ein",
              ("acc", "m"): "einen", ("acc", "f"): "eine", ("acc", "n"): "ein",
              ("dat", "m"): "einem", ("dat", "f"): "einer", ("dat", "n"): "einem"}
# Adjective endings after the definite (weak) and indefinite (mixed) article.
WEAK_ENDING = {("nom", "m"): "e", ("nom", "f"): "e", ("nom", "n"): "e",
               ("acc", "m"): "en", ("acc", "f"): "e", ("acc", "n"): "e",
               ("dat", "m"): "en", ("dat", "f"): "en", ("dat", "n"): "en"}
MIXED_ENDING = {("nom", "m"): "er", ("nom", "f"): "e", ("nom", "n"): "es",
                ("acc", "m"): "en", ("acc", "f"): "e", ("acc", "n"): "es",
                ("dat", "m"): "en", ("dat", "f"): "en", ("dat", "n"): "en"}
# Preposition + definite dative article contractions.
CONTRACTIONS = {("in", "dem"): "im", ("bei", "dem"): "beim"}


def weighted_tables():
  """Every (name, alternatives) whose alternatives carry weights in their last field."""
  for group in (ANIMATE_NOUNS, OBJECT_NOUNS, PLACES, ADJECTIVES, SUBORDINATORS, COORDINATORS):
    for en, alts in group:
      yield en, alts
  for group in (TRANSITIVE_VERBS, DITRANSITIVE_VERBS, INTRANSITIVE_VERBS, CLAUSE_VERBS):
    for en, _, alts in group:
      yield en, alts
  for en, alts, _ in ADVERBS + PREPOSITIONS:
    yield en, alts


def check_lexicon() -> None:
  """Raises ValueError if some entry's weights do not sum to 1."""
  for en, alts in weighted_tables():
    total = sum(a[-1] for a in alts)
    if abs(total - 1.0) > 1e-9 or any(a[-1] <= 0 for a in alts):
      raise ValueError(f"lexicon entry {en!r}: weights {[a[-1] for a in alts]} "
                       f"must be positive and sum to 1")
