import torch
import torch.nn.functional as F

from captioner.loss import caption_loss


def test_padding_positions_do_not_count():
    B, T, V, L = 2, 5, 7, 4
    logits = torch.randn(B, T, V)
    targets = torch.randint(0, V, (B, T))
    lengths = torch.tensor([5, 2])
    alphas = torch.full((B, T, L), 1.0 / L)
    out = caption_loss(logits, targets, lengths, alphas, alpha_reg=0.0)
    expected = F.cross_entropy(torch.cat([logits[0], logits[1, :2]]), torch.cat([targets[0], targets[1, :2]]))
    torch.testing.assert_close(out.xent, expected)
    # Garbage on padded positions changes nothing.
    logits2 = logits.clone()
    logits2[1, 2:] = 1e3
    torch.testing.assert_close(caption_loss(logits2, targets, lengths, alphas, alpha_reg=0.0).total, out.total)


def test_doubly_stochastic_regulariser():
    B, T, V, L = 1, 4, 5, 4
    logits, targets = torch.zeros(B, T, V), torch.zeros(B, T, dtype=torch.long)
    lengths = torch.tensor([4])
    # Each region looked at exactly once over the 4 steps: no penalty.
    once = torch.eye(L).unsqueeze(0)
    assert caption_loss(logits, targets, lengths, once).attention.item() == 0.0
    # Always region 0: coverage (4, 0, 0, 0) -> (1-4)^2 + 3 * 1 = 12.
    stuck = torch.zeros(B, T, L)
    stuck[..., 0] = 1
    out = caption_loss(logits, targets, lengths, stuck, alpha_reg=0.5)
    assert out.attention.item() == 12.0
    torch.testing.assert_close(out.total, out.xent + 6.0)
    # Padded regions are not penalised.
    region_mask = torch.tensor([[True, False, False, False]])
    assert caption_loss(logits, targets, lengths, stuck, region_mask=region_mask).attention.item() == 9.0
