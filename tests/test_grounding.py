import numpy as np
import pytest

from captioner.data.records import Box
from captioner.decoding.grounding import GroundingSample, grounding_score, word_objects

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
    got = word_objects(words, boxes)
    assert got[:7] == [None, 0, 0, None, None, 2, 2]  # "red" unique; "circle" by its phrase; "blue circle"
    assert got[9:11] == [1, 1]  # "blue square"
    assert got[13:] == [None, None]  # "green circle": no green, and "circle" alone is ambiguous


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
    sample = GroundingSample(words, attention, SIZE, [RED_CIRCLE, BLUE_SQUARE])
    result = grounding_score([sample])
    assert result.words == 4
    assert result.hit_rate == pytest.approx(2 / 4)
    small = 0.3 / 7
    masses = [0.7 + 3 * small, 4 * small, 0.7 + small, 2 * small]  # red, circle, blue, square
    assert result.mean_mass == pytest.approx(sum(masses) / 4)


def test_grounding_uses_the_image_size_not_the_grid():
    # Same map, taller image: (1, 0)'s centre moves from y=37.5 to y=75, out of a box that ends at y=50.
    sample = GroundingSample(["red"], _map((1, 0))[None], (100, 100), [RED_CIRCLE])
    assert grounding_score([sample]).hit_rate == 0.0
    assert grounding_score([]).words == 0
    with pytest.raises(ValueError, match="2 words"):
        grounding_score([GroundingSample(["red", "circle"], _map((0, 0))[None], SIZE, [RED_CIRCLE])])


def test_grounding_uses_the_cells_true_centres():
    """Peak in cell (0, 0) of a 2x2 grid on a 100 px image: its nominal centre (25, 25) is outside
    a box at 40-90 px, but cells looking half a cell further down-right are centred at (50, 50)."""
    from captioner.model.encoder import Cells

    attention = np.array([[[1.0, 0.0], [0.0, 0.0]]])  # (T=1, 2, 2)
    box = (Box("circle", 40, 40, 90, 90),)
    assert grounding_score([GroundingSample(["circle"], attention, (100, 100), box)]).hit_rate == 0.0
    assert grounding_score([GroundingSample(["circle"], attention, (100, 100), box, Cells(0.5, 0.5))]).hit_rate == 1.0
