"""Object hallucination (CHAIR, Rohrbach et al. 2018): how often a caption names a kind of thing
its photo does not hold. A caption's object words are the caption words of COCO's 80 object kinds
(`OBJECT_WORDS`: man, woman, boy... are all "person"); the kinds a photo holds are the ones its
reference captions name (the caption-only ground truth). Then

    CHAIR-i = object mentions no reference of the photo names / object mentions
    CHAIR-s = captions with at least one such mention / captions

A mention is a kind named in a caption, counted once per caption; a word that may name two kinds
("bike"; "surfer": a person and a surfboard) is hallucinated only when the references name neither.
The references are scored the same way, each against the others of its photo
(`reference_hallucination`): a person's rate against four others is the noise floor of this
ground truth (on the Flickr8k dev list, CHAIR-i 2.8%, CHAIR-s 3.4%).

    hallucination(references, captions) -> Hallucination
    reference_hallucination(references) -> Hallucination
    hallucinated_words(caption, references) -> [word, ...]
    unnamed_words(caption, named_kinds(references)) -> [word, ...]
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from captioner.data.boxes import COCO_WORDS
from captioner.data.vocab import tokenize

# COCO's 80 object kinds.
COCO_CATEGORIES: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone",
    "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear",
    "hair drier", "toothbrush",
)

# Caption words for the kinds beyond the grounding score's `COCO_WORDS` (the plurals, and the kinds
# it names by their own name).
MORE_WORDS: dict[str, tuple[str, ...]] = {
    "person": ("persons", "motorcyclist", "motorcyclists", "babies", "toddlers", "skiers", "surfers",
               "skateboarders", "snowboarders", "riders", "bikers", "cyclist", "cyclists", "bicyclist", "climber",
               "climbers", "swimmer", "swimmers", "runner", "runners", "dancer", "dancers", "teenager", "teenagers",
               "adult", "adults", "mother", "father", "family", "team", "worker", "workers", "couple", "someone",
               "hiker", "hikers", "racer", "racers", "goalie", "athlete", "athletes", "spectators", "onlookers",
               "audience", "performer", "performers", "musician", "musicians", "cowboy", "bride", "groom", "police",
               "soldier", "soldiers", "students", "friends", "tourists", "teen", "teens"),
    "dog": ("greyhound", "greyhounds", "shepherd", "poodle", "terrier", "collie", "retriever", "labrador",
            "lab", "pug", "dalmatian", "husky", "beagle", "dachshund", "chihuahua", "spaniel", "bulldog"),
    "boat": ("boats", "canoes", "kayaks", "raft", "sailboat"),
    # A rider names the person and the thing ridden: a photo whose references say "surfer" holds a surfboard.
    "bicycle": ("cyclist", "cyclists", "bicyclist", "biker", "bikers"),
    "motorcycle": ("motorcyclist", "motorcyclists"),
    "skis": ("skier", "skiers"),
    "snowboard": ("snowboarder", "snowboarders"),
    "skateboard": ("skateboarder", "skateboarders"),
    "surfboard": ("surfer", "surfers"),
    "baseball glove": ("gloves", "mitts"),
    "traffic light": ("traffic lights",),
    "parking meter": ("parking meter", "parking meters"),
    "bottle": ("bottle", "bottles"),
    "fork": ("fork", "forks"),
    "knife": ("knife", "knives"),
    "spoon": ("spoon", "spoons"),
    "bowl": ("bowl", "bowls"),
    "banana": ("banana", "bananas"),
    "apple": ("apple", "apples"),
    "sandwich": ("sandwich", "sandwiches"),
    "orange": ("oranges",),
    "broccoli": ("broccoli",),
    "carrot": ("carrot", "carrots"),
    "hot dog": ("hot dog", "hot dogs"),
    "pizza": ("pizza", "pizzas"),
    "donut": ("donut", "donuts", "doughnut", "doughnuts"),
    "cake": ("cake", "cakes"),
    "chair": ("chair", "chairs"),
    "toilet": ("toilet", "toilets"),
    "mouse": ("mouse",),
    "remote": ("remote", "remotes"),
    "keyboard": ("keyboard", "keyboards"),
    "microwave": ("microwave",),
    "oven": ("oven", "ovens"),
    "toaster": ("toaster",),
    "sink": ("sink", "sinks"),
    "refrigerator": ("refrigerator", "fridge"),
    "book": ("book", "books"),
    "clock": ("clock", "clocks"),
    "vase": ("vase", "vases"),
    "scissors": ("scissors",),
    "hair drier": ("hair drier", "hair dryer", "hairdryer"),
    "toothbrush": ("toothbrush", "toothbrushes"),
}

# Words of `COCO_WORDS` that captions mostly use for something else: "light blue", "an orange shirt",
# "a ski slope", "a baseball cap", "a football player", "glasses" (worn, not drunk from).
NOT_OBJECTS = frozenset({"light", "lights", "orange", "ski", "baseball", "football", "basketball", "glasses"})


def _object_words() -> dict[str, frozenset[str]]:
    kinds: dict[str, set[str]] = {}
    for category in COCO_CATEGORIES:
        for word in COCO_WORDS.get(category, ()) + MORE_WORDS.get(category, ()):
            if word not in NOT_OBJECTS:
                kinds.setdefault(word, set()).add(category)
    return {word: frozenset(c) for word, c in kinds.items()}


OBJECT_WORDS: dict[str, frozenset[str]] = _object_words()  # caption word or two-word phrase -> its kinds


def object_mentions(text: str) -> dict[str, frozenset[str]]:
    """The object words of a caption, each with the kinds it may name, in order, once each. A
    two-word phrase is read before its words ("hot dog" is food, "teddy bear" a toy, not animals).

    >>> list(object_mentions("A man throws a tennis ball to his dog"))
    ['man', 'tennis ball', 'dog']
    """
    words = tokenize(text)
    found: dict[str, frozenset[str]] = {}
    i = 0
    while i < len(words):
        pair = " ".join(words[i:i + 2])
        word, i = (pair, i + 2) if " " in pair and pair in OBJECT_WORDS else (words[i], i + 1)
        if word in OBJECT_WORDS and OBJECT_WORDS[word] not in found.values():
            found[word] = OBJECT_WORDS[word]
    return found


def named_kinds(texts: Iterable[str]) -> frozenset[str]:
    """The object kinds any of `texts` names."""
    return frozenset(kind for text in texts for kinds in object_mentions(text).values() for kind in kinds)


@dataclass(frozen=True)
class Hallucination:
    """CHAIR over a set of captions.

    captions: captions scored; mentions: object mentions in them (kinds named, once per caption);
    hallucinated: mentions no reference of the photo names; captions_hallucinating: captions with
    at least one; by_word: hallucinated word -> times, most first.
    """

    captions: int
    mentions: int
    hallucinated: int
    captions_hallucinating: int
    by_word: dict[str, int]

    @property
    def chair_i(self) -> float:
        return self.hallucinated / self.mentions if self.mentions else 0.0

    @property
    def chair_s(self) -> float:
        return self.captions_hallucinating / self.captions if self.captions else 0.0

    def to_json(self) -> dict[str, object]:
        return {"chair_i": self.chair_i, "chair_s": self.chair_s, "captions": self.captions,
                "mentions": self.mentions, "hallucinated": self.hallucinated,
                "captions_hallucinating": self.captions_hallucinating, "by_word": self.by_word}


def hallucinated_words(text: str, references: Sequence[str]) -> list[str]:
    """The object words of `text` that name no kind any of its photo's `references` names."""
    return unnamed_words(text, named_kinds(references))


