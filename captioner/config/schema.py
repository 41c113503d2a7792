"""The configuration: one small frozen dataclass per section, every key typed and checked.

A key with a fixed set of values is a `Literal`; a number has its allowed range in `LIMITS`. Each
dataclass checks itself when built (`__post_init__`), from a file, an override, a checkpoint or
Python code alike, so a bad value fails in one line naming the key, the value and what is allowed,
before any data is read. `Config` also checks combinations of sections.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from captioner.errors import CaptionerError


class ConfigError(CaptionerError):
    """A configuration file, key or value that does not fit (one-line message naming the key)."""


# Names of what other layers provide; tests check that they match (the backbone registry, the metrics).
EncoderName = Literal["efficientnet_lite0", "efficientnet_lite1", "efficientnet_lite2", "resnet50", "resnet101",
                      "resnet152", "efficientnet_b0", "efficientnet_b1", "efficientnet_b2", "efficientnet_b3",
                      "convnext_tiny", "random"]
MetricName = Literal["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"]

# Allowed ranges: ">= a", "> a" or an interval "[a, b)", "[a, b]".
LIMITS: dict[str, dict[str, str]] = {
    "data": {"val_fold": ">= 0", "val_fraction": "[0, 1)", "test_fraction": "[0, 1)", "min_word_count": ">= 1", "max_length": ">= 2",
             "num_workers": ">= 0", "shapes_images": ">= 10"},
    "model.encoder": {"image_size": "[32, 4096]", "trainable_stages": ">= 0"},
    "model.decoder": {"embed_dim": ">= 1", "hidden_dim": ">= 1", "attention_dim": ">= 1", "feature_dim": ">= 0",
                      "dropout": "[0, 1)"},
    "train": {"scst_samples": ">= 1", "scst_xent_weight": ">= 0", "scst_kl_weight": ">= 0", "scst_object_penalty": ">= 0", "epochs": ">= 1", "schedule_epochs": ">= 0", "max_steps": ">= 0", "batch_size": ">= 1", "lr": "> 0", "encoder_lr": "> 0", "weight_decay": ">= 0",
              "grad_clip": ">= 0", "warmup_steps": ">= 0", "coverage_weight": ">= 0", "entropy_weight": ">= 0", "concept_weight": ">= 0", "concept_negatives": ">= -1", "box_weight": ">= 0",
              "label_smoothing": "[0, 1)", "scheduled_sampling": "[0, 1]", "seed": "[0, 4294967295]",
              "val_every_steps": ">= 0", "val_images": ">= 0", "patience": ">= 0", "checkpoint_every_steps": ">= 0",
              "log_every": ">= 1"},
    "decode": {"beam_size": "[1, 100]", "max_length": ">= 2", "length_penalty": "[0, 10]", "no_repeat_ngram": ">= 0", "detector_weight": "[0, 10]"},
}


def allows(spec: str, value: float) -> bool:
    if spec.startswith(">="):
        return value >= float(spec[2:])
    if spec.startswith(">"):
        return value > float(spec[1:])
    lo, hi = (float(x) for x in spec[1:-1].split(","))
    return (lo <= value if spec[0] == "[" else lo < value) and (value <= hi if spec[-1] == "]" else value < hi)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class _Section:
    """Checks every field of a section dataclass against its Literal choices and LIMITS."""

    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        limits = LIMITS.get(self.SECTION, {})
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value, key, hint = getattr(self, f.name), f"{self.SECTION}.{f.name}", _hints(type(self))[f.name]
            choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
            if choices and value not in choices:
                allowed = ", ".join(repr(c) for c in choices)
                raise ConfigError(f"config key '{key}': {value!r} is not allowed (one of {allowed})")
            spec = limits.get(f.name)
            if spec and isinstance(value, (int, float)) and not allows(spec, value):
                raise ConfigError(f"config key '{key}': {value!r} is not allowed (must be {spec})")


@dataclass(frozen=True)
class DataConfig(_Section):
    SECTION: ClassVar[str] = "data"
    path: str = "shapes"  # a folder or caption file (layout detected), or "shapes" for the built-in set
    image_root: str = ""  # where the images are, when not next to the caption file
    val_fraction: float = 0.1  # used only when the source has no split of its own
    test_fraction: float = 0.0
    split_seed: int = 0
    val_fold: int = 0  # k-fold validation: the k-th block of val_fraction of the shuffled images (0 = the first)
    min_word_count: int = 1  # rarer words become <unk>
    max_length: int = 20  # words per caption, without <start>/<end>; longer captions are cut
    cache_dir: str = ""  # feature cache folder; "" = $CAPTIONER_CACHE/features (~/.cache/captioner/features)
    use_cache: bool = True  # with a frozen encoder, compute each image's grid once
    # what fills the cache: "auto" = ONNX Runtime on a CPU when the onnx extra is installed (2-4x faster,
    # the same grids to ~1e-5), else torch; "onnx" or "torch" to choose
    cache_runtime: Literal["auto", "torch", "onnx"] = "auto"
    augment: bool = False  # train-time augmentation; needs the images (no cache, or a fine-tuned encoder)
    # train on each photo and its mirror image: the cache also holds every training photo's grid flipped left to
    # right (a second cache folder, built once); a batch reads either view, the mirrored one's captions with
    # "left" and "right" swapped
    mirror: bool = False
    # object boxes of the training photos for train.box_weight: JSON lines {image, objects: [{words, boxes}]}
    # or a COCO instances JSON ("" = the data set's own, which only the built-in shapes have)
    boxes: str = ""
    num_workers: int = 0
    shapes_images: int = 1000  # size of the built-in shapes set
    shapes_seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.path:
            raise ConfigError("config key 'data.path': empty (a folder, a caption file, or 'shapes')")
        if self.val_fraction + self.test_fraction >= 1:
            raise ConfigError(f"config keys 'data.val_fraction' + 'data.test_fraction': {self.val_fraction} + "
                              f"{self.test_fraction} is not allowed (must be below 1: some images must train)")


@dataclass(frozen=True)
class EncoderConfig(_Section):
    SECTION: ClassVar[str] = "model.encoder"
    name: EncoderName = "efficientnet_lite0"
    image_size: int = 256  # square input side, pixels
    weights: str = ""  # local state dict; "" = the backbone's own pretrained weights
    trainable_stages: int = 0  # fine-tune the last N stages (0 = frozen, eval mode)
    # a grid twice as fine from the same input: each cell the features of the stage at half the last
    # stage's stride (stride 16 on EfficientNet-Lite), beside those of the last stage's cell it lies in
    two_scale: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.two_scale and self.image_size % 32:
            raise ConfigError(f"config key 'model.encoder.image_size': {self.image_size} is not allowed with "
                              f"model.encoder.two_scale (must be a multiple of 32, so each last-stage cell "
                              f"covers 2x2 finer cells)")


@dataclass(frozen=True)
class DecoderConfig(_Section):
    SECTION: ClassVar[str] = "model.decoder"
    embed_dim: int = 256
    hidden_dim: int = 512
    attention_dim: int = 256
    dropout: float = 0.5
    feature_dim: int = 512  # project the encoder's D-wide regions to this width once per image (0 = keep D)
    position: bool = True  # add learned row + column embeddings to the regions, so attention can select by place
    gate: bool = True  # Show-Attend-Tell's beta = sigmoid(Linear(h)) on the context
    init_pooling: Literal["mean", "attention", "none"] = "mean"  # how the grid becomes the initial state (none: zeros)
    # "before": attend with the state from before the previous word was read (Show, Attend and Tell);
    # "after": read it first, then attend with the new state, so the query knows the word just written
    attend: Literal["before", "after"] = "before"
    # the GRU reads the grid's mean at every step (Up-Down's pooled image feature): the scene is always
    # at hand, so a map need not spread over it
    global_context: bool = False
    # a per-region word detector trained from the captions alone (multiple-instance learning); with
    # train.concept_weight it shows the attention where each content word's evidence is
    concepts: bool = False


@dataclass(frozen=True)
class ModelConfig(_Section):
    SECTION: ClassVar[str] = "model"
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)


@dataclass(frozen=True)
class TrainConfig(_Section):
    SECTION: ClassVar[str] = "train"
    # "xent": cross-entropy on the reference captions. "scst": self-critical sequence training, which
    # fine-tunes a cross-entropy model (`init`) to raise the CIDEr-D of its own sampled captions.
    objective: Literal["xent", "scst"] = "xent"
    init: str = ""  # start from this checkpoint's weights, vocabulary and model config (a new run; scst needs it)
    scst_samples: int = 5  # captions per image (drawn, or its best beams); each judged against the mean reward of the others
    scst_baseline: Literal["mean", "greedy"] = "mean"  # or the reward of the image's greedy caption
    # "multinomial": captions drawn from the model; "beam": its scst_samples best beams as evaluation searches them
    scst_sampling: Literal["multinomial", "beam"] = "multinomial"
    scst_xent_weight: float = 0.0  # mix in this much cross-entropy on the references
    scst_kl_weight: float = 0.0  # KL(policy || the initial model) per sampled word: keeps SCST near its start
    # subtracted from a sample's reward for each object kind it names that no reference of its photo names (CHAIR)
    scst_object_penalty: float = 0.0
    epochs: int = 20
    # the epochs the learning-rate schedule is laid over (0 = `epochs`): more than `epochs` stops the run
    # before the cosine reaches 0
    schedule_epochs: int = 0
    max_steps: int = 0  # end the run after this many optimiser steps, validated (0 = every epoch's steps)
    batch_size: int = 64
    optimizer: Literal["adam", "adamw"] = "adamw"
    lr: float = 4e-4
    encoder_lr: float = 1e-4  # for the fine-tuned encoder stages
    weight_decay: float = 0.0
    grad_clip: float = 5.0  # 0 = no clipping
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 0
    # Weight of the doubly stochastic attention term, mean over regions of (1 - sum_t alpha)^2: every
    # region looked at about once per caption. 6.4 = the 0.1 per summed region measured best on
    # flickr8k-800's 64 regions (val CIDEr 0.531 vs 0.495 at 1.0 summed).
    coverage_weight: float = 6.4
    entropy_weight: float = 0.0  # attention entropy penalty: sharper maps, one object per look
    # pull the map of the step writing a content word towards where the word detector finds it
    # (model.decoder.concepts); the detector itself learns from which words a photo's captions use
    concept_weight: float = 0.0
    # where a word is: "detector" = the decoder's own word detector (model.decoder.concepts), for every
    # content word; "detector+clothing" = the same, a person's map weighted by where the encoder's ImageNet
    # classifier sees what people wear; "imagenet" = the classifier per region, for the words it has classes for
    concept_teacher: Literal["detector", "detector+clothing", "imagenet"] = "detector"
    # one detector output per kind of thing (man, woman, boy... -> person), learnt from every photo whose captions
    # name it, teaching each word its kind's map; sets a new model's (train.init and resumes keep the model's own)
    concept_groups: bool = False
    # the detector outputs a step trains: the batch's words and this many others drawn at random
    # (-1 = all; all of a 2,500-word vocabulary at 12x12 regions is a third of a step)
    concept_negatives: int = 512
    # pull the map of each word naming a boxed object of its photo into the object's cells (data.boxes;
    # Liu et al. 2017's supervised attention): -log of the map's mass there
    box_weight: float = 0.0
    label_smoothing: float = 0.0
    scheduled_sampling: float = 0.0  # final probability of feeding the model's own word
    # "auto": bf16 on a GPU (fp16 on older ones) and on CPUs where it trains faster, else float32 (device.py)
    amp: Literal["auto", "bf16", "fp16", "off"] = "auto"
    seed: int = 0
    val_every_steps: int = 0  # 0 = validate once per epoch
    val_images: int = 0  # 0 = all validation images
    val_metric: MetricName = "CIDEr"
    patience: int = 5  # epochs (validations) without improvement before stopping; 0 = never stop early
    checkpoint_every_steps: int = 0  # also write last.pt every N steps (0 = at the end of each epoch only)
    keep_validated: bool = False  # also keep the model of every validation as step-NNNNNNN.pt (to average later)
    group_by_image: bool = True  # an image's captions share a batch: its grid is projected once for all of them
    # batches of captions of similar lengths (the shuffled order sorted in pools of 50 batches): fewer decoder steps
    group_by_length: bool = False
    log_every: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if 0 < self.schedule_epochs < self.epochs:
            raise ConfigError(f"config key 'train.schedule_epochs': {self.schedule_epochs} is shorter than train.epochs "
                              f"({self.epochs}): the schedule would end before the training (0 = train.epochs)")
        if self.objective == "scst" and not self.init:
            raise ConfigError("config key 'train.objective': 'scst' needs train.init (--init RUN/best.pt), the "
                              "cross-entropy checkpoint it fine-tunes")
        if self.objective == "scst" and self.box_weight:
            raise ConfigError("config key 'train.box_weight': self-critical training has no attention terms (0)")
        if self.objective == "scst" and self.scst_baseline == "mean" and self.scst_samples < 2:
            raise ConfigError(f"config key 'train.scst_samples': {self.scst_samples} is not allowed with "
                              f"scst_baseline 'mean' (each sample is judged against the others: at least 2)")


@dataclass(frozen=True)
class DecodeConfig(_Section):
    SECTION: ClassVar[str] = "decode"
    beam_size: int = 5
    max_length: int = 20
    length_penalty: float = 1.0  # rank finished captions by logprob / length ** length_penalty
    no_repeat_ngram: int = 0  # 0 = off
    no_dangling: bool = True  # <end> never right after a function word: no "a man riding a"
    no_repeat_words: bool = False  # a content word at most once per caption: no "a man wearing a hat and a hat"
    # w: each content word's score gains w * log p(the photo shows it), p the word detector's (shallow fusion;
    # needs model.decoder.concepts); 0 = the decoder alone
    detector_weight: float = 0.0

    def with_overrides(self, **overrides: Any) -> DecodeConfig:
        """These settings with `overrides` (field names; None = keep). TypeError names unknown ones."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown decode setting(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        return dataclasses.replace(self, **overrides)

    def usable_by(self, detects_words: bool) -> DecodeConfig:
        """These settings, checked against a model (`detects_words`: it has a word detector)."""
        if self.detector_weight and not detects_words:
            raise ConfigError(f"decode.detector_weight (--detector-weight) {self.detector_weight:g}: this model has no "
                              f"word detector (model.decoder.concepts)")
        return self


