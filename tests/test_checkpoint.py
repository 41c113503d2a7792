import pytest
import torch

from captioner.checkpoint import CheckpointError, load_checkpoint, load_model, save_checkpoint
from captioner.config import DecoderConfig, EncoderConfig, ModelConfig
from captioner.model import build_model
from captioner.vocab import Vocabulary

CFG = ModelConfig(
    encoder=EncoderConfig(name="random", image_size=64),
    decoder=DecoderConfig(embed_dim=8, hidden_dim=16, attention_dim=8, dropout=0.0),
)
VOCAB = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a", "red", "circle"])


def _saved(tmp_path):
    model = build_model(CFG, len(VOCAB)).eval()
    path = save_checkpoint(tmp_path / "run" / "model.pt", CFG, VOCAB, model.state_dict(), meta={"note": "x"})
    return model, path


def test_round_trip_gives_identical_outputs(tmp_path):
    model, path = _saved(tmp_path)
    images = torch.rand(2, 3, 64, 64)
    tokens = torch.tensor([[1, 4, 5, 6, 2], [1, 5, 2, 0, 0]])
    loaded, ckpt = load_model(path)
    assert ckpt.model_config == CFG and ckpt.vocab == VOCAB and ckpt.meta == {"note": "x"}
    with torch.no_grad():
        lengths = torch.tensor([4, 2])
        expected, got = model(images, tokens, lengths), loaded(images, tokens, lengths)
    assert torch.equal(expected.logits, got.logits) and torch.equal(expected.alphas, got.alphas)
    # Atomic write leaves no temporary files behind.
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_not_a_checkpoint(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(junk)
    _one_line(e, "junk.pt", "not a readable checkpoint")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "absent.pt")
    _one_line(e, "absent.pt", "not found")


def test_foreign_torch_file(tmp_path):
    foreign = tmp_path / "resnet.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(foreign)
    _one_line(e, "resnet.pt", "not a captioner checkpoint")


def test_checkpoint_that_does_not_fit_the_code(tmp_path):
    _, path = _saved(tmp_path)
    payload = torch.load(path, weights_only=True)
    payload["model_config"]["decoder"]["heads"] = 8  # a key this code does not know
    torch.save(payload, tmp_path / "newer.pt")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "newer.pt")
    _one_line(e, "newer.pt", "heads")

    payload = torch.load(path, weights_only=True)
    payload["model"]["decoder.readout.weight"] = torch.zeros(3, 3)  # wrong shape
    torch.save(payload, tmp_path / "mismatch.pt")
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "mismatch.pt")
    _one_line(e, "mismatch.pt", "readout")
