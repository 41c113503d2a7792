"""Deploying a model without its training code's costs: ONNX graphs and ONNX Runtime inference.

    export.py    `export_onnx(checkpoint, folder)`: encoder, memory, step (and words) graphs + manifest, verified
    quantize.py  the encoder in int8 (static quantization calibrated on photos), for `export --quantize int8`
    step.py      the decoder's memory, step and word detector rewritten for inference graphs (token tables)
    weights.py   the decoder's weights stored in float16 or int8, for `export --small`
    encoder.py   the feature cache built with ONNX Runtime
    runtime.py   `onnx_captioner(folder)`: a `Captioner` whose encoder and decoder steps run in ONNX Runtime
    folder.py    an export folder without torch: manifest, sessions, the cache of exports, the bundled model
    graphs.py    the graphs as numpy functions, with the encoder's preprocessing in numpy
    lite.py      `lite_captioner(folder)`: captions from an export with ONNX Runtime, numpy and Pillow alone

`onnx` and `onnxruntime` are an optional extra: `pip install captioner[onnx]`.
"""
from __future__ import annotations

from captioner.errors import CaptionerError

MANIFEST = "manifest.json"
# 2: memory/step from `deploy.step` (keys doubled, token tables); 3: manifest data + precision; 4: words.onnx
EXPORT_VERSION = 4
OPSET = 18
GRAPHS = ("encoder", "memory", "step")
WORDS = "words"  # the word detector's graph, for decode.detector_weight: exported when the decoder has one
SMALL_WEIGHTS = ("float16", "int8")  # how `export --small` stores the decoder's weights (`deploy.weights`)
CALIBRATION_IMAGES = 64  # the most photos an int8 encoder is calibrated on (evenly spaced over those given)


class FormatError(CaptionerError):
    """A model that cannot be exported, or an export folder that cannot be used."""


def require_onnx(runtime_only: bool = False) -> None:
    """A one-line error naming the extra when onnx / onnxruntime are missing. `runtime_only`: only
    onnxruntime, all that running an export takes (onnx alone costs a second to import)."""
    try:
        if not runtime_only:
            import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as e:
        raise FormatError(f"the ONNX runtime needs the 'onnx' extra: pip install 'captioner[onnx]' "
                          f"({e.name} is not installed)") from None
