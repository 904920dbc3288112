"""side_logps takes the vocabulary's logsumexp only at target positions (issue 58): its values and
the logits' gradient must be the same bits as the whole-row formula it replaced."""

import torch

from paratrain.objectives.preference import side_logps


def whole_row(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The formula before issue 58: logsumexp over every position, then masked."""
    tokens, side = target[:, 0], target[:, 1]
    valid = tokens >= 0
    picked = logits.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    token_logp = torch.where(valid, picked - logits.logsumexp(-1), 0.0)
    return torch.stack([(token_logp * (valid & (side == s))).sum(-1) for s in (0, 1)], -1)


def test_side_logps_bitwise_equal_to_the_whole_row_formula():
    g = torch.Generator().manual_seed(0)
    b, t, v = 4, 53, 259  # unequal sides, a prompt, padding; the byte-level vocabulary of the benchmarks
    tokens = torch.randint(0, v, (b, t), generator=g)
    side = torch.full((b, t), -1)
    for r, (c, j) in enumerate([(20, 30), (9, 40), (25, 27), (3, 50)]):
        side[r, :c], side[r, c:j] = 0, 1
        tokens[r, j:] = -100  # padding
        tokens[r, : c // 2] = -100  # the chosen side's prompt
        tokens[r, c : c + (j - c) // 3] = -100  # the rejected side's prompt
    target = torch.stack([tokens, side], 1)
    logits = (3 * torch.randn(b, t, v, generator=g)).requires_grad_()
    upstream = torch.randn(b, 2, generator=g)

    got, counts = side_logps(logits, target)
    (grad,) = torch.autograd.grad((got * upstream).sum(), logits)
    want = whole_row(logits, target)
    (want_grad,) = torch.autograd.grad((want * upstream).sum(), logits)
    assert torch.equal(got, want)
    assert torch.equal(grad, want_grad)
    assert counts.tolist() == [[(tokens[r][side[r] == s] >= 0).sum().item() for s in (0, 1)] for r in range(b)]


def test_one_side_is_the_same_bits_and_gradient_as_both():
    """KTO's loss reads side 0 only and its KL pass side 1 only (sides=): the side's sum and the
    logits' gradient are the bits of both sides' formula with the other side's upstream 0."""
    g = torch.Generator().manual_seed(1)
    b, t, v = 3, 40, 259
    tokens = torch.randint(0, v, (b, t), generator=g)
    side = torch.full((b, t), -1)
    for r, (c, j) in enumerate([(15, 31), (7, 38), (20, 22)]):
        side[r, :c], side[r, c:j] = 0, 1
        tokens[r, j:], tokens[r, : c // 3], tokens[r, c : c + 2] = -100, -100, -100
    target = torch.stack([tokens, side], 1)
    logits = (3 * torch.randn(b, t, v, generator=g)).requires_grad_()
    for s in (0, 1):
        upstream = torch.zeros(b, 2)
        upstream[:, s] = torch.randn(b, generator=g)
        both, counts = side_logps(logits, target)
        (want,) = torch.autograd.grad((both * upstream).sum(), logits)
        one, one_counts = side_logps(logits, target, (s,))
        (grad,) = torch.autograd.grad((one * upstream).sum(), logits)
        assert torch.equal(one[:, s], both[:, s]) and not one[:, 1 - s].any()
        assert torch.equal(grad, want) and torch.equal(one_counts, counts)
