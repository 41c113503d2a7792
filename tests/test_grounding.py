import numpy as np
import pytest

from captioner.data.boxes import GroundObject, objects_of
from captioner.data.records import Box
from captioner.decoding.grounding import GroundingSample, covered_share, grounding_score, word_objects

# --- grounding -------------------------------------------------------------------------------

# A 100 x 50 image (width x height) seen through a 2 x 4 grid: cells are 25 x 25 px,
# centres at x = 12.5, 37.5, 62.5, 87.5 and y = 12.5, 37.5.
SIZE = (100, 50)
RED_CIRCLE = Box("red circle", 0, 0, 50, 50)  # holds the left 2 columns
BLUE_SQUARE = Box("blue square", 50, 0, 100, 25)  # holds the top-right 2 cells
BLUE_CIRCLE = Box("blue circle", 50, 25, 100, 50)  # bottom-right 2 cells


def _map(peak: tuple[int, int], weight: float = 0.7) -> np.ndarray:
    m = np.full((2, 4), (1 - weight) / 7)
    m[peak] = weight
    return m


def test_word_objects_resolves_ambiguous_words_by_their_phrase():
    boxes = [RED_CIRCLE, BLUE_SQUARE, BLUE_CIRCLE]
    words = ["a", "red", "circle", "above", "a", "blue", "circle", "and", "a", "blue", "square", "and", "a", "green", "circle"]
    got = word_objects(words, objects_of(boxes))
    assert got[:7] == [None, (0,), (0,), None, None, (2,), (2,)]  # "red" unique; "circle" by its phrase
    assert got[9:11] == [(1,), (1,)]  # "blue square"
    assert got[13:] == [None, (0, 2)]  # "green circle": no green; "circle" may be either circle


def test_grounding_on_hand_made_maps():
    words = ["a", "red", "circle", "and", "a", "blue", "square"]
    attention = np.stack([
        _map((0, 3)),  # a: not an object word, ignored
        _map((1, 0)),  # red: peak at (12.5, 37.5), inside the red circle's box
        _map((0, 2)),  # circle: peak in the square -> miss
        _map((0, 0)),  # and
        _map((0, 0)),  # a
        _map((0, 3)),  # blue: peak at (87.5, 12.5), inside the square
        _map((1, 3)),  # square: peak at (87.5, 37.5), below the square -> miss
    ])
    sample = GroundingSample(words, attention, SIZE, objects_of([RED_CIRCLE, BLUE_SQUARE]))
    result = grounding_score([sample])
    assert result.words == 4
    assert result.hit_rate == pytest.approx(2 / 4)
    small = 0.3 / 7
    masses = [0.7 + 3 * small, 4 * small, 0.7 + small, 2 * small]  # red, circle, blue, square
    assert result.mean_mass == pytest.approx(sum(masses) / 4)


def test_grounding_uses_the_image_size_not_the_grid():
    # Same map, taller image: (1, 0)'s centre moves from y=37.5 to y=75, out of a box that ends at y=50
    # (25 px away: beyond the pointing game's tolerance, 15 px at 500 px = 3 px here).
    sample = GroundingSample(["red"], _map((1, 0))[None], (100, 100), objects_of([RED_CIRCLE]))
    assert grounding_score([sample]).hit_rate == 0.0
    assert grounding_score([]).words == 0
    with pytest.raises(ValueError, match="2 words"):
        grounding_score([GroundingSample(["red", "circle"], _map((0, 0))[None], SIZE, objects_of([RED_CIRCLE]))])


def test_grounding_uses_the_cells_true_centres():
    """Peak in cell (0, 0) of a 2x2 grid on a 100 px image: its nominal centre (25, 25) is outside
    a box at 40-90 px, but cells looking half a cell further down-right are centred at (50, 50)."""
    from captioner.model.encoder import Cells

    attention = np.array([[[1.0, 0.0], [0.0, 0.0]]])  # (T=1, 2, 2)
    box = objects_of([Box("circle", 40, 40, 90, 90)])
    assert grounding_score([GroundingSample(["circle"], attention, (100, 100), box)]).hit_rate == 0.0
    assert grounding_score([GroundingSample(["circle"], attention, (100, 100), box, Cells(0.5, 0.5))]).hit_rate == 1.0


# --- the pointing game on real-photo boxes ------------------------------------------------------