def unnamed_words(text: str, present: frozenset[str]) -> list[str]:
    """The object words of `text` that name none of the kinds `present` (`named_kinds` of its references)."""
    return _unnamed(object_mentions(text), present)


def _unnamed(mentioned: dict[str, frozenset[str]], present: frozenset[str]) -> list[str]:
    return [word for word, kinds in mentioned.items() if not kinds & present]


def _score(pairs: Iterable[tuple[str, Sequence[str]]]) -> Hallucination:
    """(caption, its photo's references) pairs -> CHAIR."""
    captions = mentions = hallucinated = hallucinating = 0
    by_word: Counter[str] = Counter()
    for text, references in pairs:
        mentioned = object_mentions(text)
        wrong = _unnamed(mentioned, named_kinds(references))
        captions += 1
        mentions += len(mentioned)
        hallucinated += len(wrong)
        hallucinating += bool(wrong)
        by_word.update(wrong)
    return Hallucination(captions, mentions, hallucinated, hallucinating, dict(by_word.most_common()))


def hallucination(references: Mapping[Hashable, Sequence[str]], captions: Mapping[Hashable, str]) -> Hallucination:
    """CHAIR of `captions` (key -> generated caption) against the kinds the `references` of the same
    key name (key -> the photo's reference captions)."""
    return _score((text, references[key]) for key, text in captions.items())


def reference_hallucination(references: Mapping[Hashable, Sequence[str]]) -> Hallucination:
    """CHAIR of each reference caption against the other references of its photo (photos with two
    or more): a person's rate, seen through one reference fewer than a generated caption gets."""
    return _score((text, refs[:i] + refs[i + 1:])
                  for refs in (list(r) for r in references.values() if len(r) > 1)
                  for i, text in enumerate(refs))
