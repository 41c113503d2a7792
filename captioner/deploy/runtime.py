"""Captioning with ONNX Runtime: the exported graphs behind the `Captioner` API.

`onnx_captioner(folder_or_checkpoint)` returns a `Captioner` whose model is an `OnnxModel`: its
encoder runs encoder.onnx, its decoder answers `memory`, `init_hidden` and `step` from memory.onnx
and step.onnx, so the project's own beam search (captioner.decoding.search) drives it exactly as it
drives the torch decoder, and captions, scores and maps come out the same. A checkpoint given
instead of an export folder is exported once into the cache ($CAPTIONER_CACHE/onnx/<digest>).

Sessions run on the CPU with every graph optimisation on; the encoder's with as many threads as
torch uses (`torch.set_num_threads`, or OMP_NUM_THREADS), the decoder's with one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torchvision.transforms import InterpolationMode

from captioner.config import DataConfig, DecodeConfig
from captioner.config.parse import from_dict
from captioner.data.vocab import Vocabulary
from captioner.decoding.captioner import Captioner
from captioner.deploy import WORDS, FormatError, require_onnx
from captioner.deploy.folder import encode_chunks, exported, graph_sessions, read_manifest
from captioner.model.decoder import StepOutput
from captioner.model.encoder import Cells, eval_transform
from captioner.model.memory import Memory


def encode_in_chunks(session: Any, pixels: Tensor) -> Tensor:
    """An encoder graph's (B, 3, S, S) -> (B, L, D_enc) in torch, CPU_CHUNK images a call (`encode_chunks`)."""
    return torch.from_numpy(encode_chunks(session, pixels.float().contiguous().numpy()))


class OnnxEncoder:
    """encoder.onnx as `Encoder`'s inference side: `infer`, `transform`, `grid`, `cells`."""

    def __init__(self, session: Any, spec: dict[str, Any]) -> None:
        self.session = session
        self.name, self.image_size = spec["name"], int(spec["image_size"])
        self.grid: tuple[int, int] = tuple(spec["grid"])  # type: ignore[assignment]
        self.cells = Cells(**spec["cells"])
        self._transform = eval_transform(self.image_size, InterpolationMode(spec["interpolation"]), spec["mean"],
                                         spec["std"])

    def transform(self, train: bool = False) -> Any:
        return self._transform

    def infer(self, pixels: Tensor) -> Tensor:
        """(B, 3, S, S) -> (B, L, D_enc)."""
        return encode_in_chunks(self.session, pixels)


@dataclass(frozen=True)
class OnnxMemory(Memory):
    """Memory that also carries memory.onnx's initial state (selecting rows drops it: only the
    search's start needs it). step.onnx reads a memory row per beam, so `expand` copies."""

    initial: Tensor | None = None

    def expand(self, k: int) -> Memory:
        return self.select(torch.arange(len(self.features)).repeat_interleave(k))  # (B·k, L, D), (B·k, L, A)


class OnnxDecoder:
    """memory.onnx and step.onnx (and words.onnx, when exported) as the decoder interface beam search uses."""

    def __init__(self, memory: Any, step: Any, words: Any | None = None) -> None:
        self.memory_session, self.step_session, self.words_session = memory, step, words
        self.training = False

    @property
    def detects_words(self) -> bool:
        return self.words_session is not None

    def word_log_probs(self, grid: Tensor) -> Tensor:
        """(B, L, D_enc) -> (B, V) log p(the photo shows each word), from words.onnx."""
        return torch.from_numpy(self.words_session.run(None, {"grid": grid.float().contiguous().numpy()})[0])

    def memory(self, grid: Tensor) -> OnnxMemory:
        features, keys, state = self.memory_session.run(None, {"grid": grid.float().contiguous().numpy()})
        return OnnxMemory(torch.from_numpy(features), torch.from_numpy(keys), initial=torch.from_numpy(state))

    def init_hidden(self, memory: OnnxMemory) -> Tensor:
        return memory.initial

    def step(self, tokens: Tensor, state: Tensor, memory: Memory) -> StepOutput:
        logits, alpha, new_state = self.step_session.run(None, {
            "tokens": tokens.contiguous().numpy(), "state": state.contiguous().numpy(),
            "features": memory.features.contiguous().numpy(), "keys": memory.keys.contiguous().numpy()})
        return StepOutput(torch.from_numpy(logits), torch.from_numpy(alpha), torch.from_numpy(new_state))


class OnnxModel:
    """What `Captioner` needs of a model: `encoder`, `decoder`, `to` (the CPU only) and `eval`."""

    def __init__(self, encoder: OnnxEncoder, decoder: OnnxDecoder) -> None:
        self.encoder, self.decoder = encoder, decoder

    def to(self, device: torch.device | str) -> OnnxModel:
        if torch.device(device).type != "cpu":
            raise FormatError(f"the ONNX runtime runs on the CPU here, not {device} (use --runtime torch)")
        return self

    def eval(self) -> OnnxModel:
        return self


def exported_data(source: str | Path) -> DataConfig:
    """The data settings of the checkpoint behind `source` (an export folder or a checkpoint), which
    `captioner evaluate --runtime onnx` scores on (its validation split, its seed)."""
    folder = exported(source)
    manifest = read_manifest(folder)
    if "data" not in manifest:
        raise FormatError(f"{folder}: exported before exports recorded their data settings; export it again")
    return from_dict(DataConfig, manifest["data"], "data")


def onnx_captioner(source: str | Path, decode: DecodeConfig | None = None, threads: int | None = None) -> Captioner:
    """A `Captioner` on ONNX Runtime, from an export folder or a checkpoint (exported once, cached)."""
    require_onnx()
    folder = exported(source)
    manifest = read_manifest(folder)
    sessions = graph_sessions(folder, threads or torch.get_num_threads())
    model = OnnxModel(OnnxEncoder(sessions["encoder"], manifest["encoder"]),
                      OnnxDecoder(sessions["memory"], sessions["step"], sessions.get(WORDS)))
    return Captioner(model, Vocabulary.from_list(manifest["vocabulary"]),  # type: ignore[arg-type]
                     decode or DecodeConfig(**manifest["decode"]), "cpu", manifest.get("meta", {}))