PHOTO = (200, 200)  # a 4x4 grid of 50 px cells, centres at 25, 75, 125, 175
DOG = GroundObject(("dog", "dogs"), ((0, 0, 50, 50),))  # the top-left cell: 1/16 of the photo
BALL = GroundObject(("tennis ball", "ball"), ((150, 150, 200, 200),))  # the bottom-right cell
PEOPLE = GroundObject(("people",), ((50, 50, 150, 100), (50, 100, 150, 150)))  # two boxes, the middle 4 cells


def _peaked(*cells: tuple[int, int], weight: float = 0.85) -> np.ndarray:
    maps = np.full((len(cells), 4, 4), (1 - weight) / 15)
    for t, cell in enumerate(cells):
        maps[(t, *cell)] = weight
    return maps


def test_pointing_game_hits_masses_and_baselines():
    words = ["a", "dog", "and", "people", "near", "a", "tennis", "ball"]
    maps = _peaked((3, 3), (0, 0), (3, 3), (1, 2), (3, 3), (3, 3), (0, 0), (0, 0))  # the ball's map looks at the dog
    result = grounding_score([GroundingSample(words, maps, PHOTO, [DOG, PEOPLE, BALL])])
    g = result.all
    assert g.words == 3 and g.hit_rate == pytest.approx(2 / 3)  # dog and people hit, ball misses
    rest = 0.15 / 15
    assert g.mean_mass == pytest.approx((0.85 + (0.85 + 3 * rest) + rest) / 3)
    assert g.centre_hit_rate == pytest.approx(1 / 3)  # the centre (100, 100) lies in the people's boxes only
    assert g.even_mass == pytest.approx((1 + 4 + 1) / 16 / 3)
    assert result.small.words == 2 and result.large.words == 1  # dog and ball 1/16 each; the people 1/4
    assert set(result.by_word) == {"dog", "people", "ball"} and result.by_word["ball"].hit_rate == 0.0
    assert result.multi_captions == 1 and result.multi_own_box == 0.0  # the ball's word missed
    assert result.distinct_peaks == pytest.approx(3 / 8)


def test_each_object_on_its_own_box_from_its_own_cell():
    words = ["dog", "and", "ball"]
    own = grounding_score([GroundingSample(words, _peaked((0, 0), (2, 2), (3, 3)), PHOTO, [DOG, BALL])])
    assert own.multi_captions == 1 and own.multi_own_box == 1.0
    # A map staring at one spot for every word cannot put two objects in their own boxes.
    big = GroundObject(("ball",), ((0, 0, 200, 200),))
    same = grounding_score([GroundingSample(words, _peaked((0, 0), (0, 0), (0, 0)), PHOTO, [DOG, big])])
    assert same.all.hit_rate == 1.0 and same.multi_own_box == 0.0


def test_pointing_tolerance_is_15_px_at_500():
    # A 500 px photo, 2x2 grid: the peak cell's centre (125, 125) is 10 px from a box at 135..: a hit;
    # 20 px from a box at 145..: a miss.
    near, far = GroundObject(("dog",), ((135, 0, 250, 250),)), GroundObject(("dog",), ((145, 0, 250, 250),))
    peak = np.array([[[1.0, 0.0], [0.0, 0.0]]])
    assert grounding_score([GroundingSample(["dog"], peak, (500, 500), [near])]).all.hit_rate == 1.0
    assert grounding_score([GroundingSample(["dog"], peak, (500, 500), [far])]).all.hit_rate == 0.0
    assert grounding_score([GroundingSample(["dog"], peak, (500, 500), [near])]).all.mean_mass == 0.0


def test_covered_share_counts_overlaps_once():
    assert covered_share([(0, 0, 100, 100)], (200, 200)) == pytest.approx(0.25)
    assert covered_share([(0, 0, 100, 100), (50, 50, 150, 150)], (200, 200)) == pytest.approx(17500 / 40000)
    assert covered_share([(0, 0, 100, 100), (0, 0, 100, 100)], (200, 200)) == pytest.approx(0.25)


def test_phrase_names_match_only_as_phrases():
    objects = [GroundObject(("tennis ball",), ((0, 0, 10, 10),))]
    assert word_objects(["a", "tennis", "ball"], objects) == [None, None, (0,)]
    assert word_objects(["a", "ball"], objects) == [None, None]
