"""The decoder rewritten for inference graphs (captioner.deploy.step) computes the decoder's own step."""
import pytest
import torch

from captioner.config import DecoderConfig
from captioner.deploy import step as inference
from captioner.model.decoder import AttentionDecoder


@pytest.mark.parametrize("table", [True, False], ids=["readout-table", "readout-matmul"])
@pytest.mark.parametrize("gate", [True, False], ids=["gate", "no-gate"])
@pytest.mark.parametrize("attend", ["before", "after"])
@pytest.mark.parametrize("scene", [False, True], ids=["", "global-context"])
def test_inference_step_is_the_decoders_step(attend, gate, table, scene, monkeypatch):
    if not table:
        monkeypatch.setattr(inference, "READOUT_TABLE_MAX_VOCAB", 0)
    torch.manual_seed(0)
    cfg = DecoderConfig(embed_dim=16, hidden_dim=24, attention_dim=12, feature_dim=20, dropout=0.5, gate=gate,
                        attend=attend, global_context=scene)
    decoder = AttentionDecoder(40, 30, cfg, grid=(3, 4), pad_id=0).eval()
    with torch.no_grad():
        for p in decoder.parameters():  # larger than the init: differences would show
            p.mul_(3.0)
        grid = torch.randn(5, 12, 30)  # (B, L, D_enc); vocabulary 40
        memory = decoder.memory(grid)
        features, keys, state = inference.InferenceMemory(decoder)(grid)
        assert torch.equal(keys, memory.keys) and torch.equal(features, memory.features)
        step = inference.InferenceStep(decoder).eval()
        assert (step.readout_of_token is not None) == table
        want_state = got_state = state
        for tokens in torch.randint(1, 40, (4, 5)):  # four steps, each from its own previous state
            want = decoder.step(tokens, want_state, memory)
            logits, alpha, got_state = step(tokens, got_state, features, keys)
            torch.testing.assert_close(logits, want.logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(alpha, want.alpha, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got_state, want.hidden, atol=1e-5, rtol=1e-5)
            want_state = want.hidden
