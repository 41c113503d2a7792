"""Which ImageNet classes a caption word names: the table behind weak attention supervision from the
encoder's own classifier (`train.concept_teacher: imagenet`). A word in the table is located on any
photo by the class activation map of its classes (Zhou et al. 2016): the classifier applied to each
region of the grid instead of to their mean. People, the commonest thing in captions, have no
ImageNet class; nor have grass, water or snow. What people wear has classes: `CLOTHING` says where a
person is likely (`train.concept_teacher: detector+clothing`).
"""
from __future__ import annotations

_DOGS, _CATS, _BEARS = tuple(range(151, 269)), tuple(range(281, 286)), tuple(range(294, 298))
_BIRDS = tuple(range(7, 25)) + tuple(range(80, 101)) + tuple(range(127, 147))
_BALLS = (429, 430, 522, 574, 722, 768, 805, 852, 890)  # baseball ... volleyball
_CARS = (436, 468, 511, 609, 627, 656, 717, 751, 817)
_BOATS = (472, 484, 554, 576, 625, 724, 780, 814, 871, 914)

# word (singular and plural forms as captions write them) -> ImageNet-1k class indices
IMAGENET_WORDS: dict[str, tuple[int, ...]] = {
    **dict.fromkeys(("dog", "dogs", "puppy", "puppies"), _DOGS),
    **dict.fromkeys(("cat", "cats", "kitten"), _CATS),
    **dict.fromkeys(("bear", "bears"), _BEARS),
    **dict.fromkeys(("bird", "birds"), _BIRDS),
    **dict.fromkeys(("duck", "ducks", "goose", "geese"), (97, 98, 99)),
    **dict.fromkeys(("ball", "balls"), _BALLS),
    "soccer": (805,), "football": (768, 805), "basketball": (430,), "volleyball": (890,), "baseball": (429,),
    **dict.fromkeys(("bike", "bikes", "bicycle", "bicycles"), (444, 671, 870)),
    **dict.fromkeys(("motorcycle", "motorcycles", "motorbike", "scooter"), (665, 670)),
    **dict.fromkeys(("car", "cars"), _CARS),
    **dict.fromkeys(("truck", "trucks"), (555, 569, 717, 864, 867)),
    **dict.fromkeys(("bus", "buses"), (654, 779, 874)),
    **dict.fromkeys(("train", "trains"), (466, 547, 565, 820)),
    **dict.fromkeys(("boat", "boats"), _BOATS),
    **dict.fromkeys(("canoe", "canoes", "kayak", "kayaks"), (472,)),
    **dict.fromkeys(("horse", "horses", "pony"), (339, 603)),
    **dict.fromkeys(("cow", "cows", "bull", "cattle"), (345, 346, 347)),
    **dict.fromkeys(("sheep", "ram"), (348, 349)),
    **dict.fromkeys(("bench", "benches"), (703,)),
    **dict.fromkeys(("couch", "sofa"), (831,)),
    **dict.fromkeys(("chair", "chairs"), (423, 559, 765)),
    **dict.fromkeys(("swing", "swings"), (843,)),
    **dict.fromkeys(("umbrella", "umbrellas"), (879,)),
    **dict.fromkeys(("sled", "sleds", "sledge"), (450, 537)),
    "tractor": (866,), "snowmobile": (802,), "jeep": (609,), "tricycle": (870,),
    **dict.fromkeys(("tv", "television"), (851,)),
    **dict.fromkeys(("shirt", "shirts", "jersey", "jerseys"), (610,)),
    **dict.fromkeys(("sweatshirt", "hoodie"), (841,)),
    **dict.fromkeys(("helmet", "helmets"), (518, 560)),
    **dict.fromkeys(("hat", "hats"), (515, 808)),
    **dict.fromkeys(("sunglasses", "shades"), (836, 837)),
    **dict.fromkeys(("guitar", "guitars"), (402, 546)),
    **dict.fromkeys(("drum", "drums"), (541,)),
    **dict.fromkeys(("ski", "skis"), (795,)),
    "tent": (672,), "fountain": (562,), "backpack": (414,), "bucket": (463,), "pole": (733,),
    **dict.fromkeys(("fence", "fences"), (489, 716, 912)),
    **dict.fromkeys(("bridge", "bridges"), (821, 839, 888)),
    **dict.fromkeys(("mask", "masks"), (643, 796)),
}

# What people wear (jersey, suit, bikini, jean, cowboy hat, crash helmet, sunglasses, running shoe...)
# and the three classes that are people (ballplayer, groom, scuba diver): a region the classifier
# takes for one of these likely shows a person. Chosen from the class names alone.
CLOTHING: tuple[int, ...] = (
    399, 400, 411, 433, 443, 445, 451, 452, 457, 459, 465, 474, 514, 515, 518, 529, 560, 568, 578, 601,
    608, 610, 614, 617, 638, 639, 652, 655, 658, 667, 689, 697, 735, 770, 774, 775, 796, 806, 808, 824,
    834, 836, 837, 841, 842, 869, 887, 903, 906, 981, 982, 983,
)