@dataclass(frozen=True)
class Config(_Section):
    SECTION: ClassVar[str] = ""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        teacher = self.train.concept_teacher
        if self.train.concept_weight and teacher.startswith("detector") and not self.model.decoder.concepts:
            raise ConfigError("config key 'train.concept_weight': needs the word detector, model.decoder.concepts: true")
        if teacher != "detector" and not self.model.encoder.name.startswith("efficientnet_lite"):
            raise ConfigError(f"config key 'train.concept_teacher': {teacher!r} needs the ImageNet classifier of an "
                              f"EfficientNet-Lite encoder, not {self.model.encoder.name!r}")
        if self.data.augment and self.data.use_cache and self.model.encoder.trainable_stages == 0:
            raise ConfigError("config key 'data.augment': true has no effect with the feature cache of a frozen "
                              "encoder (set data.use_cache=false, or fine-tune with model.encoder.trainable_stages)")
        if self.data.mirror and not (self.data.use_cache and self.model.encoder.trainable_stages == 0):
            raise ConfigError("config key 'data.mirror': true needs the feature cache of a frozen encoder (with "
                              "images, data.augment crops and recolours them instead)")
        if self.decode.detector_weight and not self.model.decoder.concepts and not self.train.init:  # else: init's
            raise ConfigError("config key 'decode.detector_weight': needs the word detector, model.decoder.concepts: "
                              "true")
        if self.data.mirror and self.train.objective == "scst":
            raise ConfigError("config key 'data.mirror': true trains cross-entropy only (self-critical training "
                              "reads the photos' own grids)")
        if self.data.mirror and self.train.box_weight:
            raise ConfigError("config key 'data.mirror': true cannot go with train.box_weight (boxes are not mirrored)")
